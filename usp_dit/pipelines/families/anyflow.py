"""AnyFlow adapter: ``AnyFlowTransformer3DModel`` (AnyFlow's bidirectional flow-map DiT, ``AnyFlowPipeline``)
on a USP grid.

Layout: latents (batch, **frames, channels**, height, width) (the pipeline permutes Wan's
(B, C, F, H, W) before the call); video tokens (batch, seq, channels), ``seq = frames * height/p_h
* width/p_w`` (p_t = 1: the forward unpacks its output with ``num_frames`` latent frames), frame-major
as ``patch_embedding(x).flatten(2)`` orders them; text (batch, text_seq, channels) and I2V image tokens
(batch, image_seq, channels), both replicated; Q/K/V (batch, heads, seq, head_dim) when rotated,
(batch, seq, heads, head_dim) at the attention call; the timesteps ``t`` and ``r`` (batch, frames):
one per latent frame.

The backbone is Wan 2.1's (``usp_dit.pipelines.families.wan``: tokens split at block 0's input,
``attn1`` self-attention routed to ``usp_attention``, ``attn2`` cross-attention to the replicated
text run locally, ``proj_out``'s output gathered before unpatchify), with AnyFlow's own classes and
two tables of its own (Note [AnyFlow's per-token tables]). Its attention modules and processors are
distinct classes from Wan's, so only the plan's shape is shared, not Wan's processor.

Note [AnyFlow's per-token tables]
    Two things the blocks read are indexed by token, and both are built whole, before block 0:

      * the RoPE table: ``rope(layout_cfg, device)`` returns ``{"query": f, "key": f}``, each
        complex (1, 1, seq, head_dim / 2): **the sequence on dim 2**. ``RopeDictHooks`` (the plan's
        table hook for a dict output) keeps this rank's rows of both entries, once per forward.
      * the modulation: the dual-timestep embedder (``condition_embedder``) embeds one (t, r) pair
        per latent frame and ``repeat_interleave``-s it to every token of its frame: ``temb``
        (B, seq, C) (the final norm's shift / scale) and ``timestep_proj`` (B, seq, 6C) (every
        block's). The plan's ``Table("condition_embedder", dim=1, items=(0, 1))`` cuts both like the
        tokens, so the blocks and the final norm run on this rank's rows; the text projection
        (entry 2) and image embedding (entry 3) pass whole. The embedder's MLPs run on the B * F
        per-frame rows on every rank (tiny); only the repeated rows are cut.

    Per-token modulation makes the output per token, so cutting it exactly like the tokens is
    the whole condition for exactness: each token's block maths is then stock's, and attention
    is over the whole sequence (``usp_attention``), with no mask (the bidirectional model passes
    ``attention_mask=None`` to every block).

Per-rank token count, AnyFlow's 14B release (Wan 2.1-14B shape: 480 x 832, 81 frames = 21 latent
frames x 30 x 52 patches = 32760 video tokens; 512 replicated text tokens): 4095 video tokens per
rank on 8 ranks, plus the replicated text K/V of cross-attention.

Refused (NotImplementedError): processors other than the stock ``AnyFlowAttnProcessor`` on
``attn1`` and ``AnyFlowCrossAttnProcessor`` on ``attn2`` (LoRA-replaced, custom, diffusers' context
parallelism), an ``attention_mask`` reaching ``attn1`` (the stock forward passes none), a temporal patch size other than 1 (stock itself cannot unpack such an output),
a Diffusers cache that cannot run on a grid, ``num_layers=0``. The frame-autoregressive sibling
``AnyFlowFARTransformer3DModel`` is a different class, with its own plan
(``usp_dit.pipelines.families.anyflow_far``).
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import AnyFlowTransformer3DModel
from diffusers.models.transformers.transformer_anyflow import (
    AnyFlowAttention,
    AnyFlowAttnProcessor,
    AnyFlowCrossAttnProcessor,
)

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table, TableHooks

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedAnyFlowProcessor = routed_processor_class(AnyFlowAttnProcessor, "_RoutedAnyFlowProcessor")


class USPAnyFlowAttnProcessor(_RoutedAnyFlowProcessor or RoutedProcessor):
    """AnyFlow self-attention (``attn1``) of this rank's video shard against the whole sequence.

    Inputs: ``hidden_states`` (B, S_local, C); ``rotary_emb`` this rank's rows of the RoPE table,
    ``{"query", "key"}`` each complex (1, 1, S_local, head_dim / 2) (cut by ``RopeDictHooks``).
    Returns (B, S_local, C). The maths is the stock ``AnyFlowAttnProcessor``'s own code, its
    attention call routed.
    """

    def __call__(
        self,
        attn: AnyFlowAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: Any | None = None,
        rotary_emb: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise NotImplementedError("USPAnyFlowAttnProcessor is for self-attention (attn1) only; attn2 runs locally")
        if attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's AnyFlow adapter does not support an attention_mask in self-attention (blocks.*.attn1): "
                "the bidirectional model attends over every token"
            )
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


class RopeDictHooks(TableHooks):
    """Note [AnyFlow's per-token tables]: ``rope``'s ``{"query": f, "key": f}`` output, each
    (1, 1, seq, head_dim / 2), cut to this rank's rows on dim 2 (the plan's ``Table`` cuts tuple
    outputs; this is the same cut for a dict)."""

    def __init__(self, transformer: AnyFlowTransformer3DModel, state: ShardState) -> None:
        super().__init__(state, [(transformer.rope, Table("rope", dim=2))])

    def _cut_output(self, table: Table, module: torch.nn.Module, args: tuple, out: Any) -> Any:
        if not isinstance(out, dict):
            raise NotImplementedError(f"{table.module} returned {type(out).__name__}, not a dict of RoPE tables")
        return {name: self._cut(t, table) for name, t in out.items()}


def _routed_call_missing(transformer: AnyFlowTransformer3DModel) -> str | None:
    if _RoutedAnyFlowProcessor is None:
        return f"this diffusers' AnyFlowAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


def _temporal_patch(transformer: AnyFlowTransformer3DModel) -> str | None:
    p_t = transformer.config.patch_size[0]
    if p_t != 1:
        return f"patch_size[0]={p_t}: the forward unpacks its output with one token row per latent frame (p_t = 1)"
    return None


PLAN = ModelPlan(
    name="AnyFlow",
    model_class=AnyFlowTransformer3DModel,
    split_at="blocks.0",
    gather_at="proj_out",  # after the per-token final shift / scale, which the cut temb gives each rank
    attention=(
        Parallel("blocks.*.attn1", USPAnyFlowAttnProcessor, stock=(AnyFlowAttnProcessor,)),  # self-attention
        Local("blocks.*.attn2", stock=(AnyFlowCrossAttnProcessor,)),  # to the replicated text (and image)
    ),
    block_lists=("blocks",),
    # (temb (B, seq, C), timestep_proj (B, seq, 6C), text, image): Note [AnyFlow's per-token tables].
    tables=(Table("condition_embedder", dim=1, items=(0, 1)),),
    # AnyFlowPipeline batches [negative; positive] in one call when guidance_scale > 1.
    cfg_batch_args=("hidden_states", "timestep", "r_timestep", "encoder_hidden_states",
                    "encoder_hidden_states_image"),
    hooks=(RopeDictHooks,),
    refuse=(_routed_call_missing, _temporal_patch),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
