"""Ovis-Image adapter: ``OvisImageTransformer2DModel`` (Ovis-Image-7B; ``OvisImagePipeline``) on a USP grid.

Layout: image tokens (batch, N, 64) in the pipeline's packed order (2x2 latent patches of the
16-channel VAE latent, row-major); text tokens (batch, T, 2048), the Qwen3 prompt padded to
``max_sequence_length`` (at most 256), its padding rows zeroed by the pipeline but **all
attended** (the pipeline hands the transformer no mask); position ids (tokens, 3) (or
(1, tokens, 3), deprecated): text (0, i, i), image (0, h, w); Q/K/V (batch, seq, heads, head_dim);
the RoPE table ``(cos, sin)`` each (T + N, head_dim), built in the forward from
``pos_embed(cat(txt_ids, img_ids))``: row i rotates token i of ``[text; image]``.

Ovis-Image is Flux.1's block structure (6 double-stream + 27 single-stream blocks, 24 heads x
128, per-head QK RMS norms, ``[text; image]`` joint attention) with SwiGLU MLPs, an RMS norm on
the text embeddings and no pooled projection or guidance embedding. It is run exactly as Flux.1
(``usp_dit.pipelines.families.flux``):

Text tokens: **split** together with the image tokens at the forward's arguments
(``usp_dit.pipelines._joint_split`` Note [joint token split]): the single blocks run every
per-token op (norm, projections, MLP) on ``[text; image]``, so a text token costs what an image
token costs. At 1024 x 1024 with the default 256 text tokens (4096 + 256 = 4352):

    per rank     P=2    P=4    P=8
    replicated   2304   1280    768    (4096 / P image + all 256 text)
    split        2176   1088    544    (at P=8 rank 0: 256 text + 288 image)

Attention keeps Diffusers' maths: ``USPOvisImageAttnProcessor`` runs the stock
``OvisImageAttnProcessor``'s own code with its one ``dispatch_attention_fn`` call routed to
``usp_attention`` as plain self-attention over the sharded joint sequence (``_routing``).

CFG: ``OvisImagePipeline`` runs true CFG with **two** transformer calls a step (prompt, then
negative prompt); with ``cfg_degree=2`` they run on the two cfg groups at once
(``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair`` Note [two calls a step]).

Refused (NotImplementedError): an ``attention_mask`` (through ``joint_attention_kwargs``: the
pipeline passes none; a mask over the sharded joint sequence is not split here), processors other
than the stock ``OvisImageAttnProcessor`` (custom, LoRA-replaced, Diffusers' context parallelism
already enabled), attention modules the plan does not name, an unsupported Diffusers cache
(``usp_dit.pipelines.caches``), a model without blocks (at enable); a processor swapped after
enable (at the call). Tensor parallelism is refused (no ``TensorPlan``): the single blocks split
their fused [MLP, gate] projection by the model's whole ``mlp_hidden_dim``, which a tensor rank's
column shard does not have.
"""
from __future__ import annotations

from diffusers import OvisImageTransformer2DModel
from diffusers.models.transformers.transformer_ovis_image import OvisImageAttnProcessor

from usp_dit.pipelines._joint_split import JointSplitForward, JointSplitPlanAdapter, MaskRefusingJointProcessor
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedOvisProcessor = routed_processor_class(OvisImageAttnProcessor, "_RoutedOvisImageProcessor")


class USPOvisImageAttnProcessor(MaskRefusingJointProcessor, _RoutedOvisProcessor or RoutedProcessor):
    """Ovis-Image attention of this rank's piece of the joint sequence against the whole sequence
    (layouts: ``MaskRefusingJointProcessor``)."""

    mask_refusal = "usp_dit's Ovis-Image processor does not support attention_mask (OvisImagePipeline passes none)"


def _routed_call_missing(transformer: OvisImageTransformer2DModel) -> str | None:
    if _RoutedOvisProcessor is None:
        return f"this diffusers' OvisImageAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="OvisImage",
    model_class=OvisImageTransformer2DModel,
    split_at="",  # the forward's own arguments (JointSplitForward); the image rows gathered after it
    gather_at="proj_out",
    attention=(
        # [text; image] pieces of one sharded sequence: plain self-attention over the whole of it
        Parallel("transformer_blocks.*.attn", USPOvisImageAttnProcessor, stock=(OvisImageAttnProcessor,)),
        Parallel("single_transformer_blocks.*.attn", USPOvisImageAttnProcessor, stock=(OvisImageAttnProcessor,)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # Arguments that carry the batch dimension first (split over the "cfg" axis by enable_usp).
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep"),
    # OvisImagePipeline's true CFG calls the transformer once per branch; the branches differ in these.
    cfg_branch_args=("encoder_hidden_states", "txt_ids"),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(JointSplitPlanAdapter(PLAN, __name__, JointSplitForward))
