"""Kernels on CPU: each backend and the blockwise (simulated ring) schedule against float64 maths.

Tolerances: float64 1e-12 (only float64 rounding); float32 1e-5, the project's bar: float32
rounding of D-long dot products, the fused CPU kernel's blocked softmax and a few merges reach
~2.5e-6 in gradients at D = 128.
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import attention_ref
from usp_dit.kernels import get_backend
from usp_dit.kernels.protocol import forward_stack
from usp_dit.testing.blockwise import blockwise_backward, blockwise_forward
from usp_dit.merge import LSEMerger
from usp_dit.ring import choose_schedule, gathered_sequence, remote_runs
from usp_dit.testing import rel_err

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _case(b, s, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


@pytest.mark.parametrize("schedule", ["stream", "gather", "allgather"])
@pytest.mark.parametrize("name", ["reference", "sdpa_cpu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", [(1, 29, 4, 4, 64), (2, 17, 8, 2, 128), (1, 6, 3, 1, 64)])
def test_blockwise_matches_reference(name, dtype, n, shape, schedule):
    backend = get_backend(name)
    q, k, v, dout = _case(*shape, dtype=dtype)
    scale = shape[-1] ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, scale)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    qc, kc, vc, doc = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = blockwise_forward(qc, kc, vc, backend, scale, n, schedule)
    grads = blockwise_backward(doc, qc, kc, vc, out, lse, backend, scale, n)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    errors = [rel_err(out, ref_out), rel_err(lse, ref_lse)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)]
    assert max(errors) <= TOL[dtype], errors


def test_merge_with_empty_side_is_exact():
    """A block with no keys (lse = -inf) leaves the running result unchanged."""
    out = torch.randn(1, 3, 2, 4)
    lse = torch.randn(1, 3, 2)
    m = LSEMerger()
    m.add(out, lse)
    m.add(torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    merged_out, merged_lse = m.result(torch.float32)
    assert torch.equal(merged_out, out) and torch.equal(merged_lse, lse)


def _partials(g: torch.Generator, blocks: int, shape=(2, 5, 3, 8)):
    """``blocks`` partial results (out, lse) of the same queries, lse of varied scale, float64."""
    outs = torch.randn(blocks, *shape, generator=g, dtype=torch.float64)
    lses = 10 * torch.randn(blocks, *shape[:3], generator=g, dtype=torch.float64)
    return outs, lses


def _merged_ref(outs: torch.Tensor, lses: torch.Tensor):
    """The exact merge: softmax weights over the blocks' LSEs."""
    lse = torch.logsumexp(lses, dim=0)
    return (torch.exp(lses - lse).unsqueeze(-1) * outs).sum(0), lse


@pytest.mark.parametrize("plan", [[1], [1, 1, 1], [3], [1, 4], [2, 1, 3], [1, 1, 2, 4]])
def test_merger_stacks_match_exact_merge(plan):
    """Blocks merged one by one, as stacks, or finished straight into float32: all equal the
    exact merge to float64 rounding (1e-12); the float32 finish to float32 rounding (1e-6)."""
    g = torch.Generator().manual_seed(len(plan))
    outs, lses = _partials(g, sum(plan))
    ref_out, ref_lse = _merged_ref(outs, lses)
    for finish in (False, True):
        m, i = LSEMerger(), 0
        for j, size in enumerate(plan):
            part = (outs[i:i + size], lses[i:i + size])
            i += size
            if finish and j == len(plan) - 1:
                out, lse = m.finish(torch.float32, *part)
            else:
                m.add_stack(*part)
        if not finish:
            out, lse = m.result(torch.float64)
        tol = 1e-6 if finish else 1e-12
        assert out.dtype == (torch.float32 if finish else torch.float64)
        assert rel_err(out, ref_out) <= tol and rel_err(lse, ref_lse) <= 1e-12


def test_merger_all_empty_blocks_give_zero_and_minus_inf():
    outs = torch.randn(3, 1, 2, 2, 4, dtype=torch.float64)
    lses = torch.full((3, 1, 2, 2), float("-inf"), dtype=torch.float64)
    m = LSEMerger()
    out, lse = m.finish(torch.float64, outs, lses)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_merger_does_not_modify_its_first_block():
    """The first block is held without a copy; merging must not write into it."""
    outs, lses = _partials(torch.Generator().manual_seed(3), 3)
    first = outs[0].clone(), lses[0].clone()
    m = LSEMerger()
    m.add(outs[0], lses[0])
    m.add_stack(outs[1:], lses[1:])
    assert torch.equal(outs[0], first[0]) and torch.equal(lses[0], first[1])


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


@pytest.mark.parametrize(
    "sizes, rank, runs",
    [
        ((4, 4, 4, 4), 0, [(1, 4, 4)]),
        ((4, 4, 4, 4), 2, [(0, 2, 4), (3, 4, 4)]),
        ((5, 5, 4, 4), 1, [(0, 1, 5), (2, 4, 4)]),
        ((5, 4, 0, 0), 0, [(1, 2, 4)]),  # empty blocks are skipped
        ((3, 3), 1, [(0, 1, 3)]),
        ((7,), 0, []),
    ],
)
def test_remote_runs(sizes, rank, runs):
    assert remote_runs(sizes, rank) == runs


@pytest.mark.parametrize(
    "block, ring, heads, kv_heads, expected",
    [
        (1152, 4, 24, 24, "allgather"),  # Flux R=4: blocks shorter than one transfer's worth of compute
        (4444, 4, 48, 48, "gather"),  # CogVideoX R=4: the local block hides most of the gather
        (11194, 4, 24, 24, "gather"),  # Mochi R=4
        (5597, 8, 24, 24, "stream"),  # Mochi R=8: the stream ring hides every transfer, gather would not
        (5597, 8, 24, 6, "gather"),  # the same with 4:1 grouped K/V: a quarter of the bytes travel
    ],
)
def test_auto_schedule_rule(block, ring, heads, kv_heads, expected):
    assert choose_schedule("auto", (block,) * ring, heads, kv_heads) == expected
    assert choose_schedule("stream", (block,) * ring, heads, kv_heads) == "stream"


def test_gathered_sequence_drops_padding_and_appends_joint():
    """The "allgather" schedule's fallback layout (batch > 1 or uneven blocks): each block's real
    tokens in rank order, then the joint tokens."""
    blocks = torch.arange(3 * 2 * 4 * 2 * 1, dtype=torch.float32).view(3, 2, 4, 2, 1)  # (R, B, L, Hk, D)
    joint = torch.full((2, 2, 2, 1), -1.0)
    uneven = gathered_sequence(blocks, (4, 3, 0), joint)
    expected = torch.cat([blocks[0], blocks[1][:, :3], joint], dim=1)
    torch.testing.assert_close(uneven, expected, rtol=0, atol=0)
    torch.testing.assert_close(gathered_sequence(blocks, (4, 4, 4), None), torch.cat(list(blocks), dim=1), rtol=0, atol=0)


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
