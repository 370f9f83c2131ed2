"""Bria adapters: ``BriaTransformer2DModel`` (Bria 3.x; ``BriaPipeline``) and
``BriaFiboTransformer2DModel`` (FIBO, below) on a USP grid: two plans, one Flux-like joint split.

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

---- FIBO: ``BriaFiboTransformer2DModel`` (FIBO; ``BriaFiboPipeline``), the second plan of this module.

FIBO's layout: image tokens (batch, N, 64) in the pipeline's packed order; text tokens (batch, T,
joint_attention_dim), the SmolLM3 prompt's last two hidden states, padded to the longest prompt
of the call (prompt and negative prompt alike); ``text_encoder_layers`` a list of
num_layers + num_single_layers (batch, T, text_encoder_dim) tensors, one SmolLM3 hidden state per
block, padded likewise; position ids (tokens, 3): text zeros, image (0, h, w); the key-padding
mask ``joint_attention_kwargs["attention_mask"]`` (batch, 1, 1, T + N) bool over ``[text; image]``
(True = a key), given only when some prompt is padded; Q/K/V (batch, seq, heads, head_dim); the
RoPE table ``(cos, sin)`` each (T + N, head_dim), row i rotating token i of ``[text; image]``.

FIBO is Flux.1's block structure (``[text; image]`` joint attention, per-head QK RMS norms,
double- then single-stream blocks) where each block first replaces half of the text stream's
channels with its own projected SmolLM3 layer (``caption_projection[i]``, per text token). It is run
as Bria 3.x above:

Text tokens: **split** together with the image tokens at the forward's arguments
(``usp_dit.pipelines._joint_split`` Note [joint token split]); ``text_encoder_layers`` are per
text token, so each is cut to this rank's text rows, like ``encoder_hidden_states``, and the mask
to this rank's columns of ``[text; image]``.

Note [FIBO's key mask]
    Stock hands ``dispatch_attention_fn`` the bool (B, 1, 1, S) mask: every query (padded text
    ones too) attends to the unmasked keys only. A rank holds its own tokens' flags m_j (the mask's
    columns of its piece); they must travel with their keys through the all-to-alls and the ring.
    As one more coordinate of q and k (``usp_dit.pipelines.families.chroma`` Note [Chroma's mask]
    does the same for an additive mask):

        q'_i = [q_i, 1, 0 ...]    k'_j = [k_j, 0 if m_j else -MASKED / scale, 0 ...]    v'_j = [v_j, 0 ...]
        scale * q'_i . k'_j = scale * q_i . k_j            (m_j: the score unchanged)
                            = scale * q_i . k_j - MASKED    (a padded key)

    With MASKED = 1e4, exp(score - max) of a padded key is 0 in float32 (what kernels compute
    softmax in, for bfloat16 inputs too; every
    row has an unmasked key: the image tokens), so its probability is exactly stock's 0, forward and
    backward (its dS is P * (...) = 0); a ring block of padded keys only adds a log-sum-exp
    weight of exactly 0. The extra coordinates (8: head_dim stays a multiple of 8 for kernels)
    are dropped from the output.

Attention keeps Diffusers' maths: the double blocks' ``BriaFiboAttnProcessor`` and the single
blocks' ``BriaAttnProcessor`` (on a ``diffusers.models.attention_processor.Attention``) run their
own code with their one ``dispatch_attention_fn`` call routed to ``fibo_attention`` (``_routing``).

CFG: ``BriaFiboPipeline`` runs CFG as one call a step on ``[uncond; cond]``; ``cfg_degree=2``
splits that batch, ``text_encoder_layers`` and the mask in ``joint_attention_kwargs`` included
(the tiny pipeline, SmolLM3 and a Wan VAE, through ``pipe.enable_usp()`` in tests/test_pipeline_bria.py).

Refused (NotImplementedError): a mask other than a (B | 1, 1, 1, T + N) bool key mask (a mask
varying over queries or heads, an additive float one), a padded image key, processors other than
the stock ones (custom, LoRA-replaced, Diffusers' context parallelism already enabled), attention
modules the plan does not name, an unsupported Diffusers cache (``usp_dit.pipelines.caches``), a
model without blocks (at enable); a processor swapped after enable (at the call). Tensor
parallelism is refused (no ``TensorPlan``): the per-block caption projections write half of the
text stream's channels, which a tensor rank's column shard would not hold whole.
"""
from __future__ import annotations

import types
from typing import Any

import torch
from diffusers import BriaFiboTransformer2DModel, BriaTransformer2DModel
from diffusers.models.transformers.transformer_bria import BriaAttnProcessor
from diffusers.models.transformers.transformer_bria_fibo import BriaFiboAttention, BriaFiboAttnProcessor

import usp_dit.pipelines.families.flux as flux  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.attention.usp import usp_attention
from usp_dit.pipelines._checks import require
from usp_dit.pipelines._joint_split import (
    FluxSplit,
    JointSplitForward,
    JointSplitPlanAdapter,
    MaskRefusingJointProcessor,
    rows,
)
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, routed_processor_class, with_global
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel
from usp_dit.sharding.partition import offsets, split_sizes

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedBriaProcessor = routed_processor_class(BriaAttnProcessor, "_RoutedBriaProcessor")


class USPBriaAttnProcessor(MaskRefusingJointProcessor, _RoutedBriaProcessor or RoutedProcessor):
    """Bria attention of this rank's piece of the joint sequence against the whole sequence
    (layouts: ``MaskRefusingJointProcessor``)."""

    mask_refusal = "usp_dit's Bria processor does not support attention_mask (BriaPipeline passes none)"


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


# ---- FIBO (the module Note's second part) ---------------------------------------------------------

_EXTRA_DIM = 8  # Note [FIBO's key mask]: one flag coordinate, padded to keep head_dim a multiple of 8
MASKED = 1e4  # Note [FIBO's key mask]: a padded key's score offset; exp(-1e4) is 0 in float32


def fibo_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None,
    *,
    backend: Any = None,
    parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn``'s signature: this rank's piece of ``[text; image]`` attended over
    the whole sequence, padded keys removed as stock's bool key mask removes them (Note [FIBO's key mask]).

    Args:
        query, key, value: (B, L, H, D), L = this rank's piece (``split_sizes(T + N, P)[rank]``).
        attn_mask: ``None`` or this rank's columns of the bool key mask, (B | 1, 1, 1, L).
        parallel_config: the processor's ``Route``.

    Returns:
        (B, L, H, D).
    """
    route = parallel_config
    if not isinstance(route, Route):
        raise TypeError(f"usp_dit's FIBO processor got parallel_config={type(route).__name__}, not its Route")
    if dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(
            f"usp_dit routes plain attention only, got dropout_p={dropout_p}, is_causal={is_causal}, "
            f"attention_kwargs={attention_kwargs}"
        )
    if query.shape[1] != route.shard_len():
        raise ValueError(
            f"a routed FIBO attention call got {query.shape[1]} tokens, but this rank's piece has {route.shard_len()}")
    state = route.state
    head_dim = query.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    if attn_mask is not None:
        keys = attn_mask[:, 0, 0].expand(query.shape[0], -1)  # (B, L): True = a key
        offset = torch.where(keys, 0.0, -MASKED / scale).to(query.dtype)[:, :, None, None]  # (B, L, 1, 1)

        def extend(x: torch.Tensor, first: torch.Tensor | float | None) -> torch.Tensor:
            extra = x.new_zeros(*x.shape[:-1], _EXTRA_DIM)
            if first is not None:
                extra[..., :1] = first
            return torch.cat([x, extra], dim=-1)

        query, key, value = extend(query, 1.0), extend(key, offset.expand(*key.shape[:-1], 1)), extend(value, None)
    out = usp_attention(
        query, key, value, scale=scale, mesh=state.mesh, backend=state.backend, seq_len=state.seq_len).out
    return out[..., :head_dim]


# The stock processors' own code, their dispatch_attention_fn call bound to fibo_attention
# (Note [routing a stock processor's attention call] in usp_dit.pipelines._routing).
_DOUBLE_CALL: types.FunctionType | None = with_global(BriaFiboAttnProcessor.__call__, ROUTED_NAME, fibo_attention)
_SINGLE_CALL: types.FunctionType | None = with_global(BriaAttnProcessor.__call__, ROUTED_NAME, fibo_attention)


class USPBriaFiboAttnProcessor(RoutedProcessor):
    """FIBO double-stream attention of this rank's piece of ``[text; image]``: ``hidden_states``
    (B, N_local, C), ``encoder_hidden_states`` (B, T_local, C) (may be empty); returns
    ``(image_out, text_out)`` of those shapes. ``attention_mask``: this rank's columns of the key
    mask, (B | 1, 1, 1, T_local + N_local), or ``None``."""

    _stock_call = _DOUBLE_CALL

    def __call__(
        self,
        attn: BriaFiboAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        return type(self)._stock_call(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class USPBriaFiboSingleAttnProcessor(USPBriaFiboAttnProcessor):
    """FIBO single-stream attention (``BriaAttnProcessor``'s code): ``hidden_states``
    (B, T_local + N_local, C) in, the same shape out."""

    _stock_call = _SINGLE_CALL


class BriaFiboSplitForward(JointSplitForward):
    """``JointSplitForward`` for FIBO: ``text_encoder_layers`` cut to this rank's text rows, the key
    mask in ``joint_attention_kwargs`` to its columns (Note [FIBO's key mask])."""

    def check(self, call: dict[str, Any]) -> None:
        mask = (call.get("joint_attention_kwargs") or {}).get("attention_mask")
        if mask is None:
            return
        batch, num_image = call["hidden_states"].shape[:2]
        joint = call["encoder_hidden_states"].shape[1] + num_image
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1) or mask.shape[3] != joint \
                or mask.shape[0] not in (1, batch):
            raise NotImplementedError(
                f"usp_dit's FIBO adapter runs a bool key mask (batch, 1, 1, text + image tokens) = ({batch}, 1, 1, "
                f"{joint}) only, as BriaFiboPipeline passes it; got {mask.dtype} {tuple(mask.shape)}")
        require(mask[..., joint - num_image:].all(),
                "usp_dit's FIBO adapter does not run a mask over image tokens (BriaFiboPipeline masks text padding only)")

    def split_more(self, call: dict[str, Any], split: FluxSplit, num_text: int) -> None:
        tlo, thi = split.text
        if call.get("text_encoder_layers") is not None:  # per text token: (B, T, text_encoder_dim) each
            call["text_encoder_layers"] = [rows(t, tlo, thi, 1) for t in call["text_encoder_layers"]]
        kwargs = call.get("joint_attention_kwargs")
        if kwargs and kwargs.get("attention_mask") is not None:
            mesh = self.state.mesh
            sizes = split_sizes(num_text + sum(split.image_sizes), mesh.sequence_degree)
            lo = offsets(sizes)[mesh.seq_rank]
            # a new dict: the pipeline's own (reused every step) keeps the whole mask
            call["joint_attention_kwargs"] = {
                **kwargs, "attention_mask": kwargs["attention_mask"].narrow(3, lo, sizes[mesh.seq_rank])}


def _fibo_routed_call_missing(transformer: BriaFiboTransformer2DModel) -> str | None:
    if _DOUBLE_CALL is None or _SINGLE_CALL is None:
        return f"this diffusers' BriaFiboAttnProcessor or BriaAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


FIBO_PLAN = ModelPlan(
    name="BriaFibo",
    model_class=BriaFiboTransformer2DModel,
    split_at="",  # the forward's own arguments (BriaFiboSplitForward); the image rows gathered after it
    gather_at="proj_out",
    attention=(
        # [text; image] pieces of one sharded sequence: attention over the whole of it, padded keys removed
        Parallel("transformer_blocks.*.attn", USPBriaFiboAttnProcessor, stock=(BriaFiboAttnProcessor,)),
        Parallel("single_transformer_blocks.*.attn", USPBriaFiboSingleAttnProcessor, stock=(BriaAttnProcessor,)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # Arguments that carry the batch dimension first (split over the "cfg" axis by enable_usp):
    # BriaFiboPipeline's one call a step on [uncond; cond]; the mask inside joint_attention_kwargs.
    cfg_batch_args=(
        "hidden_states", "encoder_hidden_states", "text_encoder_layers", "timestep", "guidance",
        "joint_attention_kwargs",
    ),
    refuse=(_fibo_routed_call_missing,),
)

FIBO_ADAPTER = register_adapter(JointSplitPlanAdapter(FIBO_PLAN, __name__, BriaFiboSplitForward))
