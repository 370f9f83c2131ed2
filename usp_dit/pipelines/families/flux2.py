"""Flux.2 adapter: ``Flux2Transformer2DModel`` (FLUX.2-dev, FLUX.2-klein; ``Flux2Pipeline`` and the Klein pipelines).

Layout: image tokens (batch, N, channels) in the pipeline's packed order: the target image's
latent patches row-major, then any reference images' (image editing: ``img_ids`` time coordinate
10, 20, ...); text tokens (batch, T, channels), the prompt padded to ``max_sequence_length`` and
**all attended** (the pipeline hands the transformer no mask); position ids (tokens, 4) or
(batch, tokens, 4) (the model reads row 0), axes (t, h, w, l); Q/K/V (batch, seq, heads, head_dim);
the RoPE table ``(cos, sin)``, each (T + N, head_dim), built in the forward from
``cat(pos_embed(txt_ids), pos_embed(img_ids))``: row i rotates token i of ``[text; image]``.

Text tokens: **split** together with the image tokens (as the Flux.1 adapter,
``usp_dit.pipelines.families.flux`` Note [Flux token split]): the joint sequence ``[text; image]`` is cut
into ``split_sizes(T + N, P)`` contiguous pieces. Flux.2-dev has 8 double-stream and 48
single-stream blocks; the single-stream ones run all per-token work (the fused QKV + MLP
projection, the MLP, the output projection) on ``[text; image]``, so a text token costs what an
image token costs. At 1024 x 1024 (4096 image tokens, 512 text tokens = 4608):

    per rank     P=2    P=4    P=8
    replicated   2560   1536   1024    (4096 / P image + all 512 text)
    split        2304   1152    576    (4608 / P; at P=8 rank 0 holds 512 text + 64 image)

Replicating the text would leave 512 tokens of unshrunk work on every rank (1.8x the split's
load at P=8). Split, every rank holds one piece of the joint sequence in global order, the load
is even to one token, and attention sees one plain sharded sequence (``Route(state, "none")``:
no joint tokens; there is no mask to split). Diffusers' own ``_cp_plan`` splits the text too (it
cuts text and image separately, which needs P | T and P | N; ours are cut as one sequence and
may have any lengths).

Where the tokens are split: at the forward's arguments (``Flux2SplitForward``, a
``_joint_split.JointSplitForward`` installed by the plan, like Diffusers' ``_cp_plan`` entry ``""``): this rank's rows of
``hidden_states`` / ``img_ids`` and ``encoder_hidden_states`` / ``txt_ids`` (Note [Flux.2 token
split]). The stock forward then runs unchanged on the pieces: ``x_embedder`` / ``context_embedder``
per token, ``pos_embed`` on this rank's ids (so the RoPE rows are exactly its tokens'), the
double blocks' ``[text; image]`` concatenation and the single blocks' ``cat([text, image])`` both
this rank's piece of the joint sequence in global order, and the forward's final
``hidden_states[:, num_txt_tokens:]`` drops this rank's text rows (``num_txt_tokens`` is read from
the local ``encoder_hidden_states``). ``proj_out``'s output, this rank's image rows, is gathered
(uneven pieces: every rank's image count) once, after the forward. The split cannot be a pre-hook
of the first block: the forward computes ``num_txt_tokens`` before it, from the whole text.

Note [Flux.2 token split]
    joint sequence    [ t_0 .. t_{T-1} | i_0 .. i_{N-1} ]     (Flux.2's attention order)
    pieces            split_sizes(T + N, P): rank s holds [lo_s, hi_s)
    rank s passes     encoder_hidden_states, txt_ids rows [lo_s, hi_s) ∩ [0, T)
                      hidden_states, img_ids rows ([lo_s, hi_s) ∩ [T, T + N)) - T
    A rank may hold no text (its text stream is (B, 0, C)) or no image tokens (FLUX.2-dev at
    P = 16: 288 per rank, rank 0 text only); both run, and the gather takes 0 rows from it.

Note [Flux.2's KV processors]
    ``Flux2KVAttnProcessor`` / ``Flux2KVParallelSelfAttnProcessor`` are what
    ``Flux2KleinKVPipeline`` installs in its ``__init__``: with reference images, step 0 runs
    ``kv_cache_mode="extract"`` ([text, ref, image]: the reference tokens attend only to
    themselves, their post-RoPE K/V cached per layer) and later steps ``"cached"`` (the cached
    reference K/V injected between text and image keys). Those paths call
    ``_flux2_kv_causal_attention``, a module function whose attention calls are not routed: they
    would attend within this rank's shard only. So the KV *modes* are refused at the call
    (``kv_cache_mode``, ``kv_cache``, ``num_ref_tokens``, and the same keys in
    ``joint_attention_kwargs``); the KV *processors* are accepted: without those arguments their
    code is the plain processors' line for line, and they are replaced by the routed plain ones
    (a Klein KV pipeline without reference images runs sequence-parallel; tested against stock).

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]): double- and
single-stream attention parallel (the stock processors' own code with their
``dispatch_attention_fn`` call routed, ``_routing`` Note [routing a stock processor's attention
call]), the tokens split at the forward's arguments and gathered after it (``_joint_split``
Note [joint token split], shared with Flux.1 and Chroma). Tensor parallelism (``tensor_degree``):
the cuts ``_DOUBLE`` / ``_SINGLE`` below (``usp_dit.pipelines.tensor`` Note [tensor plans]; the
single blocks' fused [q, k, v | gate, value] projection is a ``Fused`` of the heads' and the MLP's
splits, each padded on its own).

Refused (NotImplementedError): processors other than the stock ``Flux2AttnProcessor`` /
``Flux2ParallelSelfAttnProcessor`` and their KV variants (LoRA-replaced, custom, Diffusers'
context parallelism already enabled), attention modules the plan does not name, a Diffusers
cache, a model without blocks (at enable); the KV-cache modes, an ``attention_mask`` (Flux.2
pipelines pass none; the stock blocks never forward one) and processors swapped after enable (at
the call). ``Flux2Pipeline`` is guidance-distilled: one transformer call per step, batch = the
prompts, so ``cfg_degree=2`` splits a batch of prompts and runs a batch of one whole on both cfg
groups (correct, no faster). ``Flux2KleinPipeline`` (the non-distilled base model, ``guidance_scale
> 1``) calls the transformer once per guidance branch, batch 1 each with one prompt: with
``cfg_degree=2`` the two calls of a step run on the two cfg groups at once (``cfg_branch_args``,
``usp_dit.pipelines.cfg_pair`` Note [two calls a step]). Flux.2 configs have no dropout.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import Flux2Transformer2DModel
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
)

from usp_dit.pipelines._joint_split import JointSplitForward, JointSplitPlanAdapter
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel
from usp_dit.pipelines.tensor import BlockCuts, Concat, Fused, Split, TensorPlan

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedFlux2Attn = routed_processor_class(Flux2AttnProcessor, "_RoutedFlux2Attn")
_RoutedFlux2SelfAttn = routed_processor_class(Flux2ParallelSelfAttnProcessor, "_RoutedFlux2SelfAttn")

# Note [Flux.2's KV processors]: the arguments of the KV-cache modes, refused at the call.
_KV_ARGS = ("kv_cache", "kv_cache_mode", "num_ref_tokens", "num_txt_tokens")
_NO_MASK = "usp_dit's Flux.2 adapter does not route an attention_mask (Flux.2 pipelines pass none)"


class USPFlux2AttnProcessor(_RoutedFlux2Attn or RoutedProcessor):
    """Double-stream attention of this rank's piece of ``[text; image]`` against the whole sequence.

    Inputs: ``hidden_states`` (B, N_local, C) this rank's image rows, ``encoder_hidden_states``
    (B, T_local, C) its text rows (possibly none), ``image_rotary_emb`` ``(cos, sin)`` each
    (T_local + N_local, head_dim), this rank's rows. Returns ``(image_out (B, N_local, C),
    text_out (B, T_local, C))``. The maths is ``Flux2AttnProcessor``'s own code.

    The explicit signature matters: ``Flux2Attention.forward`` passes a processor only the
    keyword arguments its ``__call__`` names.
    """

    def __call__(
        self,
        attn: Flux2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise NotImplementedError(_NO_MASK)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class USPFlux2SelfAttnProcessor(_RoutedFlux2SelfAttn or RoutedProcessor):
    """Single-stream attention (+ the fused MLP) of this rank's piece of ``[text; image]``.

    Inputs: ``hidden_states`` (B, T_local + N_local, C); ``image_rotary_emb`` ``(cos, sin)`` each
    (T_local + N_local, head_dim). Returns (B, T_local + N_local, C). The maths is
    ``Flux2ParallelSelfAttnProcessor``'s own code.
    """

    def __call__(
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError(_NO_MASK)
        return super().__call__(attn, hidden_states, attention_mask, image_rotary_emb)


def _check_call(call: dict[str, Any]) -> None:
    """NotImplementedError for the KV-cache modes (Note [Flux.2's KV processors])."""
    extra = {k for k, v in call.items() if k in _KV_ARGS and v not in (None, 0)}
    extra |= {k for k in (call.get("joint_attention_kwargs") or {}) if k in _KV_ARGS}
    if extra:
        raise NotImplementedError(
            f"usp_dit's Flux.2 adapter does not run the KV-cache modes ({sorted(extra)}): their reference-token "
            f"attention is not routed (Note [Flux.2's KV processors]); call disable_usp() for Flux2KleinKVPipeline "
            f"with reference images"
        )


class Flux2SplitForward(JointSplitForward):
    """``JointSplitForward`` for Flux.2: the KV-cache modes refused (Note [Flux.2's KV processors])."""

    def check(self, call: dict[str, Any]) -> None:
        _check_call(call)


def _routed_call_missing(transformer: Flux2Transformer2DModel) -> str | None:
    pairs = ((Flux2AttnProcessor, _RoutedFlux2Attn), (Flux2ParallelSelfAttnProcessor, _RoutedFlux2SelfAttn))
    for stock, routed in pairs:
        if routed is None:
            return f"this diffusers' {stock.__name__} does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


# Tensor parallelism (usp_dit.pipelines.tensor Note [tensor plans]), where Diffusers' own Flux.2
# ``_tp_plan`` cuts. Double blocks: each attention's heads (Q/K/V, the text stream's added
# projections, both output projections) and each SwiGLU MLP's width ([gate, value]: packs 2).
# Single blocks: one fused projection makes [q, k, v | gate, value] (a Fused of the heads' split,
# packs 3, and the MLP width's, packs 2) and ``to_out`` reads cat([attention, MLP]) (a Concat);
# the stock processor splits the fused output by ``attn.inner_dim`` and ``attn.mlp_hidden_dim``,
# which read a tensor rank's sizes while cut (``Split.width``), so its split is exact with padded
# heads or MLP columns too. The QK norms are per head (RMSNorm over head_dim); the modulation is
# computed once outside the blocks (``double_stream_modulation_*``, ``single_stream_modulation``)
# and stays whole, as do the blocks' LayerNorms (no weights).
_DOUBLE = BlockCuts("transformer_blocks", splits=(
    Split(columns=("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
          rows=("attn.to_out.0", "attn.to_add_out"), heads="attn"),
    Split(columns=("ff.linear_in",), rows=("ff.linear_out",), packs=2),
    Split(columns=("ff_context.linear_in",), rows=("ff_context.linear_out",), packs=2),
))
_SINGLE = BlockCuts("single_transformer_blocks", splits=(
    Split(columns=(), heads="attn", packs=3, width="attn.inner_dim"),
    Split(columns=(), packs=2, width="attn.mlp_hidden_dim"),
), fused=(Fused("attn.to_qkv_mlp_proj", (0, 1)),), concats=(Concat("attn.to_out", (0, 1)),))

PLAN = ModelPlan(
    name="Flux2",
    model_class=Flux2Transformer2DModel,
    # The forward's own arguments ("" is the transformer: Diffusers' _cp_plan entry), split by
    # JointSplitForward (JointSplitPlanAdapter); the image rows of proj_out's output gathered after it.
    split_at="",
    gather_at="proj_out",
    attention=(
        # [text; image] pieces of one sharded sequence: plain self-attention over the whole of it
        Parallel("transformer_blocks.*.attn", USPFlux2AttnProcessor,
                 stock=(Flux2AttnProcessor, Flux2KVAttnProcessor)),
        Parallel("single_transformer_blocks.*.attn", USPFlux2SelfAttnProcessor,
                 stock=(Flux2ParallelSelfAttnProcessor, Flux2KVParallelSelfAttnProcessor)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not
    # run). img_ids / txt_ids stay whole: the model reads their row 0 for every batch element.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "guidance"),
    # Flux2KleinPipeline's CFG (the base, non-distilled Klein at guidance_scale > 1; the inpaint
    # pipeline alike) calls the transformer once per branch: the prompt's Qwen3 embeds and text
    # ids, then those of the empty negative prompt (usp_dit.pipelines.cfg_pair Note [two calls a
    # step]). Flux2Pipeline (FLUX.2-dev, guidance-distilled) and the step-distilled Klein make one
    # call a step: nothing to pair.
    cfg_branch_args=("encoder_hidden_states", "txt_ids"),
    refuse=(_routed_call_missing,),
    tensor=TensorPlan((_DOUBLE, _SINGLE)),
)


ADAPTER = register_adapter(JointSplitPlanAdapter(PLAN, __name__, Flux2SplitForward))
