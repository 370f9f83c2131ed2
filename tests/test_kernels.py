"""Kernel adapters on CPU: each backend's own layout and bookkeeping against float64 maths, the
optional kernels faked where they cannot run here.

Tolerances: float64 1e-12 (only float64 rounding); the faked kernels are the float64 reference,
so anything beyond 1e-12 is the adapter's own doing.
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import attention_ref
from usp_dit.kernels import get_backend
from usp_dit.kernels.protocol import forward_stack
from usp_dit.testing import rel_err


@pytest.mark.parametrize("name", ["reference", "sdpa_cpu"])
def test_forward_stack_equals_one_call_per_block(name):
    backend = get_backend(name)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 64, generator=g)
    kb, vb = (torch.randn(3, 2, 7, 2, 64, generator=g) for _ in range(2))
    outs, lses = forward_stack(backend, q, kb, vb, 0.125)
    assert outs.shape == (3, 2, 5, 4, 64) and lses.shape == (3, 2, 5, 4)
    for i in range(3):
        out, lse = backend.forward(q, kb[i], vb[i], 0.125)
        assert torch.allclose(outs[i], out, atol=1e-6) and torch.allclose(lses[i], lse, atol=1e-6)


def test_flashinfer_adapter_layout_and_lse_base(monkeypatch):
    """The adapter's own logic on CPU, the package faked by the float64 reference: one call per batch
    entry in FlashInfer's (S, H, D) "NHD" layout, grouped K/V passed as they are, and the package's
    base-2 LSE turned into our natural log (the GPU tests check the real kernels the same way)."""
    import math
    import types

    from usp_dit.kernels import flashinfer as fi

    calls = []

    def single_prefill_with_kv_cache(q, k, v, causal, kv_layout, sm_scale, return_lse):
        assert kv_layout == "NHD" and not causal and return_lse
        calls.append((tuple(q.shape), tuple(k.shape)))
        out, lse = attention_ref(q[None], k[None], v[None], sm_scale)
        return out[0], lse[0] / math.log(2)  # base 2, as FlashInfer's kernels store it

    monkeypatch.setattr(fi, "_module", lambda: types.SimpleNamespace(single_prefill_with_kv_cache=single_prefill_with_kv_cache))
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 7, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 5, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = fi.FlashInferBackend().forward(q, k, v, 0.3)
    ref_out, ref_lse = attention_ref(q, k, v, 0.3)
    assert calls == [((7, 4, 8), (5, 2, 8))] * 2
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


def _matches_reference(backend, q, k, v, dout, scale=0.3):
    """The adapter's out, LSE and gradients equal the float64 reference's (its kernel is faked by
    the reference, so anything beyond 1e-12 is the adapter's own layout or bookkeeping); returns
    the reference output."""
    out, lse = backend.forward(q, k, v, scale)
    ref_out, ref_lse = attention_ref(q, k, v, scale)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*leaves, scale)[0], leaves, dout)
    for got, want in zip(backend.backward(dout, q, k, v, out, lse, scale), ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    return ref_out


def test_flash_attn_2_adapter_layout_and_caller_allocated_grads(monkeypatch):
    """The FA2 adapter's own logic on CPU, the package's private functions faked by the reference:
    LSE handed back (B, H, S) and read back by the backward in that layout, gradients written into
    the dq/dk/dv the adapter allocates (2.7+ signatures; the GPU tests check the real kernels)."""
    import types

    from usp_dit.kernels import flash2

    def fwd(q, k, v, dropout_p, scale, causal, window_left, window_right, softcap, alibi, return_softmax):
        assert (dropout_p, causal, window_left, window_right, softcap, alibi, return_softmax) == (0.0, False, -1, -1, 0.0, None, False)
        out, lse = attention_ref(q, k, v, scale)
        return out, lse.transpose(1, 2).contiguous(), None, None

    def bwd(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, wl, wr, softcap, alibi, deterministic):
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.is_contiguous()
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        grads = torch.autograd.grad(attention_ref(*leaves, scale)[0], leaves, dout)
        for buf, grad in zip((dq, dk, dv), grads):
            buf.copy_(grad)
        return None

    fake = types.SimpleNamespace(_flash_attn_forward=fwd, _flash_attn_backward=bwd)
    monkeypatch.setattr(flash2, "_interface", lambda: fake)
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(2, 6, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 5, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    _matches_reference(flash2.FlashAttn2Backend(), q, k, v, dout)


def test_flash_attn_3_adapter_keywords_layout_and_splits(monkeypatch):
    """The FA3 adapter's own logic on CPU, its ops faked by the float64 reference: arguments by
    keyword, LSE handed back (B, H, S) and read back by the backward in that layout, the split count
    left to the kernel (0) unless forced, and forward_stack's stride-0 ``q`` made real."""
    import types

    from usp_dit.kernels import flash3

    seen = []

    def fwd(q, k, v, *, softmax_scale, is_causal, num_splits):
        assert not is_causal and q.stride(0) != 0
        seen.append(num_splits)
        out, lse = attention_ref(q, k, v, softmax_scale)
        return out, lse.transpose(1, 2).contiguous(), None, None

    def bwd(dout, q, k, v, out, lse, *, softmax_scale, is_causal):
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.is_contiguous() and not is_causal
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        return (*torch.autograd.grad(attention_ref(*leaves, softmax_scale)[0], leaves, dout), None)

    monkeypatch.setattr(flash3, "_ops", lambda: types.SimpleNamespace(fwd=fwd, bwd=bwd))
    g = torch.Generator().manual_seed(8)
    q, dout = (torch.randn(1, 6, 24, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 4096, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    backend = flash3.FlashAttn3Backend()
    ref_out = _matches_reference(backend, q, k, v, dout)
    outs, lses = forward_stack(backend, q, k.unsqueeze(0).expand(2, -1, -1, -1, -1), v.unsqueeze(0).expand(2, -1, -1, -1, -1), 0.3)
    torch.testing.assert_close(outs[1], ref_out, rtol=0, atol=1e-12)
    forced, _ = flash3.fa3_forward(q, k, v, 0.3, num_splits=2)  # the benchmarks' knob, not the backend's
    torch.testing.assert_close(forced, outs[1], rtol=0, atol=1e-12)
    assert seen == [0, 0, 2]


def test_flashinfer_needs_nvcc_or_prebuilt_kernels(monkeypatch, tmp_path):
    """FlashInfer compiles on first use: without nvcc (or flashinfer-jit-cache) "auto" must not pick it."""
    from usp_dit.kernels import flashinfer as fi

    monkeypatch.setattr(fi.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert not fi.can_build_kernels()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert fi.can_build_kernels()


def test_sage_adapter_leaves_inputs_alone_and_keeps_v_in_fp16_range(monkeypatch):
    """The SageAttention adapter's own logic on CPU, ``sageattn`` faked as 1.0.6 behaves where it
    matters here: ``smooth_k=True`` would subtract the mean key in place, and V is cast to fp16
    and summed in fp16 blocks of 64 keys (inf past 65504). The fake computes float64 attention
    from the fp16 V it would see; the adapter must hand it max|V| <= 2^9, leave the caller's K and
    V untouched, and return the attention of the original inputs (to bf16 rounding, 1e-2)."""
    import types

    from usp_dit.kernels import sage

    def sageattn(q, k, v, tensor_layout, is_causal, sm_scale, smooth_k):
        assert tensor_layout == "NHD" and not is_causal and q.dtype == k.dtype == v.dtype
        assert k.shape[2] == q.shape[2]  # K/V expanded for GQA
        if smooth_k:
            k -= k.mean(dim=1, keepdim=True)
        v16 = v.to(torch.float16)
        assert torch.isfinite(v16).all() and v16.abs().max() <= 2.0 ** 9
        out, _ = attention_ref(q.double(), k.double(), v16.double(), sm_scale)
        return out.to(q.dtype)

    monkeypatch.setattr(sage, "_module", lambda: types.SimpleNamespace(sageattn=sageattn))
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 9, 4, 64, generator=g, dtype=torch.float64)
    k = torch.randn(2, 11, 2, 64, generator=g, dtype=torch.float64) + 3.0  # a mean for the smoothing to remove
    v = torch.randn(2, 11, 2, 64, generator=g, dtype=torch.float64)
    v[0, :, 1] *= 1e5  # one head far past fp16's range, the others ordinary
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    kept = kb.clone(), vb.clone()
    out, lse = sage.SageBackend().forward(qb, kb, vb, 0.125)
    assert lse is None and out.dtype == torch.bfloat16
    assert torch.equal(kb, kept[0]) and torch.equal(vb, kept[1])
    ref, _ = attention_ref(qb.double(), kb.double(), vb.double(), 0.125)
    assert rel_err(out, ref) < 1e-2
    scale = sage.fp16_safe_scale(vb)  # (B, 1, Hk, 1): 1 for ordinary heads, the least power of two else
    big = vb[0, :, 1].abs().max().float() / scale[0, 0, 1]
    assert scale[1].eq(1).all() and scale[0, 0, 0].item() == 1 and 2.0 ** 8 < big <= 2.0 ** 9


class _PaddedOnlyReference:
    """Stands in for an aten SDPA op (Note [padded head_dim] in usp_dit.kernels.sdpa_cuda): the
    float64 reference kernel, refusing any head_dim that is not a multiple of 8 as those ops do."""

    def __init__(self):
        self.reference = get_backend("reference")
        self.seen: list[int] = []

    def check(self, *tensors):
        self.seen += [t.shape[-1] for t in tensors]
        assert all(t.shape[-1] % 8 == 0 for t in tensors), [t.shape for t in tensors]


def test_cuda_sdpa_backends_pad_any_head_dim_exactly():
    """A head_dim of 20 (DreamLite) runs through an op that takes multiples of 8 only: out, LSE and
    every gradient equal the unpadded reference's to float64 rounding (zero columns add 0 to each
    score; the padded columns are cut away)."""
    from usp_dit.kernels.sdpa_cuda import _CudaSDPA

    inner = _PaddedOnlyReference()

    class Fake(_CudaSDPA):
        def forward(self, q, k, v, scale, causal=False, key_mask=None):
            inner.check(q, k, v)
            return inner.reference.forward(q, k, v, scale, causal=causal, key_mask=key_mask)

        def forward_out(self, q, k, v, scale):
            inner.check(q, k, v)
            return inner.reference.forward(q, k, v, scale)[0]

        def backward(self, dout, q, k, v, out, lse, scale, causal=False, key_mask=None):
            inner.check(dout, q, k, v, out)
            return inner.reference.backward(dout, q, k, v, out, lse, scale, causal=causal, key_mask=key_mask)

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 13, 4, 20, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.tensor([[True] * 13, [True] * 9 + [False] * 4])
    scale = 20 ** -0.5
    fake, ref = Fake(), inner.reference
    for kwargs in ({}, {"causal": True}, {"key_mask": mask}):
        out, lse = fake.forward(q, k, v, scale, **kwargs)
        ref_out, ref_lse = ref.forward(q, k, v, scale, **kwargs)
        assert out.shape == q.shape and rel_err(out, ref_out) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
        grads = fake.backward(dout, q, k, v, ref_out, ref_lse, scale, **kwargs)
        for got, want in zip(grads, ref.backward(dout, q, k, v, ref_out, ref_lse, scale, **kwargs)):
            assert got.shape == want.shape and rel_err(got, want) <= 1e-12
    assert rel_err(fake.forward_out(q, k, v, scale), ref.forward(q, k, v, scale)[0]) <= 1e-12
    assert set(inner.seen) == {24}  # every op call saw the padded head_dim
    assert fake.forward(q[..., :16], k[..., :16], v[..., :16], scale)[0].shape[-1] == 16  # 16: no padding
    assert set(inner.seen) == {16, 24}


@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient"])
def test_cuda_sdpa_backends_take_any_head_dim(name):
    """The caps no longer refuse head_dim 20, so "auto" takes a fused kernel for DreamLite, not the reference."""
    assert get_backend(name).caps.why_not("cuda", torch.bfloat16, 20, True) is None
