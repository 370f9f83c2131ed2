"""GPU kernels (skipped without CUDA; run on the lent H200): output, LSE and gradients of every CUDA
backend against a float64 reference, on the whole sequence, under the ring schedules simulated
on one GPU (N virtual ranks, ``blockwise``) and under Ulysses head splits (N virtual ranks).

Pass rule for bf16/fp16 (flash-attention's rule): the blockwise error of a quantity is at most
2x the same kernel's error on the whole sequence, plus 1e-5 of slack so that quantities the kernel
gets to float32 rounding (the LSE) do not fail on noise; and the whole-sequence error itself is
below 2e-2 (bf16 has 8 mantissa bits).
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import attention_ref
from usp_dit import usp_attention
from usp_dit.kernels import get_backend
from usp_dit.testing import rel_err
from usp_dit.testing.blockwise import blockwise_backward, blockwise_forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BACKENDS = ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn_4", "flash_attn_3", "flash_attn_2"]
FORWARD_ONLY = ["flashinfer"]  # an LSE but no backward


def _backend(name: str):
    """The backend, or a skip when its optional package is not installed here."""
    backend = get_backend(name)
    if not backend.available():
        pytest.skip(f"{name} is not installed")
    return backend
SHAPES = [(1, 1000, 4, 4, 64), (2, 777, 8, 2, 128), (1, 4608, 24, 24, 128)]


def _inputs(b, s, h, hk, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.float64)  # noqa: E731
    return mk(b, s, h, d), mk(b, s, hk, d), mk(b, s, hk, d), mk(b, s, h, d)


def _errors(backend, q, k, v, dout, dtype, n, ref, schedule="stream"):
    scale = q.shape[-1] ** -0.5
    qc, kc, vc, doc = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = blockwise_forward(qc, kc, vc, backend, scale, n, schedule)
    errors = {"out": rel_err(out, ref[0]), "lse": rel_err(lse, ref[1])}
    if backend.caps.supports_backward:
        grads = blockwise_backward(doc, qc, kc, vc, out, lse, backend, scale, n)
        errors.update(zip(["dq", "dk", "dv"], [rel_err(a, b) for a, b in zip(grads, ref[2:])]))
    return errors


@pytest.mark.parametrize("name", BACKENDS + FORWARD_ONLY)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backend_whole_and_blockwise(name, dtype, shape):
    backend = _backend(name)
    q, k, v, dout = _inputs(*shape)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, shape[-1] ** -0.5)
    ref = (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout))
    whole = _errors(backend, q, k, v, dout, dtype, 1, ref)
    assert max(whole.values()) < 2e-2, whole
    for schedule in ("stream", "gather_merge", "gather_one_call"):
        for n in (2, 4, 8):
            blocks = _errors(backend, q, k, v, dout, dtype, n, ref, schedule)
            bad = {key: (blocks[key], whole[key]) for key in whole if blocks[key] > 2 * whole[key] + 1e-5}
            assert not bad, f"{schedule} N={n}: (blockwise, whole) errors {bad}"


def _ulysses_errors(backend, q, k, v, dout, dtype, n, ref):
    """Ulysses on one GPU: N virtual ranks, rank i attends over the whole sequence with its 1/N of
    the query heads and the K/V heads they read (contiguous, as after the all-to-all)."""
    h, hk = q.shape[2], k.shape[2]
    group, scale = h // hk, q.shape[-1] ** -0.5
    qc, kc, vc, doc = (t.to(dtype) for t in (q, k, v, dout))
    outs, lses, grads = [], [], [[], [], []]
    for i in range(n):
        a, b = i * h // n, (i + 1) * h // n
        ka, kb = a // group, -(-b // group)
        part = [t[:, :, x:y].contiguous() for t, (x, y) in zip((qc, kc, vc), ((a, b), (ka, kb), (ka, kb)))]
        out, lse = backend.forward(*part, scale)
        outs.append(out)
        lses.append(lse)
        if backend.caps.supports_backward:
            for acc, g in zip(grads, backend.backward(doc[:, :, a:b].contiguous(), *part, out, lse, scale)):
                acc.append(g)
    errors = {"out": rel_err(torch.cat(outs, 2), ref[0])}
    if backend.caps.returns_lse:
        errors["lse"] = rel_err(torch.cat(lses, 2), ref[1])
    if backend.caps.supports_backward:  # K/V heads read by several ranks sum their gradients
        dq = torch.cat(grads[0], 2)
        dk, dv = (torch.zeros(k.shape, dtype=torch.float64, device=k.device) for _ in range(2))
        for i, (gk, gv) in enumerate(zip(grads[1], grads[2])):
            ka = i * h // n // group
            dk[:, :, ka:ka + gk.shape[2]] += gk.double()
            dv[:, :, ka:ka + gv.shape[2]] += gv.double()
        errors.update(dq=rel_err(dq, ref[2]), dk=rel_err(dk, ref[3]), dv=rel_err(dv, ref[4]))
    return errors


@pytest.mark.parametrize("name", BACKENDS + FORWARD_ONLY)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
def test_backend_under_ulysses(name, shape):
    """Head splits over N = 2, 4, 8 virtual ranks (GQA 8:2 included: at N = 4 and 8 ranks share a
    K/V head), bf16, against float64; same pass rule as the ring."""
    backend = _backend(name)
    q, k, v, dout = _inputs(*shape)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, shape[-1] ** -0.5)
    ref = (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout))
    whole = _ulysses_errors(backend, q, k, v, dout, torch.bfloat16, 1, ref)
    assert max(whole.values()) < 2e-2, whole
    for n in (2, 4, 8):
        split = _ulysses_errors(backend, q, k, v, dout, torch.bfloat16, n, ref)
        bad = {key: (split[key], whole[key]) for key in whole if split[key] > 2 * whole[key] + 1e-5}
        assert not bad, f"N={n}: (ulysses, whole) errors {bad}"


@pytest.mark.parametrize("name", BACKENDS + FORWARD_ONLY)
def test_world_size_one_is_the_kernel(name):
    """At P = 1 usp_attention returns exactly what the kernel returns (no extra arithmetic)."""
    backend = _backend(name)
    q, k, v, _ = (t.to(torch.bfloat16) for t in _inputs(1, 512, 8, 8, 128))
    out, _, lse, _ = usp_attention(q, k, v, backend=name, return_lse=True)
    ref_out, ref_lse = backend.forward(q, k, v, 128 ** -0.5)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_auto_picks_the_fastest_installed_for_bf16():
    """The measured table in ``base._AUTO_ORDER`` with the kernels this machine has, for calls big
    enough for every kernel: training FA4, then FA3; inference FA3 at head_dim 128 and FA4 at 64,
    then the other, then (forward only) FlashInfer; cuDNN where none of them is installed."""
    from usp_dit.kernels import select_backend

    have = {name: get_backend(name).available() for name in ("flash_attn_3", "flash_attn_4", "flashinfer")}
    first = lambda *names: next((n for n in names if have[n]), "sdpa_cudnn")  # noqa: E731
    pick = lambda head_dim, grad: select_backend("auto", "cuda", torch.bfloat16, head_dim, grad, 1e13).name  # noqa: E731
    assert pick(128, True) == first("flash_attn_4", "flash_attn_3")
    assert pick(128, False) == first("flash_attn_3", "flash_attn_4", "flashinfer")
    assert pick(64, False) == first("flash_attn_4", "flash_attn_3", "flashinfer")
    if have["flash_attn_3"]:  # a call too small for FA4's per-call cost
        assert select_backend("auto", "cuda", torch.bfloat16, 128, True, 1e10).name == "flash_attn_3"


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
def test_flash_attn_3_key_splits_are_exact(splits):
    """FA3's split-KV forward (partials combined inside the op) at one rank's share of Flux, where
    forcing splits was measured (benchmarks --suite splits): out and LSE against float64, within 2x
    the unsplit call's error."""
    backend = _backend("flash_attn_3")
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(1, 1152, 24, 128, device="cuda", generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 4608, 24, 128, device="cuda", generator=g, dtype=torch.float64) for _ in range(2))
    ref_out, ref_lse = attention_ref(q, k, v, 128 ** -0.5)
    errors = {}
    from usp_dit.kernels.flash3 import fa3_forward

    for forced in (1, splits):
        out, lse = fa3_forward(*(t.to(torch.bfloat16) for t in (q, k, v)), 128 ** -0.5, num_splits=forced)
        errors[forced] = (rel_err(out, ref_out), rel_err(lse, ref_lse))
    assert max(errors[1]) < 2e-2, errors
    assert errors[splits][0] <= 2 * errors[1][0] + 1e-5 and errors[splits][1] <= 2 * errors[1][1] + 1e-5, errors


def test_flashinfer_forward_only_is_loud_about_gradients():
    _backend("flashinfer")
    q, k, v, _ = (t.to(torch.bfloat16) for t in _inputs(1, 256, 4, 4, 128))
    assert usp_attention(q, k, v, backend="flashinfer").out.shape == q.shape
    with pytest.raises(NotImplementedError, match="no backward.*sdpa_cudnn"):
        usp_attention(q.requires_grad_(), k, v, backend="flashinfer")


def test_fused_merge_matches_float64_maths():
    """The Triton merge (used by LSEMerger on CUDA) against the merge formula in float64."""
    from usp_dit.attention.merge import LSEMerger

    g = torch.Generator(device="cuda").manual_seed(3)
    b, s, h, d = 2, 333, 5, 128
    outs = [torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(4)]
    lses = [torch.randn(b, h, s, device="cuda", generator=g).transpose(1, 2) * 3 for _ in range(4)]
    merger = LSEMerger()
    for o, l in zip(outs, lses):
        merger.add(o, l)
    out, lse = merger.result(torch.float32)
    l64 = torch.stack([l.double() for l in lses])
    ref_lse = torch.logsumexp(l64, dim=0)
    ref_out = sum(torch.exp(l - ref_lse).unsqueeze(-1) * o.double() for o, l in zip(outs, l64))
    assert rel_err(lse, ref_lse) < 1e-6 and rel_err(out, ref_out) < 1e-6


@pytest.mark.parametrize("plan", [[1, 3], [2, 2], [1, 1, 2]])
def test_fused_stack_merge_matches_float64_maths(plan):
    """Stacks merged by the Triton kernel, the last one written straight to bf16: LSE to float32
    rounding (1e-6), out to bf16 rounding (4e-3: 8 mantissa bits)."""
    from usp_dit.attention.merge import LSEMerger

    g = torch.Generator(device="cuda").manual_seed(4)
    n, (b, s, h, d) = sum(plan), (2, 333, 5, 64)
    outs = torch.randn(n, b, h, s, d, device="cuda", generator=g).to(torch.bfloat16).transpose(2, 3)
    lses = torch.randn(n, b, h, s, device="cuda", generator=g).transpose(2, 3) * 3
    merger, i = LSEMerger(), 0
    for j, size in enumerate(plan):
        part = outs[i:i + size], lses[i:i + size]
        i += size
        if j < len(plan) - 1:
            merger.add_stack(*part)
    out, lse = merger.finish(torch.bfloat16, *part)
    ref_lse = torch.logsumexp(lses.double(), dim=0)
    ref_out = (torch.exp(lses.double() - ref_lse).unsqueeze(-1) * outs.double()).sum(0)
    assert out.dtype == torch.bfloat16 and rel_err(lse, ref_lse) < 1e-6 and rel_err(out, ref_out) < 4e-3


@pytest.mark.parametrize("name", BACKENDS + FORWARD_ONLY)
@pytest.mark.parametrize("batch", [1, 2])
def test_forward_stack_equals_one_call_per_block(name, batch):
    """A stack of blocks in one call (cuDNN folds them into its batch) equals one call per block."""
    from usp_dit.kernels.protocol import forward_stack

    backend = _backend(name)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(batch, 300, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    kb, vb = (torch.randn(3, batch, 257, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    outs, lses = forward_stack(backend, q, kb, vb, 0.1)
    for i in range(3):
        out, lse = backend.forward(q, kb[i], vb[i], 0.1)
        assert rel_err(outs[i], out) < 4e-3 and rel_err(lses[i], lse) < 1e-5


@pytest.mark.parametrize("shape", [(1, 4608, 24, 24, 128), (2, 777, 8, 2, 128), (1, 2000, 8, 8, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_sage_whole_and_under_ulysses(shape):
    """SageAttention (INT8 Q.K: about 1e-2 to 3e-2 of error by its authors' measurements, so 5e-2
    on the whole sequence) at world size 1 and under Ulysses head splits (N = 2, 4, 8, GQA 8:2
    included), where each split may be at most 2x the whole-sequence error; the caller's K and V
    come back untouched (sageattn's own smoothing would subtract the mean key in place)."""
    backend = _backend("sage")
    q, k, v, dout = _inputs(*shape)
    ref, _ = attention_ref(q, k, v, shape[-1] ** -0.5)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    kept = kb.clone(), vb.clone()
    whole = rel_err(usp_attention(qb, kb, vb, backend="sage").out, ref)
    assert whole < 5e-2
    assert torch.equal(kb, kept[0]) and torch.equal(vb, kept[1])
    for n in (2, 4, 8):
        split = _ulysses_errors(backend, q, k, v, dout, torch.bfloat16, n, (ref,))
        assert split["out"] <= 2 * whole + 1e-5, (n, split, whole)
    with pytest.raises(NotImplementedError, match="no backward"):
        usp_attention(qb.requires_grad_(), kb, vb, backend="sage")


def test_sage_large_values_stay_finite():
    """V past fp16's range in bf16 (sage casts V to fp16 and sums P.V in fp16 blocks of 64 keys):
    the adapter's power-of-two rescaling keeps the output finite and as accurate as for ordinary V."""
    backend = _backend("sage")
    q, k, v, _ = _inputs(1, 4608, 24, 24, 128, seed=1)
    v[:, :, :6] *= 3e4  # 6 of 24 heads: up to ~1.4e5, inf in fp16
    ref, _ = attention_ref(q, k, v, 128 ** -0.5)
    out = backend.forward(*(t.to(torch.bfloat16) for t in (q, k, v)), 128 ** -0.5)[0]
    assert torch.isfinite(out).all() and rel_err(out, ref) < 5e-2


def _causal_ring_errors(backend, q, k, v, dout, dtype, n, layout, ref):
    """Causal attention simulated on one GPU as the ring runs it: N virtual ring ranks in ``layout``,
    each rank's plans against every block (``usp_dit.attention.masks``), merged and differentiated by the
    ring's own functions; N = 1 is the kernel's causal call on the whole sequence."""
    from usp_dit.attention.masked import RowMerger, attend_plan, masked_block_grads
    from usp_dit.attention.masks import ring_plans
    from usp_dit.sharding.layouts import block_positions

    seq, scale = q.shape[1], q.shape[-1] ** -0.5
    qc, kc, vc, doc = (t.to(dtype) for t in (q, k, v, dout))
    idx = [b.to(q.device) for b in block_positions(seq, n, 1, layout)]
    out, lse = torch.empty_like(qc), torch.empty(q.shape[:3], device=q.device)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64, device=q.device) for t in (q, k, v))
    for r in range(n):
        plans = ring_plans(seq, n, 1, layout, 1, r)
        merger = RowMerger(qc[:, idx[r]])
        for j, plan in enumerate(plans):
            attend_plan(merger, qc[:, idx[r]], kc[:, idx[j]], vc[:, idx[j]], plan, backend, scale)
        o_r, l_r = merger.result(dtype)
        out[:, idx[r]], lse[:, idx[r]] = o_r, l_r
        if backend.caps.supports_backward:
            for j, plan in enumerate(plans):
                g = masked_block_grads(backend, doc[:, idx[r]], qc[:, idx[r]], kc[:, idx[j]], vc[:, idx[j]],
                                       o_r, l_r, scale, plan)
                dq[:, idx[r]] += g[0].double()
                dk[:, idx[j]] += g[1].double()
                dv[:, idx[j]] += g[2].double()
    errors = {"out": rel_err(out, ref[0])}
    if backend.caps.returns_lse:
        errors["lse"] = rel_err(lse, ref[1])
    if backend.caps.supports_backward:
        errors.update(dq=rel_err(dq, ref[2]), dk=rel_err(dk, ref[3]), dv=rel_err(dv, ref[4]))
    return errors


@pytest.mark.parametrize("name", BACKENDS + FORWARD_ONLY)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_backend_causal_whole_and_ring(name, shape):
    """The kernel's causal mode (square diagonal calls) against a float64 masked reference, on
    the whole sequence and under the causal ring in every layout at N = 2, 4, 8; same pass rule."""
    from tests.reference import frame_causal_mask, masked_attention_ref

    backend = _backend(name)
    q, k, v, dout = _inputs(*shape)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = masked_attention_ref(*leaves, shape[-1] ** -0.5, frame_causal_mask(shape[1], 1).cuda())
    ref = (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout))
    whole = _causal_ring_errors(backend, q, k, v, dout, torch.bfloat16, 1, "contiguous", ref)
    assert max(whole.values()) < 2e-2, whole
    for layout in ("contiguous", "zigzag", "stripe"):
        for n in (2, 4, 8):
            ring = _causal_ring_errors(backend, q, k, v, dout, torch.bfloat16, n, layout, ref)
            bad = {key: (ring[key], whole[key]) for key in whole if ring[key] > 2 * whole[key] + 1e-5}
            assert not bad, f"{layout} N={n}: (ring, whole) errors {bad}"


@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa_efficient"])
@pytest.mark.parametrize("shape", [(2, 777, 8, 2, 128), (1, 1100, 6, 6, 256)], ids=lambda s: "x".join(map(str, s)))
def test_forward_out_and_head_dim_256(name, shape):
    """``forward_out`` (no LSE: what a one-rank call without return_lse runs) against float64, as
    close as ``forward``'s own output (the file's bf16 rule: 2e-2, and within 2x forward's error);
    cuDNN's head_dim 256 forward (AuraFlow's) with its LSE too (2e-2: bf16 inputs)."""
    backend = _backend(name)
    q, k, v, _ = _inputs(*shape)
    ref_out, ref_lse = attention_ref(q, k, v, shape[-1] ** -0.5)
    qc, kc, vc = (t.to(torch.bfloat16) for t in (q, k, v))
    out, lse = backend.forward(qc, kc, vc, shape[-1] ** -0.5)
    plain = backend.forward_out(qc, kc, vc, shape[-1] ** -0.5)
    err, err_plain = rel_err(out, ref_out), rel_err(plain, ref_out)
    lse_err = rel_err(lse, ref_lse)
    assert err < 2e-2 and err_plain <= 2 * err + 1e-5 and lse_err < 2e-2, (err, err_plain, lse_err)
    with torch.no_grad():
        assert rel_err(usp_attention(qc, kc, vc, backend=name).out, ref_out) <= 2 * err + 1e-5


@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa_flash", "sdpa_efficient"])
@pytest.mark.parametrize("head_dim", [20, 36])
def test_a_head_dim_off_the_multiple_of_8_is_padded_exactly(name, head_dim):
    """Note [padded head_dim] (usp_dit.kernels.sdpa_cuda): DreamLite's head_dim 20 through the aten
    ops that take multiples of 8, zero-padded: the same rules as the kernel tests above (whole
    sequence within 2e-2 of float64, blockwise within 2x of whole), and ``forward_out`` equal to
    ``forward``'s out."""
    backend = _backend(name)
    q, k, v, dout = _inputs(2, 333, 4, 2, head_dim)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, head_dim ** -0.5)
    ref = (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout))
    whole = _errors(backend, q, k, v, dout, torch.bfloat16, 1, ref)
    assert max(whole.values()) < 2e-2, whole
    for n in (2, 4):
        blocks = _errors(backend, q, k, v, dout, torch.bfloat16, n, ref)
        bad = {key: (blocks[key], whole[key]) for key in whole if blocks[key] > 2 * whole[key] + 1e-5}
        assert not bad, f"N={n}: (blockwise, whole) errors {bad}"
    forward_out = getattr(backend, "forward_out", None)
    if forward_out is not None:
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        got = forward_out(qb, kb, vb, head_dim ** -0.5)
        assert got.shape == qb.shape and rel_err(got, backend.forward(qb, kb, vb, head_dim ** -0.5)[0]) < 1e-2
