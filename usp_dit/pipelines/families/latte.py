"""Latte adapter: ``LatteTransformer3DModel`` (Latte-1, text-to-video) on a USP grid.

Layout: latents (batch, channels, frames, height, width); the model folds the frames into the
batch and embeds each frame as an image: tokens (batch * frames, seq, channels), ``seq =
(height / p) * (width / p)`` row-major as ``PatchEmbed`` flattens them (its sin-cos table added
there, before the split); T5 text (batch, text_len, channels), projected and repeated per frame to
(batch * frames, text_len, channels), replicated on every rank; an optional text key bias
``encoder_attention_mask`` (batch * frames, 1, text_len); inside ``AttnProcessor2_0`` Q/K/V are
(batch', heads, seq', head_dim).

Note [Latte's two attentions]
    Latte alternates a *spatial* block (self-attention among the tokens of one frame, then
    cross-attention to the caption) and a *temporal* block (self-attention among the frames of one
    spatial position), reshaping between them:

        spatial   (B*F, S, C)  ── attn1 over S, attn2 to the text, ff
        temporal  (B*S, F, C)  ── attn1 over F, ff           (no cross-attention)

    We shard the spatial positions S, the same positions for every frame: this rank holds
    (B*F, S_local, C). Then
      * spatial ``attn1`` is sequence-parallel over S with batch B*F: ``usp_attention`` on every
        frame at once (the frames are batch rows to it);
      * spatial ``attn2`` is local: each query row of this rank's shard reads the whole replicated
        caption (and its key bias), as in stock;
      * the model's own reshape (B*F, S_local, C) -> (B*S_local, F, C) gives this rank every frame
        of its positions, so temporal ``attn1`` is local and exact, with no communication; the
        temporal position table ``temp_pos_embed`` (1, frames, C) is indexed by frame, not by
        position, and is added after the reshape whole, as in stock.
    Splitting the frames instead would bound the ranks by the frame count (16 latent frames) and
    make the temporal attention the parallel one; S (1024 at 512 x 512) is the long axis.

Note [Latte's temporal timestep]
    The adaLN-single modulation is one (6 x C) row per batch element, the same for every token.
    The model repeats it per frame for the spatial blocks, (B*F, 6C): rows match the shard's rows
    and it is used whole. For the temporal blocks it repeats it per *position* from the full grid,
    ``timestep_temp`` (B*S, 6C), while the shard's temporal batch is B*S_local: a forward pre-hook
    on each temporal block hands it this rank's rows (B, S, 6C)[:, shard] -> (B*S_local, 6C), cut
    like the tokens (``shard_sequence``; the rows are equal within an element, so this is the
    stock values, with the gradient flowing to the same adaLN-single output).

Per-rank tokens, Latte-1 at 512 x 512 x 16 frames (64 x 64 latent, patch 2): S = 1024 positions,
16384 tokens; on 8 ranks 128 positions x 16 frames = 2048 tokens a rank, the 120 T5 tokens
replicated (their projection per rank: one caption projection per call).

The tokens are split at ``transformer_blocks.0``'s input and gathered at ``proj_out``'s output
(``_token_sharding`` Note [where the sequence is split]); the final norm and modulation between
them are per token and per (element, frame). The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan``
Note [a model is a plan]). ``LattePipeline`` batches [uncond, cond] in one call: ``cfg_degree=2``
splits it.

Refused (NotImplementedError): at enable, a spatial ``attn1`` processor other than the stock
``AttnProcessor2_0`` (fused QKV, LoRA-replaced or custom: their maths would be lost), other
processors than ``AttnProcessor2_0`` / ``AttnProcessor`` on the local attentions, blocks that are
not stock ``BasicTransformerBlock`` s with ``ada_norm_single`` (the released config; the plan was
written and tested for it), a temporal block with cross-attention, an unsupported Diffusers cache,
``num_layers=0``; at the call, an ``encoder_attention_mask`` over the video queries
(batch * frames, seq, text_len) rather than a key bias (batch * frames, 1, text_len). With
``cfg_degree`` > 1 an ``encoder_attention_mask`` of several frames raises ValueError at the cfg
split (its rows are batch * frames, not the batch rows the split cuts; ``LattePipeline`` passes none).
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import LatteTransformer3DModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from torch.utils.hooks import RemovableHandle

import usp_dit.pipelines.families.pixart as pixart  # noqa: PLR0402  (the module: its routed AttnProcessor2_0 call)
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import shard_sequence

_TIMESTEP_ARG = 4  # BasicTransformerBlock.forward(hidden_states, attention_mask, encoder_hidden_states, mask, timestep, ...)


class USPLatteSpatialAttnProcessor(pixart.USPPixArtSelfAttnProcessor):
    """Spatial ``attn1`` of this rank's positions: self-attention over every position of each frame.

    Inputs: ``hidden_states`` (B*F, S_local, C) (the frames are batch rows); ``encoder_hidden_states``
    and ``attention_mask`` ``None``. Returns (B*F, S_local, C): stock ``AttnProcessor2_0``'s code,
    its ``F.scaled_dot_product_attention`` call routed to ``usp_attention`` (``pixart``).
    """

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's Latte adapter runs the spatial attn1 as unmasked self-attention over each frame's "
                f"positions; it got encoder_hidden_states={'given' if encoder_hidden_states is not None else None}, "
                f"attention_mask={'given' if attention_mask is not None else None}"
            )
        return self._call(self, attn, hidden_states, None, None, *args, **kwargs)


class LatteTemporalTimestepHook:
    """Note [Latte's temporal timestep]: each temporal block gets this rank's rows of ``timestep_temp``;
    a transformer pre-hook refuses a text mask per video query (a shard has only its own queries)."""

    def __init__(self, transformer: LatteTransformer3DModel, state: ShardState) -> None:
        self.state = state
        self.transformer = transformer
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for block in self.transformer.temporal_transformer_blocks:
            self.handles.append(block.register_forward_pre_hook(self._shard_timestep, with_kwargs=True))
        self.handles.append(self.transformer.register_forward_pre_hook(self._check_mask, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _shard_timestep(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(B*S, 6C) -> this rank's (B*S_local, 6C), cut on S like the tokens.

        Raises:
            ValueError: the timestep's rows are not a multiple of the call's position count.
        """
        timestep = _get_arg(args, kwargs, "timestep", _TIMESTEP_ARG)
        seq = self.state.seq_len
        if timestep is None or seq is None or timestep.shape[0] % seq:
            raise ValueError(
                f"a Latte temporal block got a timestep of {None if timestep is None else tuple(timestep.shape)} "
                f"for {seq} positions a frame: it must be (batch * positions, 6 * channels)"
            )
        local = shard_sequence(timestep.unflatten(0, (-1, seq)), self.state.mesh, dim=1, layout=self.state.layout)
        return _set_arg(args, kwargs, "timestep", _TIMESTEP_ARG, local.flatten(0, 1))

    def _check_mask(self, module, args: tuple, kwargs: dict) -> None:
        mask = _get_arg(args, kwargs, "encoder_attention_mask", 3)
        if mask is None:
            return
        if mask.dim() == 3 and mask.shape[1] != 1:
            raise NotImplementedError(
                f"usp_dit's Latte adapter takes encoder_attention_mask as a key bias (batch * frames, 1, text_len); "
                f"got {tuple(mask.shape)}, a mask per video query, which the shards' queries cannot take"
            )


def _blocks_reason(model: LatteTransformer3DModel) -> str | None:
    """A reason to refuse a block whose token maths the plan was not written for, or None."""
    for name in ("transformer_blocks", "temporal_transformer_blocks"):
        for i, block in enumerate(getattr(model, name)):
            if type(block) is not BasicTransformerBlock:
                return f"{name}.{i} is {type(block).__name__}, not BasicTransformerBlock"
            if block.norm_type != "ada_norm_single" or block.pos_embed is not None or block.only_cross_attention:
                return (f"{name}.{i} has norm_type={block.norm_type!r}, pos_embed={type(block.pos_embed).__name__}, "
                        f"only_cross_attention={block.only_cross_attention}; the plan runs Latte's released blocks "
                        f"(ada_norm_single, no per-block position embedding)")
            if name == "temporal_transformer_blocks" and block.attn2 is not None:
                return f"{name}.{i} has a cross-attention (attn2); Latte's temporal blocks have none"
    return None


def _routed_call_missing(model: torch.nn.Module) -> str | None:
    return pixart._routed_call_missing(model)


PLAN = ModelPlan(
    name="Latte",
    model_class=LatteTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        # Note [Latte's two attentions]
        Parallel("transformer_blocks.*.attn1", USPLatteSpatialAttnProcessor, stock=(AttnProcessor2_0,)),
        Local("transformer_blocks.*.attn2", stock=(AttnProcessor2_0, AttnProcessor)),
        Local("temporal_transformer_blocks.*.attn1", stock=(AttnProcessor2_0, AttnProcessor)),
    ),
    block_lists=("transformer_blocks", "temporal_transformer_blocks"),
    # LattePipeline batches [uncond, cond] in one call. encoder_attention_mask has batch * frames rows:
    # with frames > 1 the cfg split raises a ValueError naming it (usp_dit.pipelines.replica_forward),
    # never cuts it wrongly; LattePipeline passes none.
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"),
    hooks=(LatteTemporalTimestepHook,),
    refuse=(_blocks_reason, _routed_call_missing),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
