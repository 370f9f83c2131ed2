"""ChronoEdit adapter: ``ChronoEditTransformer3DModel`` (ChronoEdit-14B: image editing as a short video,
with or without temporal reasoning) on a USP grid.

Layout: latents (batch, channels, frames, height, width), channels = noise + mask + image latents;
video tokens (batch, seq, channels), frame-major (``patch_embedding(x).flatten(2)``); text
(batch, 512, channels) and CLIP image tokens (batch, 257, channels), both replicated; Q/K/V
(batch, seq, heads, head_dim); the RoPE table ``(cos, sin)``, each (1, seq, 1, head_dim); the
timestep (batch,) (or one per token, (batch, seq), which the model accepts as Wan's does).

The transformer is Wan 2.1 I2V's (``usp_dit.pipelines.families.wan``, whose plan this one follows and
whose per-token timestep hook it reuses): tokens split at block 0's input and gathered at
``proj_out``'s output; ``attn1`` self-attention over the video tokens routed to ``usp_attention``;
``attn2`` cross-attention to the replicated text and image tokens, local. Diffusers' own ``_cp_plan``
splits the same places (block 0's input, ``rope``'s output on dim 1, ``proj_out``'s output).
What differs from Wan:

  * the RoPE table: with two latent frames (the edit mode: the input image's frame and the edited
    one) the temporal positions are 0 and ``rope_temporal_skip_len - 1`` instead of 0 and 1. The
    table is still ``rope``'s output, one row per token, cut on dim 1 like the tokens (the plan's
    ``Table``): whatever positions it holds, each rank rotates its own tokens' rows.
  * the attention processor is ChronoEdit's own copy of ``WanAttnProcessor``
    (``transformer_chronoedit.WanAttnProcessor``, another class): its code is routed, not Wan's,
    so a Diffusers change to one cannot silently run in the other.

Temporal reasoning (``enable_temporal_reasoning``) runs the first steps on more latent frames and
then drops to the first and last: each call's token count comes from its own latent (the RoPE
table and block 0's input), so a change between calls needs nothing.

Per-rank token count, ChronoEdit-14B at 720 x 1280, edit mode (2 latent frames x 45 x 80 = 7200
tokens; 512 text and 257 image tokens in cross-attention): 900 video tokens per rank on 8 ranks.

Refused (NotImplementedError): processors other than the stock ChronoEdit ``WanAttnProcessor``
(LoRA-replaced, custom, Diffusers' context parallelism), a Diffusers cache that cannot run on a
grid (``usp_dit.pipelines.caches``), an ``attention_mask`` on ``attn1`` (at the call; the stock
model passes none), ``num_layers=0``.
"""
from __future__ import annotations

import torch
from diffusers import ChronoEditTransformer3DModel
from diffusers.models.transformers import transformer_chronoedit

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.families.wan import WanTimestepHook
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table

# ChronoEdit's copy of Wan's processor (a class of its own, in its own module).
ChronoEditAttnProcessor = transformer_chronoedit.WanAttnProcessor
_RoutedChronoEditProcessor = routed_processor_class(ChronoEditAttnProcessor, "_RoutedChronoEditProcessor")


class USPChronoEditAttnProcessor(_RoutedChronoEditProcessor or RoutedProcessor):
    """ChronoEdit self-attention (``attn1``) of this rank's video shard against the whole sequence.

    Inputs: ``hidden_states`` (B, S_local, C); ``rotary_emb`` this rank's rows of the RoPE table,
    each (1, S_local, 1, head_dim). Returns (B, S_local, C): the stock processor's code, its
    attention call routed to ``usp_attention``.
    """

    def __call__(
        self,
        attn: transformer_chronoedit.WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attn.add_k_proj is not None:
            raise NotImplementedError("USPChronoEditAttnProcessor is for self-attention (attn1) only; attn2 runs locally")
        if attention_mask is not None:
            raise NotImplementedError("usp_dit's ChronoEdit adapter does not support an attention_mask in self-attention")
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


def _routed_call_missing(transformer: ChronoEditTransformer3DModel) -> str | None:
    if _RoutedChronoEditProcessor is None:
        return f"this diffusers' ChronoEdit WanAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="ChronoEdit",
    model_class=ChronoEditTransformer3DModel,
    split_at="blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("blocks.*.attn1", USPChronoEditAttnProcessor, stock=(ChronoEditAttnProcessor,)),  # self-attention
        Local("blocks.*.attn2", stock=(ChronoEditAttnProcessor,)),  # cross-attention to the replicated text and image
    ),
    block_lists=("blocks",),
    tables=(Table("rope", dim=1, items=(0, 1)),),  # (cos, sin), each (1, seq, 1, head_dim)
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
    # ChronoEditPipeline calls the transformer once per guidance branch, differing in the text embeds.
    cfg_branch_args=("encoder_hidden_states",),
    hooks=(WanTimestepHook,),  # a (B, seq) timestep, as Wan's TI2V: the model's forward is Wan's there
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
