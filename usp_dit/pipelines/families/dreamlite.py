"""DreamLite adapter: ``DreamLiteTransformer2DModel`` (the attention blocks of ``DreamLiteUNetModel``) on a USP grid.

Layout: the block's input and output (batch, channels, height, width), a U-Net level's feature map;
tokens (batch, S, inner_dim), ``S = height * width`` row-major (no patches); text (batch, T,
cross_attention_dim) with ``encoder_attention_mask`` (batch, T) 1 / True for a real token, or the
U-Net's additive bias (batch, 1, T); inside ``DreamLiteAttnProcessor2_0`` Q (batch, seq, heads,
head_dim) and K/V (batch, seq, kv_heads, head_dim) repeated to ``heads`` (GQA; DreamLite: 1 kv head).

What the model does (``DreamLiteTransformer2DModel.forward``, a continuous-input ``Transformer2DModel``):

    x (B, C, H, W) ─► GroupNorm (statistics over the whole map) ─► proj_in (1x1 conv or linear) ─► (B, S, C')
    ─► transformer_blocks: norm1 ─► attn1 (self-attention over the S tokens; absent where
                           ``use_self_attention=False``) ─► norm2 ─► attn2 (cross-attention to the text,
                           key mask) ─► norm3 ─► feed-forward
    ─► (B, H, W, C') ─► proj_out ─► + x

Where the tokens are split: ``transformer_blocks.0``'s input (this rank's contiguous rows of the S
tokens), gathered at ``transformer_blocks.-1``'s output, before the reshape to a map that
``proj_out`` (a 1x1 conv in the released U-Net) needs whole. The GroupNorm (whose statistics span
every token) and ``proj_in`` run whole on every rank before the split. In a block every op but
``attn1`` is per token (layer norms, ``attn2``'s queries, the feed-forward; ``norm_type``'s
``ada_norm`` variants modulate per element):

* ``attn1`` (``Parallel``): ``DreamLiteAttnProcessor2_0``'s own code with its ``dispatch_attention_fn``
  call routed (``_routing``): Ulysses x Ring over the whole map's tokens, no text. The stock code
  repeats K/V from ``kv_heads`` to ``heads`` (``repeat_interleave``: query head h reads kv head
  h // n_rep, the core's GQA convention); on a grid the routed call takes every ``n_rep``-th head
  back (exact: the others are copies), so Ulysses moves ``kv_heads`` K/V heads, not ``heads``
  (DreamLite's one kv head: 1 / heads of the traffic). On one rank the kernel takes stock's heads.
* ``attn2`` (``Local``, the stock processor): each query attends to the replicated text under its
  key mask; a query's row needs nothing but the text, so this rank's rows are stock's.

Gathered width: ``inner_dim`` (= the level's channels in ``DreamLiteUNetModel``, as wide as
``proj_out``'s output). Per-rank tokens, DreamLite at 1024 x 1024 (a 128 x 128 latent): the
self-attention levels of its U-Net run on 32 x 32 = 1024 tokens (and 16 x 16 in the mid block):
128 a rank on 8. The text (Qwen3-VL embeddings) is replicated.

Note [DreamLite's pipelines]
    ``DreamLitePipeline`` and ``DreamLiteMobilePipeline`` run a ``DreamLiteUNetModel``: a
    convolutional U-Net (ResNet blocks of separable convolutions and GroupNorms, down- and
    up-sampling) of which ``DreamLiteTransformer2DModel`` is the attention block of some levels.
    ``pipe.enable_usp()`` refuses a pipeline without a transformer component (a U-Net's
    convolutions are not split by usp_dit). The transformer blocks of a U-Net are enabled one by
    one on one mesh (``usp_dit.demo.tiny_dreamlite.enable_usp_on_unet_blocks``): each splits its
    tokens and gathers its output, everything else of the U-Net runs whole on every rank, and
    the U-Net's output equals one process's (tests/test_pipeline_dreamlite.py). Only the attention
    blocks' work is divided: a speed-up in proportion to their share of the U-Net's time.

Refused (NotImplementedError): at enable, an ``attn1`` processor other than the stock
``DreamLiteAttnProcessor2_0`` (which ``DreamLiteUNetModel`` installs everywhere; the class's own
default ``AttnProcessor2_0`` mishandles GQA) and ``attn2`` processors other than it or
``AttnProcessor2_0``; attention modules the plan does not name (GLIGEN's gated fuser);
``only_cross_attention`` or ``double_self_attention`` (``attn1`` / ``attn2`` not the self- and
cross-attention the plan splits); dropout (a shard would draw other random numbers than one
process); a block with a position embedding; an unsupported Diffusers cache; at the call,
``attention_mask`` (a mask over the tokens, which ``attn1`` would apply to its shard).
Tensor parallelism is not declared (refused). No CFG axis of its own: the U-Net's callers batch [uncond, cond] (``cfg_batch_args`` split it when
the transformer is called with that batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DreamLiteTransformer2DModel
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.transformers.transformer_2d_dreamlite import BasicTransformerBlockDreamLite
from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0

from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, route_attention, with_global
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter


@dataclass(eq=False)
class _KVHeadsRoute(Route):
    """The ``Route`` of ``attn1`` with the call's query heads per kv head (set by the processor)."""

    n_rep: int = 1


def _route_kv_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None, parallel_config: Any = None,
) -> torch.Tensor:
    """``route_attention`` with the repeated K/V heads (B, S_local, heads, D) taken back to the kv heads
    on a grid (the module Note's ``attn1``). Returns (B, S_local, heads, D)."""
    route = parallel_config
    if route.n_rep > 1 and route.state.mesh.sequence_degree > 1:
        key, value = key[:, :, :: route.n_rep], value[:, :, :: route.n_rep]
    return route_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
                           backend=backend, parallel_config=route)


# DreamLiteAttnProcessor2_0's code with its dispatch_attention_fn call routed (None: it no longer makes one).
_ROUTED_CALL = with_global(DreamLiteAttnProcessor2_0.__call__, ROUTED_NAME, _route_kv_heads)


class USPDreamLiteAttnProcessor(RoutedProcessor):
    """``attn1`` of this rank's tokens: ``DreamLiteAttnProcessor2_0``'s code, its attention call
    routed with the kv heads. Inputs as stock's (``hidden_states`` (B, S_local, C); no mask: refused
    at the call); returns (B, S_local, C), stock's rows of this rank's tokens."""

    _stock_call = _ROUTED_CALL

    def __init__(self, route: Route) -> None:
        super().__init__(_KVHeadsRoute(route.state, route.text))

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        head_dim = attn.to_q.out_features // attn.heads
        n_rep = attn.heads // (attn.to_k.out_features // head_dim)
        if self.route.n_rep != n_rep:  # every block of a model has the same: set once
            self.route.n_rep = n_rep
        return _ROUTED_CALL(self, attn, hidden_states, encoder_hidden_states, attention_mask, temb)


def _routed_call_missing(model: torch.nn.Module) -> str | None:
    if _ROUTED_CALL is None:
        return "this diffusers' DreamLiteAttnProcessor2_0 does not call dispatch_attention_fn, the call usp_dit routes"
    return None


def _blocks_reason(model: torch.nn.Module) -> str | None:
    """A reason to refuse a model whose blocks the plan was not written for, or None."""
    cfg = model.config
    if cfg.only_cross_attention or cfg.double_self_attention:
        return (f"only_cross_attention={cfg.only_cross_attention}, double_self_attention={cfg.double_self_attention}: "
                f"the plan splits attn1 as self-attention over the tokens and runs attn2 as cross-attention to the "
                f"replicated text")
    if cfg.dropout:
        return f"dropout={cfg.dropout}: a shard would draw other random numbers than one process"
    for i, block in enumerate(model.transformer_blocks):
        if type(block) is not BasicTransformerBlockDreamLite or block.pos_embed is not None:
            return (f"transformer_blocks.{i} is {type(block).__name__} with pos_embed={type(block.pos_embed).__name__}; "
                    f"the plan runs BasicTransformerBlockDreamLite without a position embedding")
    return None


PLAN = ModelPlan(
    name="DreamLite",
    model_class=DreamLiteTransformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="transformer_blocks.-1",  # before the reshape to a map that proj_out (a 1x1 conv) needs whole
    attention=(
        Parallel("transformer_blocks.*.attn1", USPDreamLiteAttnProcessor, stock=(DreamLiteAttnProcessor2_0,)),
        Local("transformer_blocks.*.attn2", stock=(DreamLiteAttnProcessor2_0, AttnProcessor2_0)),
    ),
    block_lists=("transformer_blocks",),
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask",
                    "added_cond_kwargs", "class_labels"),
    refuse=(_routed_call_missing, _blocks_reason),
    refuse_args={"attention_mask": "a mask over the tokens, which attn1 would apply to its shard"},
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
