"""The ``fp8`` attention backend without a GPU: its quantisation's reference (Note [fp8 attention]),
the property that makes it usable in a ring (an exact LSE), and its refusals.

The kernel itself runs on sm90 GPUs only (tests/gpu/test_fp8_attention_gpu.py checks it against
``reference_forward``); here, in float64:
- the reference's LSE is the log-sum-exp of the scores built independently from the dequantised
  Q and K (tolerance 1e-12: float64 sums);
- K/V split into 2, 3 and 5 blocks, each block's (out, LSE) merged by log-sum-exp: the merged LSE
  equals the whole call's (1e-12), because a row's Q and K scales do not depend on the block, and
  the output is within e4m3's error of the whole call's (each block has its own V scales): 3e-2 of
  its largest value;
- against exact attention on DiT-like activations (heavy channels, offsets): cosine >= 0.99 and
  relative L1 <= 8e-2 (docs/FP8.md has the measured values);
- caps: no backward (refused when gradients are needed), "auto" never picks it, CPU refuses it.
Odd lengths (13 queries, 11 keys), GQA 4:2, batch 2.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from usp_dit.kernels import select_backend
from usp_dit.kernels.fp8_quant import channel_quant, reference_forward, row_quant
from usp_dit.kernels.policy import AUTO_TABLE
from usp_dit.testing import rel_err

SCALE = 0.25


def _dit_like(b, s, h, d, g, heavy=True):
    scale = torch.exp(0.5 * torch.randn(h, d, generator=g, dtype=torch.float64))
    if heavy:
        scale[:, :3] = 4.0  # heavy channels; scores then span about +-10, as trained DiTs' do
    return torch.randn(b, s, h, d, generator=g, dtype=torch.float64) * scale + 0.5 * torch.randn(h, d, generator=g,
                                                                                                  dtype=torch.float64)


def _inputs(seed=0, sq=13, sk=11):
    g = torch.Generator().manual_seed(seed)
    return _dit_like(2, sq, 4, 16, g), _dit_like(2, sk, 2, 16, g), _dit_like(2, sk, 2, 16, g, heavy=False)


def test_lse_is_the_lse_of_the_dequantised_scores():
    q, k, v = _inputs()
    _, lse = reference_forward(q, k, v, SCALE)
    q8, sq = row_quant(q)
    k8, sk = row_quant(k)
    qd = q8.double() * sq.double()[..., None]
    kd = (k8.double() * sk.double()[..., None]).repeat_interleave(2, dim=2)
    scores = SCALE * torch.einsum("bihd,bjhd->bihj", qd, kd)
    assert rel_err(lse, torch.logsumexp(scores, dim=-1)) <= 1e-12


@pytest.mark.parametrize("blocks", [2, 3, 5])
def test_blocks_merge_to_the_whole_call(blocks):
    q, k, v = _inputs(1)
    whole_out, whole_lse = reference_forward(q, k, v, SCALE)
    parts = [reference_forward(q, kb, vb, SCALE) for kb, vb in zip(k.tensor_split(blocks, 1), v.tensor_split(blocks, 1))]
    lses = torch.stack([lse for _, lse in parts])
    lse = torch.logsumexp(lses, dim=0)
    out = sum(o * torch.exp(l - lse)[..., None] for o, l in parts)
    assert rel_err(lse, whole_lse) <= 1e-12
    assert rel_err(out, whole_out) <= 3e-2


def test_near_exact_attention_on_dit_like_activations():
    q, k, v = _inputs(2, 257, 251)
    out, _ = reference_forward(q, k, v, SCALE)
    kk, vv = (x.repeat_interleave(2, 2).transpose(1, 2) for x in (k, v))
    exact = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, scale=SCALE).transpose(1, 2)
    assert F.cosine_similarity(out.flatten(), exact.flatten(), dim=0) >= 0.99
    assert (out - exact).abs().sum() / exact.abs().sum() <= 8e-2


def test_scales_are_per_row_and_per_channel():
    q, _, v = _inputs()
    q8, sq = row_quant(q)
    v8, sv = channel_quant(v)
    assert sq.shape == q.shape[:3] and sv.shape == (2, 2, 16)
    assert q8.dtype == v8.dtype == torch.float8_e4m3fn
    assert (q8.float().abs().amax(-1) == 448).all()  # every row's largest value is e4m3's largest


def test_caps_refuse_gradients_cpu_and_auto_never_picks_it():
    with pytest.raises(NotImplementedError, match="no backward"):
        select_backend("fp8", "cuda", torch.bfloat16, 128, needs_grad=True)
    with pytest.raises(NotImplementedError, match="device 'cpu'"):
        select_backend("fp8", "cpu", torch.float32, 128, needs_grad=False)
    assert all(rule.backend != "fp8" for rules in AUTO_TABLE.values() for rule in rules)


def test_fp8_flashinfer_scales_are_per_head_and_it_is_opt_in_only():
    """``fp8_flashinfer`` (Note [fp8 attention, per head]): one scale per (element, head) over its
    tokens and channels, every head's largest value mapped to e4m3's 448, dequantised values within
    e4m3's half step (2^-4 relative, or 2^-10 of the scale below 2^-6 of it); forward only, never
    on CPU, never picked by "auto"."""
    from usp_dit.kernels.fp8_quant import head_quant

    q, _, _ = _inputs()
    q8, sq = head_quant(q)
    assert sq.shape == (2, 4) and q8.dtype == torch.float8_e4m3fn
    assert (q8.double().abs().amax(dim=(1, 3)) == 448).all()
    back = q8.double() * sq.double()[:, None, :, None]
    bound = torch.maximum(q.abs() * 2.0 ** -4, sq.double()[:, None, :, None] * 2.0 ** -9)
    assert ((back - q).abs() <= bound).all()
    with pytest.raises(NotImplementedError, match="no backward"):
        select_backend("fp8_flashinfer", "cuda", torch.bfloat16, 128, needs_grad=True)
    with pytest.raises(NotImplementedError, match="device 'cpu'"):
        select_backend("fp8_flashinfer", "cpu", torch.float32, 128, needs_grad=False)
    assert all(rule.backend != "fp8_flashinfer" for rules in AUTO_TABLE.values() for rule in rules)


def test_fp8_fa3_scales_per_kv_head_and_it_is_opt_in_only(monkeypatch, tmp_path):
    """``fp8_fa3`` (Note [fp8 attention, FA3]): Q's scale is shared by the query heads of one K/V
    head (FA3's descale shape (B, Hk)), every group's largest value mapped to e4m3's 448,
    dequantised values within e4m3's half step; with H == Hk it is ``head_quant``. Forward only,
    never on CPU, never picked by "auto"; a library that does not load makes the backend
    unavailable with the loader's reason and the install line."""
    from usp_dit.kernels import fp8_fa3, get_backend
    from usp_dit.kernels.fp8_quant import head_quant, kv_head_quant

    q, k, _ = _inputs()  # q (2, 13, 4, 16), k (2, 11, 2, 16): two query heads a K/V head
    q8, sq = kv_head_quant(q, 2)
    assert sq.shape == (2, 2) and q8.shape == q.shape and q8.dtype == torch.float8_e4m3fn
    assert (q8.double().unflatten(2, (2, 2)).abs().amax(dim=(1, 3, 4)) == 448).all()
    s = sq.double().repeat_interleave(2, dim=1)[:, None, :, None]
    bound = torch.maximum(q.abs() * 2.0 ** -4, s * 2.0 ** -9)
    assert ((q8.double() * s - q).abs() <= bound).all()
    for a, b in zip(kv_head_quant(k, 2), head_quant(k)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    with pytest.raises(NotImplementedError, match="no backward"):
        select_backend("fp8_fa3", "cuda", torch.bfloat16, 128, needs_grad=True)
    with pytest.raises(NotImplementedError, match="device 'cpu'"):
        select_backend("fp8_fa3", "cpu", torch.float32, 128, needs_grad=False)
    assert all(rule.backend != "fp8_fa3" for rules in AUTO_TABLE.values() for rule in rules)
    bogus = tmp_path / "_vllm_fa3_C.abi3.so"
    bogus.write_bytes(b"not a library")
    monkeypatch.setenv(fp8_fa3.LIB_ENV, str(bogus))
    fp8_fa3._ops.cache_clear()
    try:
        ops, why = fp8_fa3._ops()
        assert ops is None and str(bogus) in why and "does not load" in why
        assert not get_backend("fp8_fa3").available()
        with pytest.raises(RuntimeError, match="pip install vllm"):
            get_backend("fp8_fa3").require()
    finally:
        fp8_fa3._ops.cache_clear()
