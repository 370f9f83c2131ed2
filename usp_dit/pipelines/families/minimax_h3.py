"""MiniMax-H3 adapter: ``MiniMaxH3Transformer3DModel`` (MiniMax-H3, 33B: joint video + audio from
text, one packed sequence) on a USP grid.

Layout: one packed sequence (batch, seq, hidden) holding every modality's rows (text, conditioning
and target video, audio) at the positions ``text_indices`` / ``video_indices`` / ``audio_indices``
give, each (n,); per-row vectors (seq,): ``token_tags`` (0 video, 1 text, 2 audio),
``timestep_indices`` and the blocks' ``adaln_indices`` (= timestep_indices * 3 + token_tags); the
RoPE table ``(cos, sin)``, each (seq, 6 * rope_freq_dim); Q/K/V (batch, seq, heads, head_dim);
``temb`` (num_timesteps, time_embed_dim), one row per distinct timestep (not per token).

Note [MiniMax-H3's packed sequence]
    The forward builds the packed sequence whole before block 0: the text is refined on its own
    (``token_refiner``: plain self-attention over the text alone, replicated on every rank, its
    attention ``Local``), then the three modalities' projections are scattered into one buffer by
    sequence-wide indices. Every block then runs full self-attention over all of it, with no mask
    (the model passes none): ``usp_attention`` over the shards, text included as ordinary tokens
    (it is not a separate stream here). The tokens are split at block 0's input; what is indexed
    by row is cut like them:

      * the RoPE table, ``rope``'s output, on dim 0 (the plan's ``Table``);
      * ``adaln_indices``, an argument of every block (``MiniMaxH3RowHooks``: each block's copy,
        as Diffusers' ``_cp_plan`` does) -- each rank's rows pick their own (timestep, modality)
        modulation rows from the whole (small) table every block computes from ``temb``;
      * ``timestep_indices`` of ``norm_out`` (``MiniMaxH3RowHooks``).

    Both output heads run on the shard and are gathered (``proj_out`` by the plan, ``audio_proj_out``
    by ``MiniMaxH3RowHooks``): their widths (video patch, audio channels) are the narrowest in the
    model, the cheapest gather. The forward then selects the video and audio rows from the whole
    sequence with its sequence-wide indices, exactly as in one process. This is Diffusers' own
    ``_cp_plan`` for the class, with one split and two gathers a forward.

Text: part of the packed sequence and split with it (it runs through the same blocks, per-row
modulation, as the video). Batch: the structural arguments (timesteps, indices, tags, positions)
describe one layout every batch element shares (the model's own contract). The stock pipeline
(``MiniMaxH3`` modular blocks) is guidance-distilled: one transformer call a step, no CFG batch.

FSDP2 units (``shard_weights=True``): the blocks of ``transformer_blocks``; the token refiner's
two blocks stay in the root unit with the embeddings and heads.

Per-rank token count, MiniMax-H3's default canvas (768 x 1344) and length (124 frames), as the stock
``MiniMaxH3PrepareLayoutStep`` packs it: 37 latent frames x 24 x 42 patches = 37296 video rows +
414 audio rows + the prompt's rows (a few hundred) ~ 38000 rows: ~4750 per rank on 8 ranks.

Refused (NotImplementedError): processors other than the stock ``MiniMaxH3AttnProcessor`` (LoRA-
replaced, custom, Diffusers' context parallelism), a Diffusers cache that cannot run on a grid
(``usp_dit.pipelines.caches``), an ``attention_mask`` on a block's attention (at the call: the
model passes none; a mask over the packed rows would be a mask over video tokens), ``num_layers=0``.
"""
from __future__ import annotations

import functools

import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Attention, MiniMaxH3AttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import gather_sequence, shard_sequence

_RoutedMiniMaxH3Processor = routed_processor_class(MiniMaxH3AttnProcessor, "_RoutedMiniMaxH3Processor")

# MiniMaxH3TransformerBlock.forward(hidden_states, temb, adaln_indices, rotary_emb, attention_mask);
# MiniMaxH3AdaLayerNormOut.forward(hidden_states, temb, timestep_indices).
_ADALN_INDICES = ("adaln_indices", 2)
_TIMESTEP_INDICES = ("timestep_indices", 2)


class USPMiniMaxH3AttnProcessor(_RoutedMiniMaxH3Processor or RoutedProcessor):
    """A block's self-attention: this rank's rows of the packed sequence against all of it.

    Inputs: ``hidden_states`` (B, S_local, hidden); ``rotary_emb`` this rank's rows of the RoPE
    table, each (S_local, 6 * rope_freq_dim). Returns (B, S_local, hidden): the stock processor's
    code, its attention call routed to ``usp_attention``.
    """

    def __call__(
        self,
        attn: MiniMaxH3Attention,
        hidden_states: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's MiniMax-H3 adapter does not support an attention_mask in transformer_blocks.*.attn "
                "(a mask over the packed rows is a mask over video tokens; the stock model passes none)"
            )
        return super().__call__(attn, hidden_states, rotary_emb, None)


class MiniMaxH3RowHooks:
    """Note [MiniMax-H3's packed sequence]: forward pre-hooks cutting each block's ``adaln_indices``
    and ``norm_out``'s ``timestep_indices`` (seq,) to this rank's rows (dim 0, like the tokens), and
    a forward hook gathering ``audio_proj_out``'s (B, S_local, C) output to (B, S, C)."""

    def __init__(self, transformer: MiniMaxH3Transformer3DModel, state: ShardState) -> None:
        self.state = state
        self.cuts = [(block, _ADALN_INDICES) for block in transformer.transformer_blocks]
        self.cuts.append((transformer.norm_out, _TIMESTEP_INDICES))
        self.audio_head = transformer.audio_proj_out
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for module, arg in self.cuts:
            self.handles.append(module.register_forward_pre_hook(functools.partial(self._cut, arg), with_kwargs=True))
        self.handles.append(self.audio_head.register_forward_hook(self._gather))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, arg: tuple[str, int], module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Raises ValueError for a per-row vector whose length is not the token count."""
        rows = _get_arg(args, kwargs, *arg)
        if rows.shape[0] != self.state.seq_len:
            raise ValueError(f"{arg[0]} has {rows.shape[0]} rows but the packed sequence has {self.state.seq_len} "
                             f"tokens: it must have one per row")
        return _set_arg(args, kwargs, *arg, shard_sequence(rows, self.state.mesh, dim=0, layout=self.state.layout))

    def _gather(self, module, args: tuple, out_local: torch.Tensor) -> torch.Tensor:
        return gather_sequence(out_local, self.state.mesh, dim=1, seq_len=self.state.seq_len, layout=self.state.layout)


def _routed_call_missing(transformer: MiniMaxH3Transformer3DModel) -> str | None:
    if _RoutedMiniMaxH3Processor is None:
        return f"this diffusers' MiniMaxH3AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="MiniMax-H3",
    model_class=MiniMaxH3Transformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",  # audio_proj_out: MiniMaxH3RowHooks
    attention=(
        Parallel("transformer_blocks.*.attn", USPMiniMaxH3AttnProcessor, stock=(MiniMaxH3AttnProcessor,)),
        Local("token_refiner.refiner_blocks.*.attn", stock=(MiniMaxH3AttnProcessor,)),  # the text alone, whole
    ),
    block_lists=("transformer_blocks",),
    tables=(Table("rope", dim=0, items=(0, 1)),),  # (cos, sin), each (seq, 6 * rope_freq_dim)
    hooks=(MiniMaxH3RowHooks,),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
