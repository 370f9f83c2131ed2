"""PixArt adapter: ``PixArtTransformer2DModel`` (PixArt-Alpha, PixArt-Sigma) on a USP grid.

Layout: latents (batch, channels, height, width); image tokens (batch, seq, channels), ``seq =
(height / p) * (width / p)`` row-major as ``PatchEmbed`` flattens them (its sin-cos position table
added per token there, before the split); T5 text (batch, text_len, channels) with a padding mask
(batch, text_len) turned into a key bias (batch, 1, text_len), replicated on every rank; inside
``AttnProcessor2_0`` Q/K/V are (batch, heads, seq, head_dim).

PixArt's blocks are Diffusers' ``BasicTransformerBlock`` with ``norm_type="ada_norm_single"``: the
adaLN-single modulation is one (batch, 6 x C) vector per element (from the timestep, and for
PixArt-Alpha 1024 the resolution and aspect ratio), the same for every token, so it is used whole
on each rank. Per block:

* ``attn1``: self-attention over the image tokens: sequence-parallel. The stock
  ``AttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` directly; its own code runs with
  ``F`` rebound to SD3's routed namespace (``usp_dit.pipelines.families.sd3`` Note [SD3's attention
  call]), so the projections and reshapes are stock's and only the attention call goes to
  ``usp_attention`` (Ulysses x Ring over the image tokens, no text).
* ``attn2``: cross-attention from this rank's image tokens (queries) to the replicated text (keys
  and values), with the prompt's key bias per batch element: every query row needs all the keys
  and nothing else, so the stock processor runs unchanged on the shard (``Local``), with no
  communication. Each element's valid text length is honoured as in stock (the bias is over keys).
* ``ff`` and the norms are per token.

The tokens are split at ``transformer_blocks.0``'s input and gathered at ``proj_out``'s output
(``_token_sharding`` Note [where the sequence is split]); the final modulation between them is per
element. There is no RoPE. PixArt-Sigma at 1024 x 1024: 64 x 64 = 4096 image tokens (512 a rank on
8), 300 T5 tokens replicated; at 2048 x 2048: 16384 (2048 a rank on 8). PixArt-Alpha: 120 T5 tokens.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]).
``PixArtAlphaPipeline`` and ``PixArtSigmaPipeline`` batch [uncond, cond] in one call: ``cfg_degree=2``
splits it, ``added_cond_kwargs`` (Alpha's per-element resolution and aspect ratio) included.

Refused (NotImplementedError): at enable, an ``attn1`` processor other than the stock
``AttnProcessor2_0`` (``AttnProcessor``'s baddbmm, fused QKV, PAG's, LoRA-replaced or custom ones:
their maths would be lost), an ``attn2`` processor other than ``AttnProcessor2_0`` / ``AttnProcessor``,
a block that is not a stock ``BasicTransformerBlock`` with ``ada_norm_single``, no per-block position
embedding and separate self-/cross-attention, an unsupported Diffusers cache, ``num_layers=0``; at
the call, ``attention_mask`` (a mask over the image tokens: the stock code would hand it to
``attn1``).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from diffusers import PixArtTransformer2DModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

import usp_dit.pipelines.families.sd3 as sd3  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._routing import Route, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter

_ROUTED_GLOBAL = "F"  # AttnProcessor2_0 calls F.scaled_dot_product_attention (torch.nn.functional as F)


def _routed_call(route: Route) -> Any:
    """``AttnProcessor2_0.__call__``'s code with ``F`` bound to SD3's ``_RoutedFunctional(route)``,
    or ``None`` when that code no longer reads ``F``."""
    return with_global(AttnProcessor2_0.__call__, _ROUTED_GLOBAL, sd3._RoutedFunctional(route))


class USPPixArtSelfAttnProcessor:
    """``attn1`` of this rank's image shard: self-attention over every image token of the grid.

    Inputs (as ``Attention.forward`` passes them): ``hidden_states`` (B, S_local, C);
    ``encoder_hidden_states`` and ``attention_mask`` ``None`` (a mask over the image tokens is
    refused at the call). Returns (B, S_local, C): stock's rows for this rank's tokens.
    """

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, "none")
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPPixArtSelfAttnProcessor:
        # Rebuild the routed function around the copied state (sd3 Note [SD3's attention call]).
        clone = type(self)(copy.deepcopy(self.route.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's PixArt adapter runs attn1 as unmasked self-attention over the image tokens; it got "
                f"encoder_hidden_states={'given' if encoder_hidden_states is not None else None}, "
                f"attention_mask={'given' if attention_mask is not None else None}"
            )
        return self._call(self, attn, hidden_states, None, None, *args, **kwargs)


def _routed_call_missing(model: torch.nn.Module) -> str | None:
    if _routed_call(Route(None)) is None:
        return (f"this diffusers' AttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


def _blocks_reason(model: torch.nn.Module) -> str | None:
    """A reason to refuse a block whose token maths the plan was not written for, or None."""
    for i, block in enumerate(model.transformer_blocks):
        if type(block) is not BasicTransformerBlock:
            return f"transformer_blocks.{i} is {type(block).__name__}, not BasicTransformerBlock"
        if block.norm_type != "ada_norm_single" or block.pos_embed is not None or block.only_cross_attention:
            return (f"transformer_blocks.{i} has norm_type={block.norm_type!r}, pos_embed="
                    f"{type(block.pos_embed).__name__}, only_cross_attention={block.only_cross_attention}; the plan "
                    f"runs PixArt's (ada_norm_single, no per-block position embedding, self- then cross-attention)")
    return None


PLAN = ModelPlan(
    name="PixArt",
    model_class=PixArtTransformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn1", USPPixArtSelfAttnProcessor, stock=(AttnProcessor2_0,)),
        Local("transformer_blocks.*.attn2", stock=(AttnProcessor2_0, AttnProcessor)),
    ),
    block_lists=("transformer_blocks",),
    # PixArtAlphaPipeline / PixArtSigmaPipeline batch [uncond, cond] in one call; added_cond_kwargs is
    # a dict of per-element tensors (or None), split entry by entry.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask",
                    "added_cond_kwargs"),
    refuse=(_blocks_reason, _routed_call_missing),
    refuse_args={"attention_mask": "a mask over the image tokens, which attn1 would apply to its shard"},
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
