"""Flux adapter: ``FluxTransformer2DModel`` (Flux.1 dev and schnell, ``FluxPipeline``) on a USP grid.

Layout: image tokens (batch, N, channels) in the pipeline's packed order, text tokens (batch, T,
channels); position ids (tokens, 3) (or (1, tokens, 3), deprecated); Q/K/V (batch, seq, heads,
head_dim); the RoPE table ``(cos, sin)``, each (tokens, head_dim), row i rotating token i.

Text tokens: **split** together with the image tokens, at the forward's arguments
(``usp_dit.pipelines._joint_split`` Note [joint token split]). Flux attends over ``[text, image]``
in every block and its 38 single-stream blocks run all per-token work (norms, projections, MLP) on
that concatenation, so a text token costs exactly what an image token costs. With 512 text tokens
beside 4096 image tokens, replicating text would leave every rank 512 tokens of unshrunk work: on 8
ranks 1024 tokens per rank instead of 576 (1.8x). Split, every rank holds one contiguous piece of
the joint sequence, the load is even to one token, and the attention sees one plain sharded
sequence (no joint tokens, no padding mask: Flux has none).
    1008x1008 (3969 + 512 = 4481): P=4 1121, 1120, 1120, 1120 tokens (rank 0: 512 text + 609 image).

Attention keeps Diffusers' maths: ``USPFluxAttnProcessor`` runs the stock ``FluxAttnProcessor``'s
own code (QK RMS norms, the double blocks' ``[text; image]`` concatenation, RoPE on this rank's
rows, output projections) with its one ``dispatch_attention_fn`` call routed to ``usp_attention``
as plain self-attention over the sharded joint sequence (``_routing``).

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]) whose tokens
are split at the forward's arguments (``JointSplitPlanAdapter`` with ``FluxSplitForward``): the
double and single blocks' attention parallel; ControlNet residuals (added to the image stream) cut
like the image tokens.

Unsupported (NotImplementedError): IP-Adapter (``ip_adapter_image_embeds``; its processor is not
the stock one either), an ``attention_mask``, processors other than diffusers' ``FluxAttnProcessor``
(e.g. IP-Adapter or custom ones), a processor replaced after enable, a Diffusers cache that cannot
run on a grid (FasterCache: ``usp_dit.pipelines.caches``).
"""
from __future__ import annotations

from typing import Any

from diffusers import FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from usp_dit.pipelines._joint_split import (
    FluxSplit,
    JointSplitForward,
    JointSplitPlanAdapter,
    MaskRefusingJointProcessor,
    rows,
)
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel
from usp_dit.pipelines.tensor import BlockCuts, Concat, Split, TensorPlan

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedFluxProcessor = routed_processor_class(FluxAttnProcessor, "_RoutedFluxProcessor")


class USPFluxAttnProcessor(MaskRefusingJointProcessor, _RoutedFluxProcessor or RoutedProcessor):
    """Flux attention of this rank's piece of the joint sequence against the whole sequence
    (layouts: ``MaskRefusingJointProcessor``)."""

    mask_refusal = "usp_dit's Flux processor does not support attention_mask (Flux pipelines pass none)"


class FluxSplitForward(JointSplitForward):
    """``JointSplitForward`` for Flux.1: IP-Adapter refused, ControlNet residuals cut like the image."""

    def check(self, call: dict[str, Any]) -> None:
        if "ip_adapter_image_embeds" in (call.get("joint_attention_kwargs") or {}):
            raise NotImplementedError("usp_dit's Flux adapter does not support IP-Adapter (ip_adapter_image_embeds)")

    def split_more(self, call: dict[str, Any], split: FluxSplit, num_text: int) -> None:
        lo, hi = split.image
        for name in ("controlnet_block_samples", "controlnet_single_block_samples"):
            if call.get(name) is not None:  # residuals added to the image stream: (B, N, C) each
                call[name] = [rows(t, lo, hi, 1) for t in call[name]]


def _routed_call_missing(transformer: FluxTransformer2DModel) -> str | None:
    if _RoutedFluxProcessor is None:
        return f"this diffusers' FluxAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


# Tensor parallelism (usp_dit.pipelines.tensor Note [tensor plans]), where Diffusers' own Flux
# ``_tp_plan`` cuts: the heads of each attention (Q/K/V, the text stream's added projections, both
# output projections) and each MLP's hidden width. Flux's QK norms are per head (RMSNorm over
# head_dim), so a rank's heads normalise alone, exactly; the AdaLN modulation stays whole. In a
# single block, ``proj_out`` reads cat([attention, MLP]): a Concat of the two splits.
_DOUBLE = BlockCuts("transformer_blocks", splits=(
    Split(columns=("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
          rows=("attn.to_out.0", "attn.to_add_out"), heads="attn"),
    Split(columns=("ff.net.0.proj",), rows=("ff.net.2",)),
    Split(columns=("ff_context.net.0.proj",), rows=("ff_context.net.2",)),
))
_SINGLE = BlockCuts("single_transformer_blocks", splits=(
    Split(columns=("attn.to_q", "attn.to_k", "attn.to_v"), heads="attn"),
    Split(columns=("proj_mlp",)),
), concats=(Concat("proj_out", (0, 1)),))

PLAN = ModelPlan(
    name="Flux",
    model_class=FluxTransformer2DModel,
    split_at="",  # the forward's own arguments (FluxSplitForward); the image rows gathered after it
    gather_at="proj_out",
    attention=(
        # [text; image] pieces of one sharded sequence: plain self-attention over the whole of it
        Parallel("transformer_blocks.*.attn", USPFluxAttnProcessor, stock=(FluxAttnProcessor,)),
        Parallel("single_transformer_blocks.*.attn", USPFluxAttnProcessor, stock=(FluxAttnProcessor,)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # Arguments that carry the batch dimension first (split over the "cfg" axis by enable_usp).
    cfg_batch_args=(
        "hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance",
        "controlnet_block_samples", "controlnet_single_block_samples",
    ),
    # FluxPipeline's true CFG (true_cfg_scale > 1, a negative prompt) calls the transformer once
    # per branch; the branches differ in these (usp_dit.pipelines.cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "pooled_projections", "txt_ids"),
    refuse=(_routed_call_missing,),
    tensor=TensorPlan((_DOUBLE, _SINGLE)),
)

ADAPTER = register_adapter(JointSplitPlanAdapter(PLAN, __name__, FluxSplitForward))
