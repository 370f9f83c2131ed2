"""Helios adapter: ``HeliosTransformer3DModel`` (Helios: chunk-by-chunk long video with multi-term
memory; its stage-1 and pyramid pipelines) on a USP grid.

Layout: latents (batch, channels, frames, height, width), the current chunk's and, for history,
short / mid / long ones; tokens (batch, seq, channels), seq = history + current, the history first
(long, mid, short: each ``patch_*(x).flatten(2)``, frame-major) and the current chunk's N tokens
last; text (batch, text_seq, channels), replicated; Q/K/V (batch, seq, heads, head_dim); the RoPE
table (batch | 1, seq, 2 * head_dim) (cos then sin); the blocks' modulation ``temb``
(batch, seq, 6, channels), one row per token (the history's at timestep 0 with
``zero_history_timestep``); ``original_context_length`` = N, an int.

Note [Helios's history tokens]
    The forward builds the whole sequence before block 0: the current chunk's patch embedding and
    RoPE, with the history's (patched at 1x, 2x and 4x coarser, their RoPE tables padded and
    average-pooled to match) concatenated in front, and one modulation row per token. Every
    block then attends over all of it at once, with no mask: ``attn1`` is plain bidirectional
    self-attention over [history; current], which ``usp_attention`` computes exactly. History
    and current tokens differ only in per-token work, told apart by ``original_context_length``:

      * ``is_amplify_history``: ``attn1`` scales the keys of the history tokens, the first
        ``seq - N`` of the sequence (``history_seq_len = hidden_states.shape[1] - N``);
      * ``guidance_cross_attn``: only the last N tokens get ``attn2`` (cross-attention to text);
        the block splits ``[seq - N, N]`` and joins the two again;
      * ``norm_out`` keeps the last N tokens (and modulation rows) and drops the history.

    The tokens are split once, at block 0's input, in the contiguous layout (rank r holds rows
    [start_r, start_r + S_r)): since the history comes first, each rank's history tokens are a
    prefix of its shard. ``HeliosBlockHook`` hands each block this rank's rows of ``temb`` and of
    the RoPE table and, as ``original_context_length``, the count of *current* tokens in the
    shard, ``S_r - clamp(H - start_r, 0, S_r)`` (H = seq - N, the history length). With that
    count the block's own arithmetic (``hidden_states.shape[1] - original_context_length``)
    gives the shard's history prefix: its keys are scaled, it skips cross-attention, exactly as
    those rows do in one process. The tokens are gathered at the last block's output
    (``"blocks.-1"``), before ``norm_out``, which then drops the history from the whole sequence
    (the final norm and ``proj_out`` run on the N current tokens on every rank: one norm and
    one linear layer). Diffusers' own ``_cp_plan`` splits and gathers around every ``attn1``,
    ``attn2`` and ``ffn`` of every block instead; this split is the same maths with one split
    and one gather a forward.

Text: replicated, and ``attn2`` (to the text) runs locally on the rank's queries with its stock
processor. Per-rank token count, Helios (Wan 2.1-14B-sized, 40 layers) at 384 x 640 with the
pipeline's defaults (9 latent frames a chunk, history 16 + 2 + 1 + the first frame): 8640
current + 1920 short + 240 mid + 240 long = 11040 tokens, 1380 per rank on 8 ranks.

Refused (NotImplementedError): processors other than the stock ``HeliosAttnProcessor`` (LoRA-
replaced, custom, Diffusers' context parallelism), a Diffusers cache that cannot run on a grid
(``usp_dit.pipelines.caches``), an ``attention_mask`` on ``attn1`` (at the call: the model passes
none), ``num_layers=0``. No Helios attention pattern needed refusing: every ``attn1`` call is full
attention over the whole sequence (the causality of Helios is the pipeline's, chunk after chunk).
"""
from __future__ import annotations

import functools

import torch
from diffusers import HeliosTransformer3DModel
from diffusers.models.transformers.transformer_helios import HeliosAttention, HeliosAttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import layout_sizes, shard_sequence

_RoutedHeliosProcessor = routed_processor_class(HeliosAttnProcessor, "_RoutedHeliosProcessor")

# HeliosTransformerBlock.forward(hidden_states, encoder_hidden_states, temb, rotary_emb, original_context_length)
_TEMB, _ROPE, _CONTEXT = ("temb", 2), ("rotary_emb", 3), ("original_context_length", 4)


class USPHeliosAttnProcessor(_RoutedHeliosProcessor or RoutedProcessor):
    """Helios self-attention (``attn1``) of this rank's shard against the whole sequence.

    Inputs: ``hidden_states`` (B, S_local, C); ``rotary_emb`` this rank's rows of the RoPE table,
    (B | 1, S_local, 2 * head_dim); ``original_context_length`` the current tokens in this shard
    (Note [Helios's history tokens]). Returns (B, S_local, C): the stock code, its attention call routed.
    """

    def __call__(
        self,
        attn: HeliosAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: torch.Tensor | None = None,
        original_context_length: int | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attn.is_cross_attention:
            raise NotImplementedError("USPHeliosAttnProcessor is for self-attention (attn1) only; attn2 runs locally")
        if attention_mask is not None:
            raise NotImplementedError("usp_dit's Helios adapter does not support an attention_mask in self-attention")
        return super().__call__(attn, hidden_states, None, None, rotary_emb, original_context_length)


def local_context_length(state: ShardState, context: int) -> int:
    """The current (non-history) tokens among this rank's, for a sequence of ``state.seq_len``
    tokens whose last ``context`` are current (Note [Helios's history tokens]).

    Raises:
        ValueError: ``context`` is not in [0, seq_len].
    """
    seq = state.seq_len
    if not 0 <= context <= seq:
        raise ValueError(f"original_context_length={context}: the sequence has {seq} tokens (history first)")
    sizes = layout_sizes(seq, state.mesh, state.layout)
    rank = state.mesh.seq_rank
    start, size = sum(sizes[:rank]), sizes[rank]
    history_here = min(max(seq - context - start, 0), size)  # the shard's history prefix
    return size - history_here


class HeliosBlockHook:
    """Note [Helios's history tokens]: a forward pre-hook on every block cuts its ``temb``
    (B, S, 6, C) and RoPE table (B | 1, S, 2D) to this rank's rows (dim 1, views) and replaces
    ``original_context_length`` by the shard's count of current tokens."""

    def __init__(self, transformer: HeliosTransformer3DModel, state: ShardState) -> None:
        if state.layout != "contiguous":  # the history must be a prefix of each shard
            raise NotImplementedError(f"usp_dit's Helios adapter needs the contiguous layout, got {state.layout!r}")
        self.state = state
        self.blocks = list(transformer.blocks)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(functools.partial(self._cut, block), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, block, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Raises ValueError for a per-token table whose length is not the token count."""
        for (name, index), per_token_dims in ((_TEMB, 4), (_ROPE, 3)):
            table = _get_arg(args, kwargs, name, index)
            if not torch.is_tensor(table) or table.dim() != per_token_dims:
                continue  # e.g. a (B, 6, C) modulation, one row per batch element: nothing to cut
            if table.shape[1] != self.state.seq_len:
                raise ValueError(f"the blocks' {name} has {table.shape[1]} rows but the sequence has "
                                 f"{self.state.seq_len} tokens: it must have one per token")
            args, kwargs = _set_arg(args, kwargs, name, index, shard_sequence(table, self.state.mesh, dim=1))
        context = _get_arg(args, kwargs, *_CONTEXT)
        if context is not None:
            args, kwargs = _set_arg(args, kwargs, *_CONTEXT, local_context_length(self.state, context))
        return args, kwargs


def _routed_call_missing(transformer: HeliosTransformer3DModel) -> str | None:
    if _RoutedHeliosProcessor is None:
        return f"this diffusers' HeliosAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="Helios",
    model_class=HeliosTransformer3DModel,
    split_at="blocks.0",
    gather_at="blocks.-1",  # before norm_out drops the history (Note [Helios's history tokens])
    attention=(
        Parallel("blocks.*.attn1", USPHeliosAttnProcessor, stock=(HeliosAttnProcessor,)),  # over [history; current]
        Local("blocks.*.attn2", stock=(HeliosAttnProcessor,)),  # cross-attention to the replicated text
    ),
    block_lists=("blocks",),
    cfg_batch_args=(
        "hidden_states", "timestep", "encoder_hidden_states", "latents_history_short", "latents_history_mid",
        "latents_history_long", "indices_hidden_states", "indices_latents_history_short",
        "indices_latents_history_mid", "indices_latents_history_long",  # (1, frames) ones stay whole
    ),
    # The Helios pipelines call the transformer once per guidance branch, differing in the text embeds.
    cfg_branch_args=("encoder_hidden_states",),
    hooks=(HeliosBlockHook,),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
