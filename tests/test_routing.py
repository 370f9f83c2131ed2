"""The shared router of stock processors' attention calls (usp_dit.pipelines._routing), on one rank.

No processes: with a single-rank mesh the router's splitting of [text; video] or [video; text],
its text key masks (per batch element) and its refusals are checked against PyTorch's own masked
attention in float64 (tolerance 1e-12: the same sums, only grouped differently). The multi-rank
paths are covered by each family's grid tests (tests/test_pipeline_*.py).
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from usp_dit import single_rank_mesh
from usp_dit.pipelines._routing import Route, route_attention, route_sdpa, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState

B, S, T, H, D = 2, 7, 5, 3, 8


def _qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S + T, H, D, generator=g, dtype=torch.float64) for _ in range(3))


def _route(text: str, backend: str = "reference") -> Route:
    return Route(ShardState(single_rank_mesh(), backend, seq_len=S), text)


def _reference(q, k, v, key_mask):
    """(B, L, H, D) attention with a (B, L) bool key mask, as Diffusers' SDPA call computes it."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=key_mask[:, None, None, :])
    return out.transpose(1, 2)


def _text_mask() -> torch.Tensor:
    """(B, T): element 0 has a hole and padding, element 1 every token."""
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 1] = False
    mask[0, -1] = False
    return mask


@pytest.mark.parametrize("text", ["first", "last"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "bool-4d"])
def test_joint_call_equals_masked_attention_on_every_row_read_downstream(text, mask_kind):
    q, k, v = _qkv()
    text_mask = _text_mask()
    video = torch.ones(B, S, dtype=torch.bool)
    keys = torch.cat([text_mask, video] if text == "first" else [video, text_mask], dim=1)  # (B, L)
    if mask_kind == "none":
        keys, attn_mask = torch.ones_like(keys), None
    elif mask_kind == "bool":
        attn_mask = keys
    elif mask_kind == "additive":
        attn_mask = torch.zeros(keys.shape, dtype=torch.float64).masked_fill(~keys, float("-inf"))
    else:
        attn_mask = keys[:, None, None, :]
    out = route_attention(q, k, v, attn_mask=attn_mask, parallel_config=_route(text))
    ref = _reference(q, k, v, keys)
    assert torch.allclose(out[keys], ref[keys], atol=1e-12, rtol=0)
    if mask_kind in ("bool", "bool-4d"):
        # One rank hands a bool key mask to the kernel whole (Note [one rank under a key mask] in
        # usp_dit.attention.usp): padded text queries attend the valid keys, as stock's do.
        assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    else:
        # Note [masked text tokens]: padded text queries' rows are zeros; every other row is stock's.
        assert torch.count_nonzero(out[~keys]) == 0


@pytest.mark.parametrize("text", ["first", "last"])
def test_a_mask_over_padded_keys_and_queries_equals_stock_on_every_row(text):
    """HunyuanVideo 1.5's (B, 1, L, L) mask, the key mask's outer product with itself: the padded
    text queries see no key, stock's rows are zeros for them (PyTorch), and so are ours: every row equal."""
    q, k, v = _qkv(3)
    video = torch.ones(B, S, dtype=torch.bool)
    keys = torch.cat([_text_mask(), video] if text == "first" else [video, _text_mask()], dim=1)
    square = (keys[:, :, None] & keys[:, None, :])[:, None]
    out = route_attention(q, k, v, attn_mask=square, parallel_config=_route(text))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=square).transpose(1, 2)
    assert torch.count_nonzero(ref[~keys]) == 0
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)


def test_a_mask_over_the_whole_sequence_is_read_at_its_text_end():
    """HunyuanVideo builds its mask over [all video; text] before the tokens are split: wider than the call."""
    q, k, v = _qkv(1)
    text_mask = _text_mask()
    full = torch.cat([torch.ones(B, S + 4, dtype=torch.bool), text_mask], dim=1)  # 4 more video keys elsewhere
    out = route_attention(q, k, v, attn_mask=full[:, None, None, :], parallel_config=_route("last"))
    keys = torch.cat([torch.ones(B, S, dtype=torch.bool), text_mask], dim=1)
    assert torch.allclose(out[keys], _reference(q, k, v, keys)[keys], atol=1e-12, rtol=0)


def test_self_attention_route():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    out = route_attention(q, k, v, parallel_config=_route("none"))
    assert torch.allclose(out, _reference(q, k, v, torch.ones(B, S, dtype=torch.bool)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", ["auto", "sdpa_cpu", "reference"])
@pytest.mark.parametrize("kv_heads", [H, 1])
def test_one_rank_bool_key_mask_equals_stock_on_every_row(backend, kv_heads):
    """Note [one rank under a key mask]: "auto" is stock's own SDPA call, a named kernel takes the
    mask itself; both equal PyTorch's masked attention on every row (padded text queries too),
    with GQA (one K/V head), in float32 (sdpa_cpu has no float64: tolerance 1e-5, float32 sums)."""
    q, k, v = (t.float() for t in _qkv(5))
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
    keys = torch.cat([_text_mask(), torch.ones(B, S, dtype=torch.bool)], dim=1)
    out = route_attention(q, k, v, attn_mask=keys[:, None, None, :], parallel_config=_route("first", backend))
    ref = _reference(q, k.repeat_interleave(H // kv_heads, 2), v.repeat_interleave(H // kv_heads, 2), keys)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


class _CountSDPA:
    """Wraps ``F.scaled_dot_product_attention`` (monkeypatched in), counting its calls."""

    def __init__(self) -> None:
        self.calls, self.stock = 0, F.scaled_dot_product_attention

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.stock(*args, **kwargs)


@pytest.mark.parametrize("kv_heads", [H, 1])
@pytest.mark.parametrize("text", ["none", "last"])
def test_small_one_rank_calls_are_stocks_own_call(monkeypatch, kv_heads, text):
    """Note [small calls on one rank go to PyTorch's dispatcher]: with "auto", a plain one-rank
    call under ``TORCH_DISPATCH_FLOPS`` is stock's own SDPA call on stock's tensors, bit for bit
    (float64, GQA too); over it (the threshold set to 0) the kernels run it, equal to the float64
    reference to 1e-12; a named backend is never handed to PyTorch; the length check holds in both."""
    import usp_dit.kernels.policy as policy

    q, k, v = (t.transpose(1, 2) for t in _qkv(7))  # (B, H, L, D), stock's layout; L = S + T
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    if text == "none":
        q, k, v = q[:, :, :S], k[:, :, :S], v[:, :, :S]
    stock = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=kv_heads != H)
    spy = _CountSDPA()
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out = route_sdpa(q, k, v, None, 0.0, False, 0.3, _route(text, "auto"))
    assert spy.calls == 1 and torch.equal(out, stock)
    for backend, threshold in (("auto", 0.0), ("reference", policy.TORCH_DISPATCH_FLOPS)):
        monkeypatch.setattr(policy, "TORCH_DISPATCH_FLOPS", threshold)
        spy.calls = 0
        out = route_sdpa(q, k, v, None, 0.0, False, 0.3, _route(text, backend))
        assert spy.calls == 0, backend
        assert torch.allclose(out, stock, atol=1e-12, rtol=0), backend
    monkeypatch.undo()
    with pytest.raises(ValueError, match="shard has 7"):
        route_sdpa(q[:, :, :5], k[:, :, :5], v[:, :, :5], None, 0.0, False, None, _route(text, "auto"))


def test_refusals():
    q, k, v = _qkv()
    video_masked = torch.ones(B, S + T, dtype=torch.bool)
    video_masked[0, T + 2] = False  # text first: a video key
    additive = torch.zeros(video_masked.shape, dtype=torch.float64).masked_fill(~video_masked, float("-inf"))
    with pytest.raises(NotImplementedError, match="masks video tokens"):
        route_attention(q, k, v, attn_mask=additive, parallel_config=_route("first"))
    # A bool key mask goes to one rank's kernel whole (Note [one rank under a key mask]): exact
    # even where it hides a video key (a grid refuses that: test_routing_grid's cases).
    out = route_attention(q, k, v, attn_mask=video_masked, parallel_config=_route("first"))
    assert torch.allclose(out, _reference(q, k, v, video_masked), atol=1e-12, rtol=0)
    with pytest.raises(NotImplementedError, match="key-padding masks only"):
        route_attention(q, k, v, attn_mask=torch.ones(B, 2, 1, S + T, dtype=torch.bool), parallel_config=_route("first"))
    causal = torch.ones(S + T, S + T, dtype=torch.bool).tril().expand(B, 1, -1, -1)  # varies over queries
    with pytest.raises(NotImplementedError, match="not the outer product of a key mask"):
        route_attention(q, k, v, attn_mask=causal, parallel_config=_route("first"))
    with pytest.raises(NotImplementedError, match="0 and -inf only"):
        route_attention(q, k, v, attn_mask=torch.full((B, S + T), 0.5, dtype=torch.float64), parallel_config=_route("first"))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        route_attention(q, k, v, dropout_p=0.1, parallel_config=_route("first"))
    with pytest.raises(ValueError, match="shard has 7"):
        route_attention(q, k, v, parallel_config=_route("none"))
    short = q[:, :5], k[:, :5], v[:, :5]  # a joint call with fewer tokens than the shard's 7
    with pytest.raises(ValueError, match="joint attention call got 5 tokens, but this rank's shard has 7"):
        route_attention(*short, parallel_config=_route("first"))
    with pytest.raises(RuntimeError, match="not its Route"):
        route_attention(q, k, v, parallel_config=None)


def test_a_routed_processor_shows_the_stock_signature():
    """Diffusers' Attention.forward passes only the keyword arguments the processor's __call__
    names: a (*args, **kwargs) signature would silently lose e.g. image_rotary_emb."""
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    routed = routed_processor_class(HunyuanVideoAttnProcessor2_0)
    params = inspect.signature(routed(_route("last")).__call__).parameters
    assert list(params) == list(inspect.signature(HunyuanVideoAttnProcessor2_0().__call__).parameters)
    assert "image_rotary_emb" in params
