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


def test_fp8_cudnn_scales_per_tensor_and_it_is_opt_in_only(monkeypatch):
    """``fp8_cudnn`` (Note [fp8 attention, cuDNN]): one scale per tensor, its largest value mapped
    to e4m3's 448, dequantised values within e4m3's half step (relative 2^-4, absolute 2^-9 of the
    scale below the normal range). Forward only, never on CPU, never picked by "auto"; without the
    cudnn frontend the backend is unavailable and names the install line."""
    from usp_dit.kernels import fp8_cudnn, get_backend
    from usp_dit.kernels.fp8_quant import tensor_quant

    q, _, _ = _inputs()
    q8, sq = tensor_quant(q)
    assert sq.shape == () and sq.dtype == torch.float32 and q8.shape == q.shape and q8.dtype == torch.float8_e4m3fn
    assert q8.double().abs().max() == 448 and torch.isclose(sq.double(), q.abs().max() / 448, rtol=1e-6)
    bound = torch.maximum(q.abs() * 2.0 ** -4, sq.double() * 2.0 ** -9)
    assert ((q8.double() * sq.double() - q).abs() <= bound).all()
    zero8, zero_s = tensor_quant(torch.zeros(2, 3, 4, 8))
    assert zero_s == 1 and (zero8.double() == 0).all()  # an all-zero tensor: scale 1, values 0 (never 0/0)
    with pytest.raises(NotImplementedError, match="no backward"):
        select_backend("fp8_cudnn", "cuda", torch.bfloat16, 128, needs_grad=True)
    with pytest.raises(NotImplementedError, match="device 'cpu'"):
        select_backend("fp8_cudnn", "cpu", torch.float32, 128, needs_grad=False)
    assert all(rule.backend != "fp8_cudnn" for rules in AUTO_TABLE.values() for rule in rules)
    monkeypatch.setitem(__import__("sys").modules, "cudnn", None)  # "import cudnn" now fails
    fp8_cudnn._frontend.cache_clear()
    try:
        module, why = fp8_cudnn._frontend()
        assert module is None and "does not import" in why
        assert not get_backend("fp8_cudnn").available()
        with pytest.raises(RuntimeError, match="pip install nvidia-cudnn-frontend"):
            get_backend("fp8_cudnn").require()
    finally:
        fp8_cudnn._frontend.cache_clear()


def test_fp8_cudnn_refuses_a_shape_cudnn_cannot_run_by_name(monkeypatch):
    """A shape the installed cuDNN does not support (the frontend raises while building the plan)
    becomes a NotImplementedError naming the shapes and cuDNN's reason, never a wrong answer. A
    stand-in frontend records the graph it is asked for: Q/K/V seen as (b, h, s, d) over
    (B, S, H, D) memory, the output in e4m3, the statistics (b, h, s, 1) float32."""
    import types

    from usp_dit.kernels import fp8_cudnn

    calls: dict = {}

    class Tensor:
        def __init__(self, **kw):
            self.kw = kw

        def __getattr__(self, name):  # set_uid / set_output / set_dim / ...: record, chain
            def setter(value):
                self.kw[name] = value
                return self
            return setter

    class Graph:
        def __init__(self, **kw):
            calls["graph"] = kw

        def tensor(self, **kw):
            return Tensor(**kw)

        def sdpa_fp8(self, **kw):
            calls["sdpa"] = kw
            calls["outputs"] = [Tensor() for _ in range(4)]
            return calls["outputs"]

        def validate(self):
            pass

        build_operation_graph = validate

        def create_execution_plans(self, modes):
            pass

        def check_support(self):
            raise RuntimeError("no FP8 engine for this head_dim")

    dt = types.SimpleNamespace(FLOAT="f32", FP8_E4M3="e4m3")
    fake = types.SimpleNamespace(data_type=dt, heur_mode=types.SimpleNamespace(A="A", FALLBACK="F"),
                                 pygraph=Graph, create_handle=lambda: 7)
    monkeypatch.setattr(fp8_cudnn, "_frontend", lambda: (fake, ""))
    monkeypatch.setattr(fp8_cudnn, "_handle", lambda device: 7)
    fp8_cudnn._graph.cache_clear()
    try:
        with pytest.raises(NotImplementedError, match=r"fp8_cudnn.*\(2, 13, 4, 96\).*no FP8 engine"):
            fp8_cudnn._graph(0, 2, 4, 2, 13, 11, 96, 96, 0.25)
    finally:
        fp8_cudnn._graph.cache_clear()
    q = calls["sdpa"]["q"].kw
    assert q["dim"] == (2, 4, 13, 96) and q["stride"] == (13 * 4 * 96, 96, 4 * 96, 1) and q["data_type"] == "e4m3"
    assert calls["sdpa"]["k"].kw["dim"] == (2, 2, 11, 96) and calls["sdpa"]["attn_scale"] == 0.25
    assert calls["sdpa"]["generate_stats"] is True
    out, stats = calls["outputs"][0].kw, calls["outputs"][1].kw
    assert out["set_dim"] == (2, 4, 13, 96) and out["set_stride"] == (13 * 4 * 96, 96, 4 * 96, 1)
    assert out["set_data_type"] == "e4m3"  # Hopper writes FP8 output only (Note [fp8 attention, cuDNN])
    assert stats["set_dim"] == (2, 4, 13, 1) and stats["set_data_type"] == "f32"


def test_fp8_cudnn_warns_once_on_long_calls(monkeypatch):
    """A call with more than ``LONG_CALL`` keys warns once per key count (Note [fp8 attention,
    cuDNN, long calls]: the error grows with a call's keys); a call at the bound does not. The
    kernel is stood in for (no GPU here); the warning comes before it."""
    import warnings

    from usp_dit.kernels import fp8_cudnn

    monkeypatch.setattr(fp8_cudnn, "quantised_forward", lambda q8, k8, v8, descales, scale, dtype: (
        torch.zeros(q8.shape, dtype=dtype), torch.zeros(q8.shape[:3])))
    monkeypatch.setattr(fp8_cudnn, "_fused_quant", lambda: __import__("usp_dit.kernels.fp8_quant",
                                                                       fromlist=["tensor_quant"]).tensor_quant)
    fp8_cudnn._warn_long_call.cache_clear()
    backend = fp8_cudnn.FP8CudnnBackend()
    q = torch.randn(1, 3, 2, 8, dtype=torch.bfloat16)

    def call(keys: int) -> list:
        kv = torch.randn(1, keys, 2, 8, dtype=torch.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend.forward(q, kv, kv, 0.3)
        return [w for w in caught if "fp8_cudnn" in str(w.message)]

    assert call(fp8_cudnn.LONG_CALL) == []
    first = call(fp8_cudnn.LONG_CALL + 1)
    assert len(first) == 1 and "fp8_fa3" in str(first[0].message) and str(fp8_cudnn.LONG_CALL + 1) in str(first[0].message)
    assert call(fp8_cudnn.LONG_CALL + 1) == []  # once per key count
    fp8_cudnn._warn_long_call.cache_clear()
