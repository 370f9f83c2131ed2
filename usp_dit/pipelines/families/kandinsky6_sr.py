"""Kandinsky 6 SR adapter: ``Kandinsky6SRTransformer3DModel`` (Kandinsky 6.0 video super-resolution) on a USP grid without ring.

Layout: latents channels-last (batch, frames, height, width, 2 * in_visual_dim + 1) (the noisy
latent, the anchor latent and its mask on channels); the patch embedding makes
(batch, frames/p_t, height/p_h, width/p_w, model_dim) and the model reorders it into 8 x 8 spatial
blocks (``_local_patch``) flattened to the video tokens (batch, seq, model_dim), ``seq = T * H * W``
(token grid), a multiple of 64; Q/K/V (batch, seq, heads, head_dim), ``head_dim = sum(axes_dims)``;
the RoPE table (seq, 1, head_dim/2, 2, 2) after the same reorder: **the sequence on dim 0**, no batch
dim; the time embedding (batch, time_dim): one per element; the STA prior (blocks, blocks) bool,
``blocks = seq / 64``, shared by every element and head. No text: the model is text-free.

Where the tokens are split: the patch embedding, the reorder, the RoPE table and the STA prior run
on every rank; ``visual_transformer_blocks.0``'s input is sharded (in the block order); the last
block's output is gathered (Note [Kandinsky 6 SR's gather]). The RoPE table reaches every block
as an argument and is cut like the tokens there (Kandinsky 5's ``VisualRopeHooks`` at this model's
argument). Per-rank tokens at a 512 x 768 tile (K-VAE 16x: 32 x 48 tokens a latent frame, 1536 a
frame): 1/U of them, plus, in each self-attention, every token of its 1/U of the heads.

Note [Kandinsky 6 SR's gather]
    After the last block the model regroups the tokens (``_local_merge``: a reshape and permute
    over the whole sequence) and runs ``out_layer`` (modulated norm, linear, unpatchify) on the
    grid: the sequence is gathered at the last block's output and ``out_layer`` runs whole on every
    rank (one norm and one linear per token), as Kandinsky 5 and 6 do.

Note [Kandinsky 6 SR's sparse attention]
    Every self-attention is NABLA block-sparse (Kandinsky 5's Note [Kandinsky 5's sparse
    attention]): the stock processor builds a flex ``BlockMask`` over 64-token blocks with
    ``nabla_block_mask(q.transpose(1, 2), k.transpose(1, 2), sta, thr=threshold)`` (Q and K
    mean-pooled per block, softmax over the key blocks, the blocks holding the top ``threshold`` of
    the mass kept, OR the sliding-tile prior ``sta``) and attends with ``dispatch_attention_fn(...,
    backend=FLEX)``. The estimate reads the whole sequence, but per head: pooling, ``q @ k``,
    softmax, sort and the cumulative sum run over (batch, head) independently, and the (blocks,
    blocks) prior broadcasts over both. So a grid without ring is exact: the Ulysses all-to-all
    gives each rank every token of its heads in stock's block order
    (``_routing.ulysses_whole_sequence``), where stock's own ``nabla_block_mask`` builds those
    heads' BlockMask and stock's own ``dispatch_attention_fn`` (flex) attends with it. The stock
    processor's code runs unchanged with ``nabla_block_mask`` deferred (Kandinsky 5's
    ``_DeferredNabla``: it would see a shard) and its attention call bound to
    ``ulysses_sr_nabla_attention``. A ring splits each head's sequence over ranks: no rank can build
    the estimate and ring attention cannot express the block pattern, so a grid with
    ``ring_degree > 1`` is refused at enable (and at the call).

Gradients (fine-tuning): each rank's parameter gradients, summed over the sequence group, are one
process's (tests/test_pipeline_kandinsky6_sr.py, (2,1) and (4,1)): the path is the stock processor's
code, the all-to-alls and stock's flex dispatch, each differentiable; the BlockMask carries no
gradient (its block indices are integers), as in stock.

CFG: ``Kandinsky6SRPipeline`` makes one transformer call a step, no guidance; ``cfg_degree=2``
splits a batch of tiles over the two cfg groups.

Refused (NotImplementedError): a grid with a ring (Note [Kandinsky 6 SR's sparse attention]),
processors other than the stock ``Kandinsky6SRAttnProcessor``, a diffusers whose processor makes no
``nabla_block_mask`` / ``dispatch_attention_fn`` call, a Diffusers cache that cannot run on a grid
(``usp_dit.pipelines.caches``), a model without blocks (``num_visual_blocks=0``).
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import Kandinsky6SRTransformer3DModel
from diffusers.models.transformers import transformer_kandinsky6_sr
from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRAttention, Kandinsky6SRAttnProcessor

from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, with_global
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.families.kandinsky5 import VisualRopeHooks, _defer_nabla, _DeferredNabla, deferred_nabla_call
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, PlanPatch

_ESTIMATE = "nabla_block_mask"  # the stock module's BlockMask estimate, which the stock processor calls
_RING_REASON = (
    "Kandinsky6SR's every self-attention is NABLA block-sparse: its flex-attention BlockMask is estimated per head "
    "from the whole sequence's Q and K (mean-pooled per 64 tokens, the top threshold of the softmax mass kept, OR a "
    "sliding-tile prior), which a ring splits over ranks and cannot express (Note [Kandinsky 6 SR's sparse "
    "attention]); ring_degree=1 works (any Ulysses degree, exact)"
)


def _sr_block_mask(q: torch.Tensor, k: torch.Tensor, deferred: _DeferredNabla, heads: tuple[int, int]) -> Any:
    """Stock's ``nabla_block_mask`` on this rank's heads: its (blocks, blocks) prior is every head's
    (no per-head slice); the estimate takes (B, h, S, D)."""
    estimate = getattr(transformer_kandinsky6_sr, _ESTIMATE)
    return estimate(q.transpose(1, 2), k.transpose(1, 2), deferred.sta, thr=deferred.thr)


# A Kandinsky 6 SR self-attention call on a grid without ring (Note [Kandinsky 6 SR's sparse attention]).
ulysses_sr_nabla_attention = deferred_nabla_call("Kandinsky6SR", _sr_block_mask)


# The stock code with ``nabla_block_mask`` deferred and its attention call bound to
# ``ulysses_sr_nabla_attention``; None when this diffusers' processor makes either call no more.
_deferred = with_global(Kandinsky6SRAttnProcessor.__call__, _ESTIMATE, _defer_nabla)
_NABLA_CALL = _deferred and with_global(_deferred, ROUTED_NAME, ulysses_sr_nabla_attention)


class USPKandinsky6SRAttnProcessor(RoutedProcessor):
    """Kandinsky 6 SR self-attention of this rank's token shard against the whole sequence, NABLA
    block-sparse as stock (Note [Kandinsky 6 SR's sparse attention]).

    Inputs: ``hidden_states`` (B, S_local, C); ``rotary_emb`` this rank's rows of the RoPE table,
    (S_local, 1, head_dim/2, 2, 2) (cut by ``SRRopeHooks``); ``sparse_params`` the model's
    ``{"sta_mask": (blocks, blocks) bool, "threshold": float}``. Returns (B, S_local, C).
    """

    def __call__(
        self,
        attn: Kandinsky6SRAttention,
        hidden_states: torch.Tensor,
        rotary_emb: torch.Tensor,
        sparse_params: dict[str, Any],
    ) -> torch.Tensor:
        ring = self.route.state.mesh.ring_degree
        if ring > 1:  # refused at enable too; a mesh changed under the model lands here
            raise NotImplementedError(f"usp_dit does not run {_RING_REASON}; here ring_degree={ring}")
        return _NABLA_CALL(self, attn, hidden_states, rotary_emb, sparse_params)


class SRRopeHooks(VisualRopeHooks):
    """Kandinsky 5's per-block RoPE cut at the SR blocks' argument: ``rotary_emb``, their third,
    (S, 1, head_dim/2, 2, 2) with the sequence on dim 0."""

    rope_arg = ("rotary_emb", 2)
    dim = 0


def _routed_call_missing(transformer: Kandinsky6SRTransformer3DModel) -> str | None:
    if _NABLA_CALL is None:
        return (f"this diffusers' Kandinsky6SRAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes "
                f"(or no {_ESTIMATE}, the estimate it defers)")
    return None


def _no_visual_blocks(transformer: Kandinsky6SRTransformer3DModel) -> str | None:
    if len(transformer.visual_transformer_blocks) == 0:
        return "num_visual_blocks=0: no block to split the video tokens at"
    return None


PLAN = ModelPlan(
    name="Kandinsky6SR",
    model_class=Kandinsky6SRTransformer3DModel,
    split_at="visual_transformer_blocks.0",
    gather_at="visual_transformer_blocks.-1",  # Note [Kandinsky 6 SR's gather]
    attention=(
        Parallel("visual_transformer_blocks.*.self_attention", USPKandinsky6SRAttnProcessor,
                 stock=(Kandinsky6SRAttnProcessor,)),
    ),
    block_lists=("visual_transformer_blocks",),
    cfg_batch_args=("hidden_states", "timestep"),  # no guidance: cfg_degree=2 splits a batch of tiles
    hooks=(SRRopeHooks,),
    refuse=(_routed_call_missing, _no_visual_blocks),
    heads=lambda model: model.config.model_dim // sum(model.config.axes_dims),
)


class Kandinsky6SRAdapter(PlanAdapter):
    """``PLAN``, refused at enable on a grid with a ring (Note [Kandinsky 6 SR's sparse attention])."""

    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> PlanPatch:
        if mesh.ring_degree > 1:
            raise NotImplementedError(f"usp_dit does not run {_RING_REASON}; got ring_degree={mesh.ring_degree}")
        return super().make_patch(transformer, mesh, backend)


ADAPTER = register_adapter(Kandinsky6SRAdapter(PLAN, __name__))
