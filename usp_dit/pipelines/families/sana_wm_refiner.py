"""SANA-WM's stage-2 refiner: ``SanaWMLTX2RefinerTransformer3DModel`` (``SanaWMLTX2Refiner``) on a USP grid.

Layout: video tokens ``hidden_states`` (batch, S, channels), frame-major (the refiner's
``_pack_latents``, patch 1); text ``encoder_hidden_states`` (batch, T, C) with the prompt mask
``encoder_attention_mask`` (batch, T), 1 = real token; the timestep (batch,) or one per token
(batch, S) (the pipeline passes one per token); the caller's video RoPE ``video_rotary_emb``
``(cos, sin)``, "interleaved" (batch, S, dim) or "split" (batch, heads, S, dim // 2): **the sequence
on dim -2** either way. Q/K/V (batch, seq, heads, head_dim). The KV cache
(``SanaWMRefinerKVCache``) holds per layer (batch, tokens, inner_dim) K/V, before the head split.

What the refiner is: LTX-2's transformer (the same modules and weights: ``usp_dit.pipelines.families.ltx2``)
with a **video-only** forward and a sliding-window KV cache. Each block runs

    attention   queries  keys/values                              here
    attn1       video    [cached sink; cached history; video]     parallel: Note [cached prefix]
    attn2       video    text                                     local (text replicated)

and the feed-forward. The audio modules (``audio_attn1``, ``audio_attn2``, ``audio_to_video_attn``,
``video_to_audio_attn``) are kept so LTX-2 checkpoints load, and never run. ``attn1``'s processor is
the refiner's own ``SanaWMLTX2RefinerAttnProcessor`` (the model's ``__init__`` installs it); ``attn2``'s
is ``SanaWMLTX2AudioVideoAttnProcessor`` or, with ``perturbed_attn``, ``SanaWMLTX2PerturbedAttnProcessor``.
Their per-head gates (``gated_attn``: ``2 sigmoid(to_gate_logits(x))``, (B, S, heads)) are computed
from each query token's own hidden state and scale that token's output per head: per token, so exact
on any shard of the tokens. The perturbation mask of the perturbed processor is never passed by the
refiner's block (its forward takes none): the perturbed processor then runs plain attention.

Where the tokens are split: at ``proj_in``'s input (the timestep embedding runs after it, so a
per-token timestep is cut like the tokens there: ltx2's ``LTX2TimestepHook`` on ``time_embed``);
every block, the final norm and ``proj_out`` run on the shard; ``proj_out``'s output is gathered.
``video_rotary_emb`` is not built by a submodule (the pipeline builds it for each window's absolute
frame positions and passes it in): ``attn1``'s processor takes this rank's rows of it, on dim -2,
at each call (a view). Text: replicated (cross-attention only: local, no communication).

Note [cached prefix]
    ``attn1``'s keys are ``[sink; history; current]`` (``kv_cache_mode`` "inject" or
    "inject_and_capture_post_rope"): the current block's tokens, sharded, behind a prefix read from
    the cache. The cache stays **whole on every rank**, exactly as one process holds it: the pipeline
    appends to it and trims it by token counts (``history[:, -keep_tokens:]``), which only a whole
    cache keeps meaning. So what a capture mode stores (this rank's K/V of the current block) is
    gathered over the sequence group first (``GatheredLayerCache``, one all-gather per layer, in the
    capture passes only), and an inject call's prefix (sink re-rotated with the whole ``sink_pe``,
    and history) is replicated. The attention of this rank's queries over the whole key set is the
    log-sum-exp merge of two exact parts:

        current: usp_attention(q_local, k_cur, v_cur)     over every rank's current tokens, (o_c, l_c)
        prefix:  attention(q_local, k_prefix, v_prefix)   local, the prefix is replicated,  (o_p, l_p)
        o = (e^{l_c - l} o_c + e^{l_p - l} o_p),  l = log(e^{l_c} + e^{l_p})

    Work per rank: 1/P of each part; no communication beyond usp_attention's. Gradients are exact:
    both log-sum-exps are differentiable (Note [LSE gradient] in ``usp_dit.kernels.lse_grad``) and
    the merge is plain PyTorch. The prefix is replicated, so each rank's gradient of it is the part
    its own queries give (the sum over the sequence group is one process's, as for any replicated
    input; a prefix captured here came through ``gather_sequence``, whose backward sums them).

Refused (NotImplementedError): processors other than the three stock ones, an attention module the
plan does not name, a Diffusers cache that cannot run on a grid, ``num_layers=0``; at the call: a
KV-cached call whose batch ``enable_usp`` splits over ``cfg_degree`` > 1 (the cache's rows are the
whole batch: a cfg group running half of it would store half a cache, and the pipeline's
``sink_pe`` has the whole batch; ``CacheCfgCheck``), an attention mask in ``attn1`` (the stock
processor passes none). A
video RoPE table with another length than the tokens raises ValueError. CFG: ``SanaWMLTX2Refiner``
runs no guidance (one call of batch 1 a step: its prompt is one string), which ``cfg_degree=2``
refuses (``replica_forward`` Note [cfg parallel]); it splits a batched call without a cache. Compile: a call without a cache compiles in one graph (tests/test_compile_grid.py).

VAE: ``AutoencoderKLLTX2Video`` (optional in the refiner) decodes split by rows over the replica,
as LTX-2's (``usp_dit.pipelines.families.ltx2``).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers.models.transformers.transformer_sana_wm_refiner import (
    SanaWMLTX2AudioVideoAttnProcessor,
    SanaWMLTX2PerturbedAttnProcessor,
    SanaWMLTX2RefinerAttnProcessor,
    SanaWMLTX2RefinerTransformer3DModel,
    SanaWMRefinerKVLayerCache,
)
from torch.utils.hooks import RemovableHandle

from usp_dit.attention.usp import usp_attention
from usp_dit.kernels import attend, select_backend
from usp_dit.kernels.autograd import needs_grad
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, route_attention, with_global
from usp_dit.pipelines._token_sharding import ShardState, _get_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.families.ltx2 import LTX2TimestepHook
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import gather_sequence, shard_sequence

STOCK = (SanaWMLTX2AudioVideoAttnProcessor, SanaWMLTX2PerturbedAttnProcessor)


# ---------------------------------------------------------------------------------------------
# Note [cached prefix]


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Two partial results of the same queries over disjoint key sets -> the result over their union.

    Args: out_* (B, S, H, D), lse_* (B, S, H) (neither empty: finite log-sum-exps).
    Returns: (B, S, H, D) in ``out_a``'s dtype.
    """
    acc = torch.promote_types(lse_a.dtype, torch.float32)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a.to(acc) + torch.exp(lse_b - lse).unsqueeze(-1) * out_b.to(acc)
    return out.to(out_a.dtype)


def attend_with_cached_prefix(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None,
    *,
    backend: Any = None,
    parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn``'s signature, for ``attn1`` (Note [cached prefix]).

    Args:
        query: (B, S_local, H, D) this rank's current tokens.
        key, value: (B, N + S_local, H, D): the replicated cached prefix (N tokens, none without an
            injecting ``kv_cache_mode``), then this rank's current tokens.
        parallel_config: the processor's ``Route``.
    Returns:
        (B, S_local, H, D): each query over the whole prefix and every rank's current tokens.
    Raises:
        NotImplementedError: with a prefix on a grid: a mask, dropout, causal attention, attention
            kwargs; a backend without a log-sum-exp.
    """
    route = parallel_config
    prefix = key.shape[1] - query.shape[1]
    if not isinstance(route, Route) or prefix == 0 or route.state.mesh.sequence_degree == 1:
        # No prefix: plain self-attention over the shards. One rank: the stock call's keys are all here.
        return route_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                               attention_kwargs, backend=backend, parallel_config=route)
    if attn_mask is not None or dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(
            "usp_dit's SANA-WM refiner adapter runs attn1 over a cached prefix without a mask, dropout or causal attention")
    state = route.state
    cur = usp_attention(query, key[:, prefix:], value[:, prefix:], mesh=state.mesh, backend=state.backend,
                        seq_len=state.seq_len, layout=state.layout, scale=scale, return_lse=True)
    grad = needs_grad(query, key[:, :prefix], value[:, :prefix])
    kernel = select_backend(state.backend, query.device.type, query.dtype, query.shape[-1], grad)
    if not kernel.caps.returns_lse:
        raise NotImplementedError(
            f"backend={kernel.name!r} returns no log-sum-exp, which the refiner's cached prefix is merged with")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    out_p, lse_p = attend(query, key[:, :prefix], value[:, :prefix], kernel, scale, lse_grad=True)
    return _merge(cur.out, cur.lse, out_p, lse_p)


class GatheredLayerCache:
    """A ``SanaWMRefinerKVLayerCache`` as ``attn1``'s stock code sees it on a grid: what a capture
    stores, this rank's (B, S_local, inner_dim) K/V, is gathered to the whole (B, S, inner_dim)
    first (Note [cached prefix]); every other attribute is the cache's own."""

    def __init__(self, cache: SanaWMRefinerKVLayerCache, state: ShardState) -> None:
        self._cache, self._state = cache, state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        state = self._state
        return gather_sequence(x, state.mesh, dim=1, seq_len=state.seq_len, layout=state.layout)

    def store_captured_pre_rope(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self._cache.store_captured_pre_rope(self._gather(key), self._gather(value))

    def store_captured_post_rope(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self._cache.store_captured_post_rope(self._gather(key), self._gather(value))


def _local_rope(table: Any, state: ShardState) -> Any:
    """This rank's rows of ``video_rotary_emb`` ``(cos, sin)``, the sequence on dim -2, cut like the tokens.

    Raises:
        ValueError: its length is not the call's token count.
    """
    if table is None:
        return None
    cos = table[0]
    if cos.shape[-2] != state.seq_len:
        raise ValueError(
            f"video_rotary_emb has {cos.shape[-2]} rows (dim -2 of {tuple(cos.shape)}) but the transformer has "
            f"{state.seq_len} video tokens: they must match for the table to be cut like the tokens")
    return tuple(shard_sequence(t, state.mesh, dim=t.dim() - 2, layout=state.layout) for t in table)


class USPRefinerSelfAttnProcessor(RoutedProcessor):
    """``attn1``: ``SanaWMLTX2RefinerAttnProcessor``'s own code (projections, norms, RoPE, per-head
    gates, the cache's reads and writes) on this rank's rows, its attention call routed to
    ``attend_with_cached_prefix``, its RoPE table cut and its layer cache gathering what it stores.

    The signature is spelled out: ``SanaWMLTX2Attention.forward`` passes a processor only the
    keyword arguments its ``__call__`` names (the block passes the cache ones).
    """

    _stock_call = with_global(SanaWMLTX2RefinerAttnProcessor.__call__, ROUTED_NAME, attend_with_cached_prefix)

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        sink_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: SanaWMRefinerKVLayerCache | None = None,
        kv_cache_mode: str | None = None,
    ) -> torch.Tensor:
        state = self.route.state
        if kv_cache is not None and state.mesh.sequence_degree > 1:
            kv_cache = GatheredLayerCache(kv_cache, state)
        # The sink's table stays whole: it rotates the whole (replicated) cached sink.
        return type(self)._stock_call(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                                      _local_rope(query_rotary_emb, state), key_rotary_emb, sink_rotary_emb,
                                      kv_cache, kv_cache_mode)


USPRefinerSelfAttnProcessor.__call__.__signature__ = inspect.signature(SanaWMLTX2RefinerAttnProcessor.__call__)


class CacheCfgCheck:
    """Refuses a KV-cached call whose batch ``enable_usp`` split over cfg groups (see the module's
    Refused): a pre-hook on the transformer (outside the cfg split) notes the batch of a call that
    passes a cache, and one on ``proj_in`` (inside it) compares the batch it gets."""

    def __init__(self, transformer: SanaWMLTX2RefinerTransformer3DModel, state: ShardState) -> None:
        self.transformer, self.state = transformer, state
        self.cached_batch: int | None = None  # the batch of the current call, when it passes a KV cache
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        self.handles.append(self.transformer.register_forward_pre_hook(self._note, with_kwargs=True))
        self.handles.append(self.transformer.proj_in.register_forward_pre_hook(self._check))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _note(self, module, args: tuple, kwargs: dict) -> None:
        cached = _get_arg(args, kwargs, "kv_cache", 5) is not None
        self.cached_batch = _get_arg(args, kwargs, "hidden_states", 0).shape[0] if cached else None

    def _check(self, module, args: tuple) -> None:
        if self.cached_batch is not None and args[0].shape[0] != self.cached_batch:
            raise NotImplementedError(
                f"usp_dit's SANA-WM refiner adapter does not split a KV-cached call of batch {self.cached_batch} over "
                f"cfg_degree={self.state.mesh.cfg_degree}: the cache holds the whole batch (the refiner runs no "
                f"guidance: use cfg_degree=1)")


def _routed_call_missing(transformer: SanaWMLTX2RefinerTransformer3DModel) -> str | None:
    if USPRefinerSelfAttnProcessor._stock_call is None:
        return f"this diffusers' SanaWMLTX2RefinerAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


_BLOCKS = "transformer_blocks.*."

PLAN = ModelPlan(
    name="SANA-WM refiner",
    model_class=SanaWMLTX2RefinerTransformer3DModel,
    split_at="proj_in",  # before time_embed: a per-token timestep is cut like the tokens
    gather_at="proj_out",
    attention=(
        # video self-attention over [cached prefix; video]: Note [cached prefix]
        Parallel(_BLOCKS + "attn1", USPRefinerSelfAttnProcessor, stock=(SanaWMLTX2RefinerAttnProcessor,)),
        Local(_BLOCKS + "attn2", stock=STOCK),  # video queries -> replicated text
        # LTX-2's audio modules: kept for the checkpoint, never run by the refiner's forward
        Local(_BLOCKS + "audio_attn1", stock=STOCK),
        Local(_BLOCKS + "audio_attn2", stock=STOCK),
        Local(_BLOCKS + "audio_to_video_attn", stock=STOCK),
        Local(_BLOCKS + "video_to_audio_attn", stock=STOCK),
    ),
    block_lists=("transformer_blocks",),
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "video_rotary_emb", "encoder_attention_mask"),
    hooks=(LTX2TimestepHook, CacheCfgCheck),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
