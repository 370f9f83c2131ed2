"""Lumina-Next adapter: ``LuminaNextDiT2DModel`` (Lumina-Next-SFT, 2B; ``LuminaPipeline``) on a USP grid.

Layout: latents (batch, channels, height, width); image tokens (batch, S, channels),
``S = (height / p) * (width / p)``, row-major; caption tokens (batch, T, cross_attention_dim) with
``encoder_mask`` (batch, T), 1 for a real token; Q (batch, seq, heads, head_dim), K/V (batch, seq,
kv_heads, head_dim) (GQA: Lumina-Next-SFT has 32 query heads, 8 key/value heads); the RoPE table the
pipeline passes, ``image_rotary_emb`` (384, 384, head_dim / 2) complex, 2-D (row, column), of which
``patch_embedder`` returns the image's (1, S, head_dim / 2), row-major like the tokens.

What the model does (``LuminaNextDiT2DModel.forward``):

    latents ─► patch_embedder ─► tokens (B, S, C), key mask (B, S) of ones, RoPE (1, S, D/2)
    captions (B, T, C_text) ─► pooled over encoder_mask into temb (with the timestep)
    layers (24): attn1 = self-attention over the image tokens (RoPE on Q and K; proportional scale)
                 attn2 = cross-attention from the image tokens to the caption (RoPE on Q; caption key mask)
                 (each block feeds the raw caption to attn2: the caption stream is never updated)
    ─► norm_out (per token, to p*p*2*channels) ─► unpatchify

Where the tokens are split: ``layers.0``'s input (this rank's contiguous rows of the S image tokens),
gathered at ``norm_out``'s output (its width, p*p*2*channels, is the model's smallest). The RoPE
table is the plan's ``Table`` (``patch_embedder``'s output 3, cut on dim 1 like the tokens). Every op
of a block but ``attn1`` is per token or per element (norms, modulation by ``temb``, feed-forward,
the per-head cross-attention gate): exact on a shard.

* ``attn1`` (``Parallel``): self-attention over the whole image (Note [Lumina-Next's attention]).
* ``attn2`` (``Local``, the stock processor): each image query attends to the caption, which every
  rank holds whole (replicated: short, and never updated by the blocks), under the caption key mask
  ``encoder_mask``. A query's output depends only on its own row and the caption, so this rank's
  query rows give exactly stock's rows, with no communication. Its scale is the default
  (the stock code applies the proportional scale only where keys are rotated, i.e. in ``attn1``).

Per-rank tokens, Lumina-Next-SFT at 1024 x 1024 (4096 image tokens), 8 ranks: 512 image tokens; the
caption (<= 256 Gemma tokens) whole on every rank, as keys of ``attn2`` only.

Note [Lumina-Next's attention]
    ``LuminaAttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` on (B, H, L, D) tensors with
    K/V repeated from the kv heads to every query head, as Lumina2's processor does (``lumina2`` Note
    [Lumina2's attention call]): its ``_RoutedFunctional`` takes every ``n_rep``-th head of K/V back
    and routes the call with the kv heads. Two things of that code depend on the sequence:

    * the mask: ``attn1`` gets the ``(B, S)`` mask ``LuminaPatchEmbed`` makes, ``torch.ones`` (every
      key valid: the model never builds another, and a caller cannot pass one to the forward), which
      the stock code expands to (B, H, S_local, S). It masks nothing: the routed call drops it.
    * proportional attention (Lumina-Next's resolution extrapolation): with ``base_sequence_length``
      in ``cross_attention_kwargs`` (``LuminaPipeline`` passes ``(default_image_size / 16) ** 2`` by
      default) the scale is ``sqrt(log(L, base_sequence_length)) * attn.scale`` with ``L`` the query
      length of the call, the whole image's S in stock. On a shard the stock code would read
      ``S_local``; this processor computes the scale with the same expression from the call's
      global token count (``ShardState.seq_len``) and hands the stock code ``base_sequence_length=None``
      so that it does not. The RoPE table's NTK and linear scaling are the pipeline's, made from the
      requested image size, before the model: the same table on every rank, cut like the tokens.

Refused (NotImplementedError): at enable, processors other than the stock ``LuminaAttnProcessor2_0``
(LoRA-replaced, custom, Diffusers' context parallelism), attention modules the plan does not name,
an unsupported Diffusers cache, and a Diffusers whose ``LuminaAttnProcessor2_0`` makes no
``F.scaled_dot_product_attention`` call; at the call, a processor replaced after enable, and an
``attn1`` called with other keys than its queries (cross-attention where self-attention is split).
``LuminaPipeline`` batches its CFG branches ([cond, uncond], one call a step): ``cfg_degree=2``
splits that batch. LuminaNext configs have no dropout. Tensor parallelism is not declared (refused):
the QK norm is a LayerNorm across all heads (``layer_norm_across_heads``), so a rank holding some
heads would need the statistics of every head.
"""
from __future__ import annotations

import copy
import math

import torch
from diffusers import LuminaNextDiT2DModel
from diffusers.models.attention_processor import Attention, LuminaAttnProcessor2_0

import usp_dit.pipelines.families.lumina2 as lumina2  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._routing import Route, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table

_ROUTED_GLOBAL = "F"  # LuminaAttnProcessor2_0 calls F.scaled_dot_product_attention


class _SelfAttentionFunctional(lumina2._RoutedFunctional):
    """Lumina2's routed ``torch.nn.functional`` (K/V's repeated heads dropped before the route) with
    the two changes of Note [Lumina-Next's attention]: the all-ones key mask dropped, and the scale
    of the call in progress (set by the processor from the global token count) used."""

    def __init__(self, route: Route) -> None:
        super().__init__(route)
        self.scale: float | None = None  # the call's softmax scale (None: the kernel's default)

    def scaled_dot_product_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    ) -> torch.Tensor:
        """(B, H, S_local, D) in and out; ``attn_mask`` the patch embedding's all-ones key mask, expanded."""
        return super().scaled_dot_product_attention(query, key, value, None, dropout_p, is_causal, self.scale,
                                                    enable_gqa)


class USPLuminaNextSelfAttnProcessor:
    """``layers.*.attn1``: self-attention of this rank's image tokens over the whole image.

    Inputs: ``hidden_states`` (B, S_local, C) (``encoder_hidden_states`` the same tensor, as stock
    passes it); ``attention_mask`` (B, S) the patch embedding's ones; ``query_rotary_emb`` /
    ``key_rotary_emb`` (1, S_local, D/2) complex, this rank's rows; ``base_sequence_length`` or
    ``None``. Returns (B, S_local, H, D), as stock's (the block gates and sums it with ``attn2``'s
    per head). The maths is the stock processor's own code (Note [Lumina-Next's attention]).
    """

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, "none")
        self._functional = _SelfAttentionFunctional(self.route)
        self._call = with_global(LuminaAttnProcessor2_0.__call__, _ROUTED_GLOBAL, self._functional)

    def __deepcopy__(self, memo: dict) -> USPLuminaNextSelfAttnProcessor:
        clone = type(self)(copy.deepcopy(self.route.state, memo))  # the routed function around the copy
        memo[id(self)] = clone
        return clone

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: torch.Tensor | None = None,
        key_rotary_emb: torch.Tensor | None = None,
        base_sequence_length: int | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not hidden_states:
            raise NotImplementedError(
                "usp_dit's LuminaNext attn1 processor runs self-attention over the image tokens (encoder_hidden_states "
                "is hidden_states, as LuminaNextDiTBlock calls it); it got other keys")
        self._functional.use_heads_of(attn)
        self._functional.scale = self._scale(attn, key_rotary_emb, base_sequence_length)
        return self._call(self, attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                          key_rotary_emb, None)

    def _scale(self, attn: Attention, key_rotary_emb: torch.Tensor | None, base: int | None) -> float | None:
        """Stock's softmax scale, with the whole image's token count for its query length (Note
        [Lumina-Next's attention]): the same Python float expression as the stock code's."""
        if key_rotary_emb is None:
            return None
        if base is None:
            return attn.scale
        return math.sqrt(math.log(self.route.state.seq_len, base)) * attn.scale


def _routed_call_missing(transformer: LuminaNextDiT2DModel) -> str | None:
    if with_global(LuminaAttnProcessor2_0.__call__, _ROUTED_GLOBAL, None) is None:
        return (f"this diffusers' LuminaAttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


PLAN = ModelPlan(
    name="LuminaNext",
    model_class=LuminaNextDiT2DModel,
    split_at="layers.0",
    gather_at="norm_out",
    attention=(
        Parallel("layers.*.attn1", USPLuminaNextSelfAttnProcessor, stock=(LuminaAttnProcessor2_0,)),
        Local("layers.*.attn2", stock=(LuminaAttnProcessor2_0,)),  # image queries -> replicated caption
    ),
    block_lists=("layers",),
    # patch_embedder(...)[3]: the image tokens' RoPE table (1, S, D/2), cut on dim 1.
    tables=(Table("patch_embedder", dim=1, items=(3,)),),
    # LuminaPipeline batches [cond, uncond] in one call; the RoPE table has no batch dim.
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_mask"),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
