"""DiT adapter: the class-conditional ``DiTTransformer2DModel`` (``DiTPipeline``) on a USP grid.

Layout: latents (batch, channels, size, size), square (stock folds its output with size =
sqrt(tokens)); image tokens (batch, seq, channels), ``seq = (size / p) ** 2`` row-major as
``PatchEmbed`` flattens them, its sin-cos position table added per token there, before the split;
``timestep`` (batch,) and ``class_labels`` (batch,) (1000: the null class of ImageNet's 1000);
inside ``AttnProcessor2_0`` Q/K/V are (batch, heads, seq, head_dim). No text, no mask, no RoPE.

DiT's blocks are Diffusers' ``BasicTransformerBlock`` with ``norm_type="ada_norm_zero"``: the
modulation (``AdaLayerNormZero``: timestep + class embedding) is one (batch, 6 x C) vector per
element, the same for every token, so it is computed whole on each rank. Per block ``attn1`` is
self-attention over the image tokens: sequence-parallel, with PixArt's processor
(``usp_dit.pipelines.families.pixart``: the stock ``AttnProcessor2_0`` code with its
``F.scaled_dot_product_attention`` routed to ``usp_attention``); there is no ``attn2``; the norms
and ``ff`` are per token.

The tokens are split at ``transformer_blocks.0``'s input and gathered at ``proj_out_2``'s output
(``_token_sharding`` Note [where the sequence is split]); ``norm_out`` and the final modulation
between them are per token. DiT-XL/2 at 512 x 512: 64 x 64 latents, 32 x 32 = 1024 tokens (128 a
rank on 8); at 256 x 256: 256 tokens.

``DiTPipeline`` batches CFG on the class label, ``[cond, null]`` in one call (the latents twice):
``cfg_degree=2`` splits it (``cfg_batch_args``).

Refused (NotImplementedError): at enable, an ``attn1`` processor other than the stock
``AttnProcessor2_0`` (``AttnProcessor``'s baddbmm, fused QKV, LoRA-replaced or custom ones), a
block that is not a stock ``BasicTransformerBlock`` with ``ada_norm_zero``, self-attention only and
no per-block position embedding, an unsupported Diffusers cache, ``num_layers=0``; at the call, a
model in training mode whose class embedding drops labels (``class_dropout_prob`` > 0: each rank
would draw its own drops, so the tokens of one image would see different conditionings; stock
draws them again in every block). Dropout inside the blocks (``dropout`` > 0, training) draws each
rank's mask over its own tokens, as it does on one process over all of them. Tensor parallelism
(``tensor_degree`` > 1) cuts attn1's heads and the feed-forward's width (``_TENSOR``).
"""
from __future__ import annotations

import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers.models.embeddings import LabelEmbedding

import usp_dit.pipelines.families.pixart as pixart  # noqa: PLR0402  (its routed AttnProcessor2_0)
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, TransformerPreHook
from usp_dit.pipelines.tensor import BlockCuts, Split, TensorPlan


def _blocks_reason(model: DiTTransformer2DModel) -> str | None:
    """A reason to refuse a block whose token maths the plan was not written for, or None."""
    for i, block in enumerate(model.transformer_blocks):
        if type(block) is not BasicTransformerBlock:
            return f"transformer_blocks.{i} is {type(block).__name__}, not BasicTransformerBlock"
        if block.norm_type != "ada_norm_zero" or block.pos_embed is not None or block.attn2 is not None:
            return (f"transformer_blocks.{i} has norm_type={block.norm_type!r}, pos_embed="
                    f"{type(block.pos_embed).__name__}, attn2={type(block.attn2).__name__}; the plan runs DiT's "
                    f"(ada_norm_zero, no per-block position embedding, self-attention only)")
    return None


class LabelDropCheck(TransformerPreHook):
    """A forward pre-hook of the transformer (a plan ``hooks`` factory): NotImplementedError for a
    call in training mode where a class embedding drops labels at random (see the module docstring)."""

    def _check(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        for name, sub in module.named_modules():
            if isinstance(sub, LabelEmbedding) and sub.dropout_prob > 0:
                raise NotImplementedError(
                    f"usp_dit's DiT adapter: {name} drops class labels at random in training mode (dropout_prob="
                    f"{sub.dropout_prob}): each rank would draw its own drops for the same image; set it to 0 "
                    f"(drop labels in the data instead) or call eval()"
                )


# Tensor parallelism (usp_dit.pipelines.tensor Note [tensor plans]): attn1's heads (to_q, to_k, to_v
# column-parallel with their biases, to_out.0 row-parallel) and the feed-forward's hidden width
# (GELU(proj) column-parallel, net.2 row-parallel). DiT's attention has no QK norm, and
# AttnProcessor2_0 reads the head count from ``attn.heads``: exact on a rank's heads; the adaLN-zero
# modulation and the LayerNorms stay whole.
_TENSOR = TensorPlan((BlockCuts("transformer_blocks", splits=(
    Split(columns=("attn1.to_q", "attn1.to_k", "attn1.to_v"), rows=("attn1.to_out.0",), heads="attn1"),
    Split(columns=("ff.net.0.proj",), rows=("ff.net.2",)),
)),))

PLAN = ModelPlan(
    name="DiT",
    model_class=DiTTransformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out_2",  # per token (norm_out and the modulation before it too)
    attention=(Parallel("transformer_blocks.*.attn1", pixart.USPPixArtSelfAttnProcessor, stock=(AttnProcessor2_0,)),),
    block_lists=("transformer_blocks",),
    # DiTPipeline batches [cond, null class] in one call, the latents twice.
    cfg_batch_args=("hidden_states", "timestep", "class_labels"),
    hooks=(LabelDropCheck,),
    refuse=(_blocks_reason, pixart._routed_call_missing),
    tensor=_TENSOR,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
