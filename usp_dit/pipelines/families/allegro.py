"""Allegro adapter: ``AllegroTransformer3DModel`` (Allegro T2V) on a USP grid.

Layout: latents (batch, channels, frames, height, width); video tokens (batch, seq, channels),
``seq = frames * (height / p) * (width / p)`` frame-major (each frame patch-embedded, then the frames
concatenated); T5 text (batch, 1, text_len, channels) projected to (batch, text_len, channels) with a
padding mask (batch, text_len) turned into a key bias (batch, 1, text_len), replicated on every
rank; inside ``AllegroAttnProcessor2_0`` Q/K/V are (batch, heads, seq, head_dim). The RoPE argument
``image_rotary_emb`` is ``((freqs_t, freqs_h, freqs_w), (pos_t, pos_h, pos_w))``: three (cos, sin)
tables indexed by *position value* (rows: the axis's length) and three position indices per token,
each (1, seq): **the tokens are on the last dim of the positions**, the tables have no token axis.

Allegro's block (``AllegroTransformerBlock``) is PixArt-like: adaLN-single modulation (one
(6 x C) row per batch element, used whole on each rank), then

* ``attn1``: full 3D self-attention over the video tokens with 3D RoPE: sequence-parallel. The stock
  ``AllegroAttnProcessor2_0`` rotates Q/K with ``image_rotary_emb`` and calls
  ``F.scaled_dot_product_attention``; its own code runs with ``F`` rebound to SD3's routed namespace
  (``usp_dit.pipelines.families.sd3`` Note [SD3's attention call]), so projections, RoPE and reshapes
  are stock's and only the attention call goes to ``usp_attention`` (Ulysses x Ring, no text);
* ``attn2``: cross-attention from this rank's video queries to the replicated caption, with the
  prompt's key bias per batch element (the text-side mask): every query row needs all the keys and
  nothing else, so the stock processor runs unchanged on the shard (``Local``, no communication);
* ``ff`` and the norms are per token.

Note [Allegro's RoPE positions]
    ``image_rotary_emb`` reaches every block whole (the pipeline builds it; the model passes it
    through). A forward pre-hook on each block replaces its three position rows (1, seq) by this
    rank's (1, seq_local), ``shard_sequence`` on the last dim exactly like the tokens (a view); the
    (cos, sin) tables are indexed by those values and pass whole. The processor then gathers
    cos/sin rows for this rank's tokens only, which are stock's rows for them. Cutting at the
    blocks, not at the transformer's arguments, keeps the full table for whatever wraps the forward
    (``enable_usp``'s input broadcast and cfg split).

The tokens are split at ``transformer_blocks.0``'s input and gathered at ``proj_out``'s output
(``_token_sharding`` Note [where the sequence is split]); the final norm and modulation between them
are per token and per element. Per-rank tokens, Allegro at 720 x 1280 x 88 frames (22 latent frames
of 90 x 160, patch 2): 22 x 45 x 80 = 79200 tokens, 9900 a rank on 8; 512 T5 tokens replicated.
``AllegroPipeline`` batches [uncond, cond] (and their masks) in one call: ``cfg_degree=2`` splits it.

Refused (NotImplementedError): at enable, a processor other than the stock ``AllegroAttnProcessor2_0``
(LoRA-replaced or custom: its maths would be lost), blocks other than stock ``AllegroTransformerBlock``
s, an unsupported Diffusers cache, ``num_layers=0``; at the call, ``attention_mask`` (a mask over the
video tokens, which attn1 would apply to its shard), a split that leaves a rank exactly one token
of a longer sequence (the stock block squeezes a one-token sequence dimension away: that rank would
compute something else than its rows of stock; every rank raises, from the length and the mesh), and RoPE positions whose length is not the token count.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from diffusers import AllegroTransformer3DModel
from diffusers.models.attention_processor import AllegroAttnProcessor2_0, Attention
from diffusers.models.transformers.transformer_allegro import AllegroTransformerBlock
from torch.utils.hooks import RemovableHandle

import usp_dit.pipelines.families.sd3 as sd3  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._routing import Route, with_global
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import layout_sizes, shard_sequence

_ROUTED_GLOBAL = "F"  # AllegroAttnProcessor2_0 calls F.scaled_dot_product_attention (torch.nn.functional as F)
_ROPE_ARG = 5  # AllegroTransformerBlock.forward(hidden_states, encoder_hidden_states, temb, mask, mask, image_rotary_emb)


def _routed_call(route: Route) -> Any:
    """``AllegroAttnProcessor2_0.__call__``'s code with ``F`` bound to SD3's ``_RoutedFunctional(route)``,
    or ``None`` when that code no longer reads ``F``."""
    return with_global(AllegroAttnProcessor2_0.__call__, _ROUTED_GLOBAL, sd3._RoutedFunctional(route))


class USPAllegroSelfAttnProcessor:
    """``attn1`` of this rank's video shard: 3D self-attention over every video token of the grid.

    Inputs (as ``Attention.forward`` passes them): ``hidden_states`` (B, S_local, C); ``image_rotary_emb``
    with this rank's positions, each (1, S_local) (Note [Allegro's RoPE positions]);
    ``encoder_hidden_states`` and ``attention_mask`` ``None``. Returns (B, S_local, C).
    """

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, "none")
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPAllegroSelfAttnProcessor:
        # Rebuild the routed function around the copied state (sd3 Note [SD3's attention call]).
        clone = type(self)(copy.deepcopy(self.route.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's Allegro adapter runs attn1 as unmasked self-attention over the video tokens; it got "
                f"encoder_hidden_states={'given' if encoder_hidden_states is not None else None}, "
                f"attention_mask={'given' if attention_mask is not None else None}"
            )
        return self._call(self, attn, hidden_states, None, None, temb, image_rotary_emb)


class AllegroRopeHooks:
    """Note [Allegro's RoPE positions]: each block's position rows cut like the tokens."""

    def __init__(self, transformer: AllegroTransformer3DModel, state: ShardState) -> None:
        self.state = state
        self.blocks = list(transformer.transformer_blocks)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(self._cut, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``image_rotary_emb``'s positions (1, S) -> (1, S_local); the tables whole.

        Raises:
            NotImplementedError: a rank would hold one token of a longer sequence, or the RoPE argument
                is not ``((tables...), (positions...))``.
            ValueError: the positions' length is not the token count.
        """
        # Decided from the call's length and the mesh, the same on every rank: all raise together.
        sizes = layout_sizes(self.state.seq_len, self.state.mesh, self.state.layout)
        if self.state.seq_len > 1 and 1 in sizes:
            raise NotImplementedError(
                f"usp_dit's Allegro adapter: {self.state.seq_len} video tokens over {len(sizes)} ranks leave a rank "
                f"one token, and AllegroTransformerBlock squeezes a one-token sequence away; use fewer ranks or "
                f"more tokens"
            )
        rope = _get_arg(args, kwargs, "image_rotary_emb", _ROPE_ARG)
        if rope is None:
            return args, kwargs
        if not (isinstance(rope, (tuple, list)) and len(rope) == 2 and len(rope[1]) == 3):
            raise NotImplementedError("image_rotary_emb must be ((freqs_t, freqs_h, freqs_w), (pos_t, pos_h, pos_w))")
        tables, positions = rope
        for pos in positions:
            if pos.shape[-1] != self.state.seq_len:
                raise ValueError(
                    f"image_rotary_emb's positions have {pos.shape[-1]} entries but the transformer has "
                    f"{self.state.seq_len} video tokens: they must match for the positions to be cut like the tokens"
                )
        local = tuple(shard_sequence(p, self.state.mesh, dim=-1, layout=self.state.layout) for p in positions)
        return _set_arg(args, kwargs, "image_rotary_emb", _ROPE_ARG, (tables, local))


def _routed_call_missing(model: torch.nn.Module) -> str | None:
    if _routed_call(Route(None)) is None:
        return (f"this diffusers' AllegroAttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


def _blocks_reason(model: AllegroTransformer3DModel) -> str | None:
    for i, block in enumerate(model.transformer_blocks):
        if type(block) is not AllegroTransformerBlock:
            return f"transformer_blocks.{i} is {type(block).__name__}, not AllegroTransformerBlock"
    return None


PLAN = ModelPlan(
    name="Allegro",
    model_class=AllegroTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn1", USPAllegroSelfAttnProcessor, stock=(AllegroAttnProcessor2_0,)),
        Local("transformer_blocks.*.attn2", stock=(AllegroAttnProcessor2_0,)),  # to the replicated, masked caption
    ),
    block_lists=("transformer_blocks",),
    # AllegroPipeline batches [uncond, cond] (embeds (B, 1, L, D) and masks (B, L)) in one call.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"),
    hooks=(AllegroRopeHooks,),
    refuse=(_blocks_reason, _routed_call_missing),
    refuse_args={"attention_mask": "a mask over the video tokens, which attn1 would apply to its shard"},
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
