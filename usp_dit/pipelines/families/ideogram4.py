"""Ideogram 4 adapter: ``Ideogram4Transformer2DModel`` (``Ideogram4Pipeline``) on a USP grid.

Layout: one packed sequence per element, (batch, L, ...), every argument of the forward indexed
by token: ``hidden_states`` (B, L, in_channels) (the noisy image latents on image rows, zeros
elsewhere), ``encoder_hidden_states`` (B, L, llm_features_dim) (text features on text rows),
``position_ids`` (B, L, 3) (t, h, w) MRoPE positions, ``segment_ids`` (B, L) (which tokens attend
to which: equal ids), ``indicator`` (B, L) (3 text, 2 image, anything else padding), ``timestep``
(B,) or (B, L). The pipeline packs ``[left padding; text (T_b valid of T); image (N)]`` for the
conditional call (padding in segment -1, text and image in segment 1) and ``[image (N)]`` alone for
the unconditional one (a second model, ``unconditional_transformer``). The output is (B, L,
in_channels); the pipeline reads its image rows. Inside the blocks Q/K/V are (B, L, heads,
head_dim) and the mask (B, 1, L, L) bool, ``segment_ids[q] == segment_ids[k]``.

Note [Ideogram 4's packed sequence]
    The model is single-stream: one set of weights serves text, padding and image tokens alike, and
    a block-diagonal mask over segments replaces a key mask. The image tokens are the long part
    (2048 x 2048: 128 x 128 = 16384) and all sit in one segment, after the text part (T = 2048
    rows, ``max_sequence_length``, mostly left padding). Each rank keeps the whole text part and
    its shard of the image (``Ideogram4SplitForward``, at the forward's arguments):

        arguments (B, T + N, ...) ─► [T text/padding rows; this rank's N_local image rows]
          ─► stock forward on T + N_local tokens (embeddings, MRoPE from exactly these positions,
             the mask from exactly these segment ids: its text-by-text block is stock's, and every
             image key sits in the image's segment)
          ─► blocks: attention split by query (``segment_attention``):
               image queries, and text queries in the image's segment: the whole image (sharded,
               ``usp_attention``) plus the text keys of that segment (replicated joint tokens,
               masked per element: Note [masked text tokens] in ``_routing``);
               text queries of another segment (the padding): their own segment's text keys, all
               on this rank (no image key is in their segment): stock attention on the text part.
          ─► output: the text rows (replicated, exact) beside the image rows gathered over the group.

    Every row, padding included, is stock's: the padding rows attend among themselves as they do
    in one process. Why the text is not split with the image (as Flux's is): its padding rows are
    masked from the image's queries, and a mask over sharded keys is not something the ring can do.
    Cost at 2048 x 2048 on 8 ranks: 2048 + 2048 tokens a rank (vs 18432 / 8 = 2304 were every token
    split); the text part's attention is T x T.

    The text part's length T is read from ``indicator`` (N = its count of image tokens, the image
    a contiguous suffix), a data-dependent shape: the whole forward does not trace in one graph
    (its blocks do: ``compile_repeated_blocks(fullgraph=True)`` compiles every block in one).

Text: replicated (above). CFG: ``Ideogram4Pipeline`` calls two different transformers a step
(``transformer`` on ``[text; image]``, ``unconditional_transformer`` on the image alone: asymmetric
CFG), both enabled by ``pipe.enable_usp()``; their calls differ in model and length, so no pair of
them can run on the two cfg groups at once: ``cfg_degree=2`` splits a batch of prompts (an even
batch: each call's elements over the two groups), and refuses an odd one.

Tensor parallelism (``_TENSOR``): the attention's heads and the SwiGLU width over the "tensor" axis.

Refused (NotImplementedError): at enable, processors other than the stock ``Ideogram4AttnProcessor``
(LoRA-replaced, custom, Diffusers' context parallelism), attention modules the plan does not name,
an unsupported Diffusers cache, ``num_layers=0``; at the call, a processor replaced after enable,
a sequence whose image tokens (``indicator == 2``) are not one contiguous suffix of the same length
in every element or do not share one segment, fewer image tokens than ranks, and a compiled
whole forward on more than one rank (compile the blocks).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import Ideogram4Transformer2DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_ideogram4 import OUTPUT_IMAGE_INDICATOR, Ideogram4AttnProcessor

from usp_dit.distributed.comm import all_gather_uneven
from usp_dit.pipelines._checks import require
from usp_dit.pipelines._joint_split import JointSplitPlanAdapter
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, joint_attention, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import MethodWrapper, register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel
from usp_dit.pipelines.tensor import BlockCuts, Split, TensorPlan
from usp_dit.sharding.partition import offsets, split_sizes

# Arguments of the forward indexed by token on dim 1 (timestep too when it is (B, L)).
_TOKEN_ARGS = ("hidden_states", "encoder_hidden_states", "position_ids", "segment_ids", "indicator")


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None, parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn``'s signature, for Ideogram 4's ``[text part; image shard]``
    (Note [Ideogram 4's packed sequence]).

    Args:
        query, key, value: (B, T + N_local, H, D): the whole text part (T = ``state.text_len``
            rows), then this rank's image rows.
        attn_mask: (B, 1, T + N_local, T + N_local) bool, the stock segment mask of these tokens.
        parallel_config: the processor's ``Route``.

    Returns:
        (B, T + N_local, H, D): every row attended over the whole sequence as the stock mask says.
    """
    route = parallel_config
    if not isinstance(route, Route):
        raise RuntimeError(f"usp_dit's Ideogram 4 processor got parallel_config={type(route).__name__}, not its Route")
    if dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(f"usp_dit's Ideogram 4 processor runs plain attention only, got dropout_p={dropout_p}, "
                                  f"is_causal={is_causal}, attention_kwargs={attention_kwargs}")
    state = route.state
    if state.mesh.sequence_degree == 1:  # one rank holds the whole sequence: stock attention, stock mask
        return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, scale=scale, backend=backend)
    text = state.text_len
    q, k, v = query[:, text:], key[:, text:], value[:, text:]
    if not text:  # the unconditional call: the image alone, one segment (checked by the split)
        out, _ = joint_attention(q, k, v, None, None, None, None, state, scale)
        return out
    tq, tk, tv = query[:, :text], key[:, :text], value[:, :text]
    # The text keys of the image's segment, as this rank's first image query sees them (every image
    # query sees the same: they share one segment). A key mask over replicated (joint) tokens.
    valid = attn_mask[:, 0, text, :text].expand(query.shape[0], -1)
    joint_valid = valid if torch.compiler.is_compiling() or not bool(valid.all()) else None
    out, text_out = joint_attention(q, k, v, tq, tk, tv, joint_valid, state, scale)
    if joint_valid is None:
        return torch.cat([text_out, out], dim=1)
    # Text queries outside the image's segment see only text keys (the padding sees the padding):
    # stock attention on the text part, every key on this rank; rows in the image's segment come
    # from the joint call (which returns zeros for the others).
    local = dispatch_attention_fn(tq, tk, tv, attn_mask=attn_mask[:, :, :text, :text], scale=scale, backend=backend)
    text_out = torch.where(valid[:, :, None, None], text_out, local)
    return torch.cat([text_out, out], dim=1)


# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code with
# its one dispatch_attention_fn call routed to segment_attention; None if it makes no such call.
_ROUTED_CALL = with_global(Ideogram4AttnProcessor.__call__, ROUTED_NAME, segment_attention)


class USPIdeogram4AttnProcessor(RoutedProcessor):
    """``Ideogram4AttnProcessor``'s own code (projections, q/k RMSNorm, MRoPE on this rank's rows)
    on ``[text part; image shard]`` (B, T + N_local, hidden), its attention call routed to
    ``segment_attention``; returns the same rows."""

    _stock_call = _ROUTED_CALL

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _ROUTED_CALL(self, *args, **kwargs)


USPIdeogram4AttnProcessor.__call__.__signature__ = inspect.signature(Ideogram4AttnProcessor.__call__)


def text_part_length(indicator: torch.Tensor, segment_ids: torch.Tensor, num_ranks: int) -> int:
    """T: the rows before the image, whose tokens (``indicator == 2``) must be one contiguous suffix
    of the same length N in every element, all in one segment, N >= ``num_ranks``.

    Args:
        indicator, segment_ids: (B, L).

    Raises:
        NotImplementedError: another layout (the split would not be exact, or a rank would hold no
            image token to read the image's text keys from).
    """
    is_image = indicator == OUTPUT_IMAGE_INDICATOR
    counts = is_image.sum(dim=1)
    num_image = int(counts[0])
    length = indicator.shape[1]
    text = length - num_image
    require(bool((counts == num_image).all()) and bool(is_image[:, text:].all()),
            "usp_dit's Ideogram4 adapter splits a sequence whose image tokens (indicator == 2) are one contiguous "
            "suffix of the same length in every element (the pipeline's [padding; text; image])")
    if num_image < num_ranks:
        raise NotImplementedError(
            f"usp_dit's Ideogram4 adapter: {num_image} image tokens cannot be split over {num_ranks} ranks (each "
            f"rank needs one); use fewer ranks or a larger image")
    require(bool((segment_ids[:, text:] == segment_ids[:, text:text + 1]).all()),
            "usp_dit's Ideogram4 adapter splits a sequence whose image tokens share one segment_id per element")
    return text


class Ideogram4SplitForward(MethodWrapper):
    """The forward on ``[text part; this rank's image rows]`` of every per-token argument (Note
    [Ideogram 4's packed sequence]); returns (B, L, in_channels) on every rank of the group: the text
    rows as computed here, the image rows gathered."""

    def __init__(self, inner, state: ShardState) -> None:
        super().__init__(inner)
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.__signature__.bind(*args, **kwargs)
        call = bound.arguments
        for name in _TOKEN_ARGS:
            if call.get(name) is None:
                raise ValueError(f"usp_dit's Ideogram4 adapter needs {name}, got None")
        mesh = self.state.mesh
        if mesh.sequence_degree == 1:  # one rank holds every token: the stock forward as it is
            self.state.text_len = 0
            return self.inner(*bound.args, **bound.kwargs)
        length = call["hidden_states"].shape[1]
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                "usp_dit's Ideogram4 adapter reads the text part's length from indicator (a data-dependent shape): "
                "compile the blocks (transformer.compile_repeated_blocks(fullgraph=True)), not the whole forward")
        text = text_part_length(call["indicator"], call["segment_ids"], mesh.sequence_degree)
        sizes = split_sizes(length - text, mesh.sequence_degree)
        lo = text + offsets(sizes)[mesh.seq_rank]
        hi = lo + sizes[mesh.seq_rank]

        def cut(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:, :text], x[:, lo:hi]], dim=1)

        for name in _TOKEN_ARGS:
            call[name] = cut(call[name])
        if call["timestep"].dim() == 2:  # per-token time: cut like the tokens
            call["timestep"] = cut(call["timestep"])
        self.state.seq_len = length - text  # the sharded part: what every routed call's shards add up to
        self.state.text_len = text
        out = self.inner(*bound.args, **bound.kwargs)
        return _gather(out, text, sizes, mesh)


def _gather(out: Any, text: int, sizes: list[int], mesh) -> Any:
    """(B, T + N_local, C) -> (B, T + N, C), in the output's own type (tuple or output)."""
    sample = out[0] if isinstance(out, tuple) else out.sample
    whole = torch.cat([sample[:, :text], all_gather_uneven(sample[:, text:], sizes, 1, mesh.seq_group)], dim=1)
    if isinstance(out, tuple):
        return (whole,) + out[1:]
    out.sample = whole
    return out


def _routed_call_missing(transformer: Ideogram4Transformer2DModel) -> str | None:
    if _ROUTED_CALL is None:
        return f"this diffusers' Ideogram4AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


# Tensor parallelism (usp_dit.pipelines.tensor Note [tensor plans]): the attention's heads (Q/K/V
# column-parallel, to_out row-parallel; q/k RMSNorms are over head_dim: per head, exact) and the
# SwiGLU width (w1, w3 column-parallel, w2 row-parallel). The block's RMSNorms over the hidden width
# (attention_norm2, ffn_norm2) read the row-parallel outputs after their all-reduce: whole.
_TENSOR = TensorPlan((BlockCuts("layers", splits=(
    Split(columns=("attention.to_q", "attention.to_k", "attention.to_v"), rows=("attention.to_out.0",),
          heads="attention"),
    Split(columns=("feed_forward.w1", "feed_forward.w3"), rows=("feed_forward.w2",)),
)),))

PLAN = ModelPlan(
    name="Ideogram4",
    model_class=Ideogram4Transformer2DModel,
    # The forward's own arguments ("" is the transformer), cut by Ideogram4SplitForward; the image
    # rows of the final layer's output gathered after the forward.
    split_at="",
    gather_at="final_layer",
    attention=(Parallel("layers.*.attention", USPIdeogram4AttnProcessor, stock=(Ideogram4AttnProcessor,),
                        text="first"),),
    block_lists=("layers",),
    # None: with cfg_degree=2 every tensor argument whose dim 0 is the batch is split (a batch of
    # prompts over the two groups; replica_forward Note [cfg parallel]). The pipeline's guidance
    # branches are two models' calls, which nothing pairs.
    cfg_batch_args=None,
    refuse=(_routed_call_missing,),
    tensor=_TENSOR,
)

ADAPTER = register_adapter(JointSplitPlanAdapter(PLAN, __name__, Ideogram4SplitForward))
