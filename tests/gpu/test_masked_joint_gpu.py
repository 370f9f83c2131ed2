"""Masked joint tokens on the GPU (Note [masked joint tokens] in usp_dit.attention.masked_joint).

- The protocol's ``key_mask`` on the mem-efficient SDPA adapter (the CUDA kernel the joint call
  falls back to): out, LSE and gradients against a float32 masked reference, and a batch element
  with every key masked (out 0, lse -inf).
- ``usp_attention(joint_mask=...)`` at world size 1 with every installed kernel that has a
  backward, bf16: out, joint out and every gradient against the float32 reference that drops the
  masked keys; then ``torch.compile(fullgraph=True)`` (inductor) against eager.

Tolerance: 2e-2 of the largest reference entry, bf16 rounding of 128-long dot products (the
suite's bf16 bar); compiled vs eager 1e-2 (the same kernels; inductor fuses the rest).
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import masked_attention_ref
from usp_dit import usp_attention
from usp_dit.kernels import get_backend
from usp_dit.testing import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KERNELS = ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn_2", "flash_attn_3", "flash_attn_4"]
MASK = [[1] * 20 + [0] * 57, [1, 0] * 38 + [1]]  # a prefix; holes


def _inputs(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, s, t, h, hk, d = 2, 1000, 77, 8, 2, 128
    shapes = {"q": (b, s, h, d), "k": (b, s, hk, d), "v": (b, s, hk, d), "jq": (b, t, h, d), "jk": (b, t, hk, d),
              "jv": (b, t, hk, d), "g": (b, s, h, d), "gj": (b, t, h, d)}
    x = {n: torch.randn(sh, generator=g, device="cuda") for n, sh in shapes.items()}
    x["mask"] = torch.tensor(MASK, dtype=torch.bool, device="cuda")
    return x


def _reference(x):
    names = ("q", "k", "v", "jq", "jk", "jv")
    leaves = {n: x[n].double().requires_grad_() for n in names}
    n = x["q"].shape[1]
    keys = torch.cat([torch.ones(2, n, dtype=torch.bool, device="cuda"), x["mask"]], 1)
    cat = [torch.cat([leaves[a], leaves[b]], 1) for a, b in (("q", "jq"), ("k", "jk"), ("v", "jv"))]
    out, _ = masked_attention_ref(*cat, 128 ** -0.5, keys[:, None, None, :])
    loss = (out[:, :n] * x["g"]).sum() + (out[:, n:] * x["gj"]).sum()
    return [out[:, :n], out[:, n:], *torch.autograd.grad(loss, [leaves[m] for m in names])]


def _run(x, backend: str, fn=None):
    leaves = {n: x[n].bfloat16().requires_grad_() for n in ("q", "k", "v", "jq", "jk", "jv")}

    def call(q, k, v, jq, jk, jv, mask):
        res = usp_attention(q, k, v, joint_q=jq, joint_k=jk, joint_v=jv, joint_mask=mask, backend=backend)
        return res.out, res.joint_out

    out, jout = (fn or call)(*leaves.values(), x["mask"])
    loss = (out.float() * x["g"]).sum() + (jout.float() * x["gj"]).sum()
    return [out, jout, *torch.autograd.grad(loss, list(leaves.values()))], call


def test_efficient_kernel_key_mask():
    backend = get_backend("sdpa_efficient")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(2, 300, 8, 64, generator=g, device="cuda") for _ in range(2))
    k, v = (torch.randn(2, 77, 2, 64, generator=g, device="cuda") for _ in range(2))
    mask = torch.tensor([[1, 0] * 38 + [1], [0] * 77], dtype=torch.bool, device="cuda")
    out, lse = backend.forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125, key_mask=mask)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    leaves = [t[:1].double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = masked_attention_ref(*leaves, 0.125, mask[:1, None, None, :])
    assert rel_err(out[:1], ref_out) <= 2e-2 and rel_err(lse[:1], ref_lse) <= 2e-2
    grads = backend.backward(dout[:1].bfloat16(), *(t[:1].bfloat16() for t in (q, k, v)), out[:1], lse[:1], 0.125,
                             key_mask=mask[:1])
    for got, want in zip(grads, torch.autograd.grad((ref_out * dout[:1]).sum(), leaves)):
        assert rel_err(got, want) <= 2e-2


@pytest.mark.parametrize("name", KERNELS)
def test_masked_joint_world_one_eager_and_compiled(name):
    kernel = get_backend(name)
    if not kernel.available() or kernel.caps.why_not("cuda", torch.bfloat16, 128, True) is not None:
        pytest.skip(f"{name} is not installed or cannot run bf16 head_dim 128 with a backward")
    x = _inputs()
    ref = _reference(x)
    eager, call = _run(x, name)
    for got, want in zip(eager, ref):
        assert rel_err(got, want) <= 2e-2
    torch._dynamo.reset()
    compiled, _ = _run(x, name, torch.compile(call, fullgraph=True))
    for got, want in zip(compiled, eager):
        assert rel_err(got, want) <= 1e-2
