"""Kandinsky 5 adapter: ``Kandinsky5Transformer3DModel`` (Kandinsky 5.0 T2V / I2V Lite and Pro, T2I / I2I) on a USP grid.

Layout: latents channels-last (batch, frames, height, width, channels); the patch embedding makes
(batch, frames/p_t, height/p_h, width/p_w, model_dim) and ``fractal_flatten`` (dense attention:
``flatten(1, 3)``) makes the video tokens (batch, seq, model_dim), frame-major, ``seq = frames/p_t
* height/p_h * width/p_w``; text (batch, text_seq, model_dim), replicated, the prompt padded to the
batch's longest (no mask: the model attends every text token, padding too, as stock does); Q/K/V
(batch, seq, heads, head_dim), ``head_dim = sum(axes_dims)``; the visual RoPE table
(batch, seq, 1, head_dim/2, 2, 2) after the same flatten: **the sequence on dim 1**; the time
embedding (batch, time_dim): one per element, none per token.

Where the tokens are split: the patch embedding, the text embedding, the text blocks and the RoPE
tables run on every rank; ``visual_transformer_blocks.0``'s input is sharded; the *last visual
block's* output is gathered (Note [Kandinsky 5's gather]). The RoPE table reaches every visual
block as an argument and is cut like the tokens there (``VisualRopeHooks``).

Text tokens: **replicated**, no communication for them. Kandinsky 5 has no joint attention: the
text is a separate stream with its own blocks (``text_transformer_blocks``: self-attention over
the text alone, with a 1-D RoPE), run once before the visual blocks on the whole text, locally
(stock processors). Each visual block attends over the video tokens alone (``self_attention``:
sequence-parallel, ``usp_attention``), then cross-attends from the video queries to the text
(``cross_attention``: local, each query reads whole K/V every rank holds). Per-rank token count,
Kandinsky 5.0 T2V Lite 5 s at 768 x 512 (121 frames: 31 latent frames x 32 x 48 patches = 47616
video tokens; up to 256 prompt tokens): 5952 video tokens per rank on 8 ranks, with the whole
text's K/V projections in cross-attention (~0.5 % of a rank's linear work).

Note [Kandinsky 5's gather]
    After the last visual block the model calls ``fractal_unflatten`` (``reshape`` to the latent
    grid (batch, frames, height, width, model_dim)) and then ``out_layer`` (modulated norm, linear,
    unpatchify) on that grid. The reshape needs every token, so the sequence is gathered at the
    last visual block's output (a forward hook on ``visual_transformer_blocks.<last>``), and
    ``out_layer`` runs whole on every rank (one norm and one linear per token: small). The gather
    moves model_dim values a token instead of the output's p_t*p_h*p_w*channels; once a forward,
    about what one layer's four all-to-alls move. The plan names the last block when it is
    enabled (``Kandinsky5Adapter.make_patch``): its index is the model's ``num_visual_blocks - 1``.

Note [Kandinsky 5's sparse attention]
    Configs with ``attention_type="nabla"`` (the 10 s Lite and the Pro checkpoints) attend
    block-sparsely: ``sparse_params`` (which the pipelines pass for those configs) reorders the
    tokens into 8 x 8 patches (``fractal_flatten(block_mask=True)``, before the visual blocks: the
    tokens are split in that order) and each self-attention call builds a flex-attention
    ``BlockMask`` over 64-token blocks from the *whole* Q and K (``nablaT_v2``: Q and K mean-pooled
    per block, softmax over all key blocks, the blocks holding the top ``P`` of the mass kept, OR
    the sliding-window ``sta_mask`` (1, 1, blocks, blocks)). No shard holds what that estimate reads,
    and a ring cannot express the pattern. But the estimate is per head: pooling, ``q @ k``,
    softmax, sort and top-P all run over (batch, head) independently, and the STA mask broadcasts
    over heads. So on a grid without ring (``ring_degree=1``, any Ulysses degree, uneven head
    splits included) it is exact: the Ulysses all-to-all gives each rank every token of its heads
    in stock's (fractal) order (``_routing.ulysses_whole_sequence``), where stock's own
    ``nablaT_v2`` builds those heads' BlockMask and stock's own ``dispatch_attention_fn`` (the
    processor's backend: flex) attends with it; the all-to-all back returns the rank's tokens.
    The stock processor's code runs unchanged with ``nablaT_v2`` deferred (``_DeferredNabla``:
    it would see a shard) and its attention call bound to ``ulysses_nabla_attention``.

        sparse_params, ring_degree == 1:  Ulysses NABLA attention (exact)
        sparse_params, ring_degree > 1:   refused (at the call, every rank alike)
        no sparse_params:                 usp_attention on any grid (dense, fractal order or not)

    A ``nabla`` config enables on any grid (its pipeline's calls on a ring grid are refused).
    The dense configs (``attention_type="regular"``: T2V/I2V Lite 5 s, T2I, I2I) run on any grid.

Self-attention keeps Diffusers' maths: ``USPKandinsky5AttnProcessor`` runs the stock
``Kandinsky5AttnProcessor.__call__``'s own code (projections, float32 RMS norms of Q and K, RoPE
on this rank's rows, its round trip through bfloat16 included, output projection) with its one
``dispatch_attention_fn`` call routed to ``usp_attention`` (``usp_dit.pipelines._routing``).

CFG: every Kandinsky 5 pipeline calls the transformer once per guidance branch, the prompt's
Qwen2.5-VL embeds, CLIP pooled embeds and text RoPE positions, then the negative prompt's (their
lengths may differ); with ``cfg_degree=2`` the two calls of a step run on the two cfg groups at
once (``usp_dit.pipelines.cfg_pair`` Note [two calls a step]).

Gradients (fine-tuning): each rank's parameter gradients, summed over the sequence group, are one
process's, except in the replicated text stream: each rank's text gradient is its video shard's
part, and the stock backward rounds it to bfloat16 in the text RoPE (``apply_rotary``'s cast)
before the parts are summed, where one process rounds the sum: the text blocks' (and the time
embedding's) gradients agree to bfloat16's resolution (tests/test_pipeline_kandinsky5.py).

Refused (NotImplementedError): processors other than the stock ``Kandinsky5AttnProcessor``,
visual self-attentions set to different attention backends (``carry_stock_backend``), sparse
attention on a ring grid (Note [Kandinsky 5's sparse attention]), a Diffusers cache that cannot run on a
grid (``usp_dit.pipelines.caches``), a model without visual blocks (``num_visual_blocks=0``).
The model has no dropout, so the replicated text stream needs no replicated-dropout handling.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from diffusers import Kandinsky5Transformer3DModel
from diffusers.models import attention_dispatch
from diffusers.models.transformers import transformer_kandinsky
from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Attention, Kandinsky5AttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines._routing import (
    ROUTED_NAME,
    RoutedProcessor,
    routed_processor_class,
    ulysses_whole_sequence,
    with_global,
)
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, PlanPatch, check_plan
from usp_dit.sharding.shard import shard_sequence

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedKandinsky5Processor = routed_processor_class(Kandinsky5AttnProcessor, "_RoutedKandinsky5Processor")

# The visual blocks' positional argument that carries the RoPE table (Kandinsky5TransformerDecoderBlock.forward).
_ROPE_ARG = ("rope", 3)
_SPARSE_REASON = (
    "NABLA block-sparse attention: its flex-attention BlockMask is estimated per head from the whole sequence's "
    "Q and K (mean-pooled per 64 tokens, top-P of the softmax mass kept), which a ring splits and cannot express "
    "(Note [Kandinsky 5's sparse attention]); ring_degree=1 (any Ulysses degree) runs it exactly"
)
_ESTIMATE = "nablaT_v2"  # the stock module's BlockMask estimate, which the stock processor calls


@dataclasses.dataclass(frozen=True)
class _DeferredNabla:
    """What the stock processor's ``nablaT_v2(query, key, sta, thr=P)`` returns under usp_dit: its
    arguments other than the shard's Q/K, for ``ulysses_nabla_attention`` to build the mask from
    the whole sequence. ``sta``: (1 | B, 1 | H, blocks, blocks) bool."""

    sta: torch.Tensor
    thr: float


def _defer_nabla(q: torch.Tensor, k: torch.Tensor, sta: torch.Tensor, thr: float = 0.9) -> _DeferredNabla:
    return _DeferredNabla(sta, thr)


BlockMaskOf = Callable[[torch.Tensor, torch.Tensor, _DeferredNabla, tuple[int, int]], Any]


def deferred_nabla_call(family: str, block_mask_of: BlockMaskOf) -> Callable[..., torch.Tensor]:
    """The routed ``dispatch_attention_fn`` of a stock processor that estimates a NABLA BlockMask
    (deferred: ``_DeferredNabla``) and attends with it, on a grid without ring (Note [Kandinsky 5's
    sparse attention]; Kandinsky 6 SR's processor does the same with its own estimate).

    ``block_mask_of(q, k, deferred, heads)``: the BlockMask stock's estimate builds from this rank's
    query heads ``heads`` (start, stop) of the whole sequence, q/k (B, S, h, D).
    """

    def call(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: _DeferredNabla | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        attention_kwargs: dict[str, Any] | None = None,
        *,
        backend: Any = None,
        parallel_config: Any = None,
    ) -> torch.Tensor:
        """A NABLA self-attention call: ``dispatch_attention_fn``'s signature, as the stock processor calls it.

        Args:
            query, key, value: (B, S_local, H, D) this rank's tokens (the model's block order), rotated Q/K.
            attn_mask: the deferred estimate's arguments (``_DeferredNabla``).
            backend: the processor's attention backend (flex: the one stock's BlockMask needs).
            parallel_config: the processor's ``Route``.

        Returns:
            (B, S_local, H, D): this rank's tokens; each head's attention is stock's, its BlockMask
            built by stock's estimate from that head's whole Q and K.

        Raises:
            NotImplementedError: a ring grid, or a call this path does not carry (dropout, causal,
                attention kwargs, no deferred mask).
        """
        if not isinstance(attn_mask, _DeferredNabla) or dropout_p or is_causal or attention_kwargs:
            raise NotImplementedError(
                f"usp_dit's {family} NABLA attention got attn_mask={type(attn_mask).__name__}, "
                f"dropout_p={dropout_p}, is_causal={is_causal}, attention_kwargs={attention_kwargs}")

        def nabla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int]) -> torch.Tensor:
            block_mask = block_mask_of(q, k, attn_mask, heads)
            return attention_dispatch.dispatch_attention_fn(q, k, v, attn_mask=block_mask, scale=scale, backend=backend)

        return ulysses_whole_sequence(query, key, value, parallel_config.state, nabla)

    return call


def _nabla_block_mask(q: torch.Tensor, k: torch.Tensor, deferred: _DeferredNabla, heads: tuple[int, int]) -> Any:
    """Stock's ``nablaT_v2`` on this rank's heads: a per-head STA mask (1 | B, H, ...) cut to them."""
    sta = deferred.sta if deferred.sta.shape[1] == 1 else deferred.sta[:, heads[0]:heads[1]]
    return getattr(transformer_kandinsky, _ESTIMATE)(q, k, sta, thr=deferred.thr)


ulysses_nabla_attention = deferred_nabla_call("Kandinsky5", _nabla_block_mask)


# The stock code with ``nablaT_v2`` deferred and its attention call bound to ``ulysses_nabla_attention``
# (None exactly when ``_RoutedKandinsky5Processor`` is, or when the stock code builds no NABLA mask).
_deferred = with_global(Kandinsky5AttnProcessor.__call__, _ESTIMATE, _defer_nabla)
_NABLA_CALL = _deferred and with_global(_deferred, ROUTED_NAME, ulysses_nabla_attention)


class USPKandinsky5AttnProcessor(_RoutedKandinsky5Processor or RoutedProcessor):
    """Kandinsky 5 visual self-attention of this rank's video shard against the whole sequence.

    Inputs: ``hidden_states`` (B, S_local, C); ``rotary_emb`` this rank's rows of the visual RoPE
    table, (B, S_local, 1, head_dim/2, 2, 2) (cut by ``VisualRopeHooks``); ``sparse_params`` the
    pipeline's NABLA parameters or ``None``. Returns (B, S_local, C). The maths is the stock
    ``Kandinsky5AttnProcessor``'s own code, its attention call routed (dense: ``usp_attention``;
    NABLA: ``ulysses_nabla_attention``, Note [Kandinsky 5's sparse attention]).
    """

    def __call__(
        self,
        attn: Kandinsky5Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        rotary_emb: torch.Tensor | None = None,
        sparse_params: dict | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise NotImplementedError(
                "USPKandinsky5AttnProcessor is for the visual self-attention only; cross_attention runs locally")
        if sparse_params is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, rotary_emb, None)
        ring = self.route.state.mesh.ring_degree
        if ring > 1 or _NABLA_CALL is None:
            why = f"a ring grid (ring_degree={ring})" if ring > 1 else f"this diffusers' processor, no {_ESTIMATE} call"
            raise NotImplementedError(f"usp_dit's Kandinsky5 adapter does not run {_SPARSE_REASON}; here: {why}")
        return _NABLA_CALL(self, attn, hidden_states, None, rotary_emb, sparse_params)


class VisualRopeHooks:
    """Every visual block gets this rank's rows of the flattened visual RoPE table (dim 1), cut
    like the tokens (a view). Block 0's token hook runs first and sets this call's ``seq_len``.
    ``rope_arg`` (name, position) and ``dim`` (its sequence dimension): where the table is in the
    blocks' arguments (Kandinsky 6's subclass names its own)."""

    rope_arg: tuple[str, int] = _ROPE_ARG
    dim: int = 1

    def __init__(self, transformer: Kandinsky5Transformer3DModel, state: ShardState) -> None:
        self.state = state
        self.blocks = list(transformer.visual_transformer_blocks)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(self._cut_rope, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut_rope(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(B, S, 1, D/2, 2, 2) -> (B, S_local, 1, D/2, 2, 2), this rank's rows.

        Raises:
            ValueError: the table's length is not the call's token count.
        """
        name, index = self.rope_arg
        rope = _get_arg(args, kwargs, name, index)
        if rope.shape[self.dim] != self.state.seq_len:
            raise ValueError(
                f"the visual RoPE table has {rope.shape[self.dim]} rows but the transformer has {self.state.seq_len} "
                f"video tokens: they must match for the table to be cut like the tokens"
            )
        local = shard_sequence(rope, self.state.mesh, dim=self.dim, layout=self.state.layout)
        return _set_arg(args, kwargs, name, index, local)


def _routed_call_missing(transformer: Kandinsky5Transformer3DModel) -> str | None:
    if _RoutedKandinsky5Processor is None:
        return f"this diffusers' Kandinsky5AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


def _no_visual_blocks(transformer: Kandinsky5Transformer3DModel) -> str | None:
    if len(transformer.visual_transformer_blocks) == 0:
        return "num_visual_blocks=0: no visual block to split the video tokens at"
    return None


_STOCK = (Kandinsky5AttnProcessor,)

PLAN = ModelPlan(
    name="Kandinsky5",
    model_class=Kandinsky5Transformer3DModel,
    split_at="visual_transformer_blocks.0",
    # Note [Kandinsky 5's gather]: the last visual block, named at enable (Kandinsky5Adapter).
    gather_at="visual_transformer_blocks.<last>",
    attention=(
        Parallel("visual_transformer_blocks.*.self_attention", USPKandinsky5AttnProcessor, stock=_STOCK),
        Local("visual_transformer_blocks.*.cross_attention", stock=_STOCK),  # to the replicated text
        Local("text_transformer_blocks.*.self_attention", stock=_STOCK),  # the text stream, whole on every rank
    ),
    block_lists=("text_transformer_blocks", "visual_transformer_blocks"),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run).
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "pooled_projections"),
    cfg_branch_args=("encoder_hidden_states", "pooled_projections", "text_rope_pos"),
    hooks=(VisualRopeHooks,),
    refuse=(_routed_call_missing, _no_visual_blocks),
    heads=lambda model: model.config.model_dim // sum(model.config.axes_dims),
)


def carry_stock_backend(patch: PlanPatch) -> None:
    """Give each swapped-in processor the attention backend its stock processors were set to.

    The NABLA call is stock's ``dispatch_attention_fn`` with the processor's ``_attention_backend``
    (flex: the one a BlockMask needs), which ``set_attention_backend`` sets on each stock processor,
    on the whole model or on the visual self-attentions alone. One USP processor serves every
    visual block, so their stock processors must agree. (A later ``set_attention_backend`` sets the
    USP processor's directly; the dense calls' router ignores it: usp_dit's backend runs those.)

    Raises:
        NotImplementedError: the stock processors it replaces were set to different backends.
    """
    seen: dict[int, tuple[Any, set]] = {}
    for _, original, replacement in patch.swaps:
        seen.setdefault(id(replacement), (replacement, set()))[1].add(getattr(original, "_attention_backend", None))
    for replacement, backends in seen.values():
        if len(backends) > 1:
            raise NotImplementedError(
                f"usp_dit's Kandinsky5 adapter: the visual self-attentions' stock processors are set to different "
                f"attention backends {sorted(str(b) for b in backends)}; one processor serves them all: set one "
                f"(transformer.set_attention_backend)")
        replacement._attention_backend = backends.pop()


class Kandinsky5Adapter(PlanAdapter):
    """``PLAN`` with its gather at the model's last visual block (Note [Kandinsky 5's gather]), its
    processors on the stock processors' attention backend (``carry_stock_backend``)."""

    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> PlanPatch:
        check_plan(self.plan, transformer)
        last = len(transformer.visual_transformer_blocks) - 1
        plan = dataclasses.replace(self.plan, gather_at=f"visual_transformer_blocks.{last}")
        patch = PlanPatch(plan, transformer, mesh, backend)
        carry_stock_backend(patch)
        return patch


ADAPTER = register_adapter(Kandinsky5Adapter(PLAN, __name__))
