"""Bria adapter: ``BriaTransformer2DModel`` (Bria 3.x; ``BriaPipeline``) on a USP grid.

Layout: image tokens (batch, N, 64) in the pipeline's packed order (2x2 latent patches of the
16-channel VAE latent, row-major); text tokens (batch, T, 4096), the T5 prompt **zero-padded**
to ``max_sequence_length`` (128 by default) and all attended (the pipeline hands the transformer
no mask); position ids (tokens, 3) (or (batch, tokens, 3), row 0 read): text (0, 0, 0), image
(0, h, w); Q/K/V (batch, seq, heads, head_dim); the RoPE table ``(cos, sin)`` each
(T + N, head_dim), built in the forward from ``pos_embed(cat(txt_ids, img_ids))``: row i rotates
token i of ``[text; image]``.

Bria 3.x is Flux.1's architecture (19 double-stream + 38 single-stream blocks, 24 heads x 128,
per-head QK RMS norms, ``[text; image]`` joint attention, the single blocks' parallel attention +
MLP) with a T5 text encoder only: no pooled projection, no guidance embedding. So it is run
exactly as Flux.1 (``usp_dit.pipelines.families.flux``):

Text tokens: **split** together with the image tokens at the forward's arguments
(``usp_dit.pipelines._joint_split`` Note [joint token split]): the single blocks run every
per-token op on ``[text; image]``, so a text token costs what an image token costs. At
1024 x 1024 with the default 128 text tokens (4096 + 128 = 4224):

    per rank     P=2    P=4    P=8
    replicated   2176   1152    640    (4096 / P image + all 128 text)
    split        2112   1056    528    (at P=8 rank 0: 128 text + 400 image)

Attention keeps Diffusers' maths: ``USPBriaAttnProcessor`` runs the stock ``BriaAttnProcessor``'s
own code (QK norms, the double blocks' ``[text; image]`` concatenation, RoPE on this rank's rows,
output projections) with its one ``dispatch_attention_fn`` call routed to ``usp_attention`` as
plain self-attention over the sharded joint sequence (``_routing``).

CFG: ``BriaPipeline`` runs CFG as **one** call a step on the batch ``[uncond; cond]`` (its
negative prompt, or zeros, stacked before the prompt); ``cfg_degree=2`` splits that batch over the
cfg groups (``cfg_batch_args``). Its ``normalize`` option reads the whole gathered prediction,
which every rank holds after the gather.

ControlNet: the double blocks' residuals (added to the image stream, (B, N, C) each) are cut like
the image tokens. The single blocks' residuals are **refused**: the stock forward adds them to
``hidden_states[:, T:]`` of the image stream, an offset by the text length that a rank's piece
(whose local T differs) cannot reproduce; no Diffusers pipeline passes them to this model.

Tensor parallelism: Flux.1's cuts (the module paths are the same; the QK norms are per head):
heads of each attention, each MLP's width, the single blocks' ``proj_out`` over
``cat([attention, MLP])``.

Refused (NotImplementedError): an ``attention_mask`` (through ``attention_kwargs``: the pipeline
passes none; a mask over the sharded joint sequence is not split here), single-block ControlNet
residuals (above), processors other than the stock ``BriaAttnProcessor`` (custom, LoRA-replaced,
Diffusers' context parallelism already enabled), attention modules the plan does not name, an
unsupported Diffusers cache (``usp_dit.pipelines.caches``), a model without blocks (at enable); a
processor swapped after enable (at the call).
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import BriaTransformer2DModel
from diffusers.models.transformers.transformer_bria import BriaAttention, BriaAttnProcessor

import usp_dit.pipelines.families.flux as flux  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._joint_split import FluxSplit, JointSplitForward, JointSplitPlanAdapter, rows
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedBriaProcessor = routed_processor_class(BriaAttnProcessor, "_RoutedBriaProcessor")


class USPBriaAttnProcessor(_RoutedBriaProcessor or RoutedProcessor):
    """Bria attention of this rank's piece of the joint sequence against the whole sequence.

    Double blocks: ``hidden_states`` (B, N_local, C) image part, ``encoder_hidden_states``
    (B, T_local, C) text part (may be empty); returns ``(image_out, text_out)`` of the same shapes.
    Single blocks: ``hidden_states`` (B, T_local + N_local, C); returns (B, T_local + N_local, C).
    ``image_rotary_emb``: ``(cos, sin)`` (T_local + N_local, D), this rank's rows (built from its ids).
    """

    def __call__(
        self,
        attn: BriaAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        if attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's Bria processor does not support attention_mask (BriaPipeline passes none)")
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class BriaSplitForward(JointSplitForward):
    """``JointSplitForward`` for Bria: the double blocks' ControlNet residuals cut like the image,
    the single blocks' refused (their offset is the text length, which differs per rank)."""

    def check(self, call: dict[str, Any]) -> None:
        if call.get("controlnet_single_block_samples") is not None:
            raise NotImplementedError(
                "usp_dit's Bria adapter does not support controlnet_single_block_samples: the stock forward adds "
                "them at hidden_states[:, T:] of the image stream, an offset by the text length that a rank's piece "
                "of the split [text; image] sequence cannot reproduce")

    def split_more(self, call: dict[str, Any], split: FluxSplit, num_text: int) -> None:
        if call.get("controlnet_block_samples") is not None:  # added to the image stream: (B, N, C) each
            lo, hi = split.image
            call["controlnet_block_samples"] = [rows(t, lo, hi, 1) for t in call["controlnet_block_samples"]]


def _routed_call_missing(transformer: BriaTransformer2DModel) -> str | None:
    if _RoutedBriaProcessor is None:
        return f"this diffusers' BriaAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="Bria",
    model_class=BriaTransformer2DModel,
    split_at="",  # the forward's own arguments (BriaSplitForward); the image rows gathered after it
    gather_at="proj_out",
    attention=(
        # [text; image] pieces of one sharded sequence: plain self-attention over the whole of it
        Parallel("transformer_blocks.*.attn", USPBriaAttnProcessor, stock=(BriaAttnProcessor,)),
        Parallel("single_transformer_blocks.*.attn", USPBriaAttnProcessor, stock=(BriaAttnProcessor,)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # Arguments that carry the batch dimension first (split over the "cfg" axis by enable_usp):
    # BriaPipeline's one call a step on [uncond; cond].
    cfg_batch_args=(
        "hidden_states", "encoder_hidden_states", "timestep", "guidance", "controlnet_block_samples",
    ),
    refuse=(_routed_call_missing,),
    tensor=flux.PLAN.tensor,  # Flux.1's module paths and cuts, exactly
)

ADAPTER = register_adapter(JointSplitPlanAdapter(PLAN, __name__, BriaSplitForward))
