"""The LSE's gradient through every CUDA backend with a backward (skipped without CUDA; run on the
lent GPU): ``kernel_backward(..., dlse=...)`` (Note [LSE gradient] in ``usp_dit.kernels.lse_grad``)
against a float64 reference of (out * w).sum() + (lse * w_lse).sum(), dense and causal, head dims
64 (one augmented call everywhere) and 128 (cuDNN's backward stops at 128: two calls there).

Pass rule (flash-attention's, as tests/gpu/test_backends_gpu.py): the error with the LSE term is at
most twice the same kernel's plain backward error (the loss without it, against its own float64
reference) plus 1e-3 (the two losses' gradients differ in scale and cancellation), and below 2e-2.
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import masked_attention_ref
from usp_dit.kernels import get_backend
from usp_dit.kernels.autograd import kernel_backward
from usp_dit.kernels.lse_grad import augmented_width, lse_columns
from usp_dit.testing import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BACKENDS = ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn_4", "flash_attn_3", "flash_attn_2"]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_through_the_kernel(name, dtype, head_dim, causal):
    backend = get_backend(name)
    if not backend.available():
        pytest.skip(f"{name} is not installed")
    if backend.caps.why_not("cuda", dtype, head_dim, True, causal) is not None:
        pytest.skip(backend.caps.why_not("cuda", dtype, head_dim, True, causal))
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, h, hk = 2, 777, 8, 2
    mk = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.float64)  # noqa: E731
    q, k, v = mk(b, s, h, head_dim), mk(b, s, hk, head_dim), mk(b, s, hk, head_dim)
    w_out, w_lse = mk(b, s, h, head_dim), mk(b, s, h)
    scale = head_dim ** -0.5
    visible = torch.ones(s, s, dtype=torch.bool, device="cuda")
    visible = visible.tril() if causal else visible
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = masked_attention_ref(*leaves, scale, visible)
    ref = torch.autograd.grad((out_ref * w_out).sum() + (lse_ref * w_lse).sum(), leaves, retain_graph=True)
    plain_ref = torch.autograd.grad((out_ref * w_out).sum(), leaves)
    qc, kc, vc, dout = (t.to(dtype) for t in (q, k, v, w_out))
    opts = {"causal": True} if causal else {}
    out, lse = backend.forward(qc, kc, vc, scale, **opts)
    plain = kernel_backward(backend, dout, qc, kc, vc, out, lse, scale, causal)
    grads = kernel_backward(backend, dout, qc, kc, vc, out, lse, scale, causal, dlse=w_lse.to(lse.dtype))
    plain_err = max(rel_err(a, r) for a, r in zip(plain, plain_ref))
    err = max(rel_err(a, r) for a, r in zip(grads, ref))
    path = augmented_width(backend, qc, lse_columns(dtype), causal)
    assert err <= 2 * plain_err + 1e-3 and err < 2e-2, (path, err, plain_err)
