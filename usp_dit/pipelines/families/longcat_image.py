"""LongCat-Image adapter: ``LongCatImageTransformer2DModel`` (LongCat-Image, LongCat-Image-Edit;
``LongCatImagePipeline``, ``LongCatImageEditPipeline``) on a USP grid.

Layout: image tokens (batch, N, 64) in the pipeline's packed order (2x2 latent patches of the
16-channel VAE latent, row-major); for the edit pipeline N = N_target + N_condition, the
condition image's packed latent concatenated after the target's (same size); text tokens
(batch, T, 3584), the Qwen2.5-VL prompt always padded to 512 tokens and **all attended** (the
pipeline hands the transformer no mask); position ids (tokens, 3) = (modality, row, col): text
(0, i, i), target image (1, 512 + h, 512 + w), condition image (2, 512 + h, 512 + w); Q/K/V
(batch, seq, heads, head_dim); the RoPE table ``(cos, sin)`` each (T + N, head_dim), built in the
forward from ``pos_embed(cat(txt_ids, img_ids))``: row i rotates token i of ``[text; image]``.

LongCat-Image is Flux.1's architecture (19 double-stream + 38 single-stream blocks, 24 heads x
128, the same attention maths: per-head QK RMS norms, ``[text; image]`` joint attention, the
single blocks' parallel attention + MLP) with a Qwen2.5-VL text encoder, no pooled projection and
no guidance embedding. So it is run exactly as Flux.1 (``usp_dit.pipelines.families.flux``):

Text tokens: **split** together with the image tokens at the forward's arguments
(``usp_dit.pipelines._joint_split`` Note [joint token split]). The 38 single blocks do all their
per-token work on ``[text; image]``, so a text token costs what an image token costs; with 512
text tokens beside 4096 image tokens (1024 x 1024) replicating the text would leave every rank
512 tokens of unshrunk work. Per rank (T + N = 4608; the edit pipeline's 4096 + 4096 + 512 = 8704):

    per rank          P=2    P=4    P=8
    t2i  replicated   2560   1536   1024
    t2i  split        2304   1152    576    (at P=8 rank 0: 512 text + 64 image)
    edit split        4352   2176   1088

Condition image tokens (the edit pipeline): **split** too. To the transformer they are more
image tokens (``hidden_states`` rows after the target's, with their own ids); they go through
every block like the target's, so they are cut with them as one sequence, and the gather brings
back all N rows, of which the pipeline keeps the target's ``[:, :N_target]``.

Attention keeps Diffusers' maths: ``USPLongCatImageAttnProcessor`` runs the stock
``LongCatImageAttnProcessor``'s own code with its one ``dispatch_attention_fn`` call routed to
``usp_attention`` as plain self-attention over the sharded joint sequence (``_routing``).

CFG: both pipelines run true CFG with **two** transformer calls a step (prompt, then negative
prompt, each with its own ``encoder_hidden_states`` / ``txt_ids``); with ``cfg_degree=2`` they run
on the two cfg groups at once (``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair`` Note [two
calls a step]); the pipeline's CFG renorm is computed after the pair, on every rank. Tensor
parallelism: Flux.1's cuts (the module paths are the same): heads of each attention, each MLP's
width, the single blocks' ``proj_out`` over ``cat([attention, MLP])``.

Refused (NotImplementedError): processors other than the stock ``LongCatImageAttnProcessor``
(custom, LoRA-replaced, Diffusers' context parallelism already enabled), attention modules the
plan does not name, an unsupported Diffusers cache (``usp_dit.pipelines.caches``), a model without
blocks (at enable); a processor swapped after enable (at the call).
"""
from __future__ import annotations

from diffusers import LongCatImageTransformer2DModel
from diffusers.models.transformers.transformer_longcat_image import LongCatImageAttnProcessor

import usp_dit.pipelines.families.flux as flux  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._joint_split import JointSplitForward, JointSplitPlanAdapter
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedLongCatProcessor = routed_processor_class(LongCatImageAttnProcessor, "_RoutedLongCatImageProcessor")


class USPLongCatImageAttnProcessor(_RoutedLongCatProcessor or RoutedProcessor):
    """LongCat-Image attention of this rank's piece of the joint sequence against the whole sequence.

    Double blocks: ``hidden_states`` (B, N_local, C) image part, ``encoder_hidden_states``
    (B, T_local, C) text part (may be empty); returns ``(image_out, text_out)`` of the same shapes.
    Single blocks: ``hidden_states`` (B, T_local + N_local, C); returns (B, T_local + N_local, C).
    ``image_rotary_emb``: ``(cos, sin)`` (T_local + N_local, D), this rank's rows (built from its ids).
    """


def _routed_call_missing(transformer: LongCatImageTransformer2DModel) -> str | None:
    if _RoutedLongCatProcessor is None:
        return f"this diffusers' LongCatImageAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="LongCatImage",
    model_class=LongCatImageTransformer2DModel,
    split_at="",  # the forward's own arguments (JointSplitForward); the image rows gathered after it
    gather_at="proj_out",
    attention=(
        # [text; image] pieces of one sharded sequence: plain self-attention over the whole of it
        Parallel("transformer_blocks.*.attn", USPLongCatImageAttnProcessor, stock=(LongCatImageAttnProcessor,)),
        Parallel("single_transformer_blocks.*.attn", USPLongCatImageAttnProcessor,
                 stock=(LongCatImageAttnProcessor,)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # Arguments that carry the batch dimension first (split over the "cfg" axis by enable_usp).
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "guidance"),
    # Both pipelines' true CFG calls the transformer once per branch; the branches differ in these.
    cfg_branch_args=("encoder_hidden_states", "txt_ids"),
    refuse=(_routed_call_missing,),
    tensor=flux.PLAN.tensor,  # Flux.1's module paths and cuts, exactly
)

ADAPTER = register_adapter(JointSplitPlanAdapter(PLAN, __name__, JointSplitForward))
