"""Stable Audio 3 adapter: ``StableAudio3DiTModel`` (SA3 Medium, -base) on a USP grid.

Layout: latents (batch, io_channels, frames); inside the model the tokens are
(batch, M + frames / patch_size, embed_dim): the ``M = num_memory_tokens`` learned **memory
tokens** prepended to the (patched) audio frames; the cross-attention context (batch, T_ctx,
embed_dim): the projected text and duration tokens, padded positions replaced by a learned row
before the blocks (the model drops the mask there), replicated on every rank; the global
modulation (batch, 6 x embed_dim), one row per element; the RoPE table ``rotary_pos_emb(M + F)``,
(M + F, rot_dim), positions 0 .. M + F - 1 over [memory; frames]; the inpainting condition
``local_add_cond`` (batch, local_add_cond_dim, frames), one column per audio frame. Q/K/V inside
the processors are (batch, seq, heads, head_dim).

Per block (``StableAudio3DiTBlock``): AdaLN-modulated differential self-attention (two attention
calls, ``Attn(Q1, K1, V) - Attn(Q2, K2, V)``) with RMS QK-norm and partial RoPE; plain
cross-attention to the context (differential too, no mask once the model has replaced the padding);
the inpainting condition added to the audio positions; an AdaLN-modulated SwiGLU.

* ``self_attn``: sequence-parallel. The stock ``StableAudio3SelfAttnProcessor`` calls
  ``dispatch_attention_fn`` twice; both calls are routed (``_routing`` Note [routing a stock
  processor's attention call]) with the stock code, projections, norms and RoPE untouched.
  The RoPE table is a submodule's output (``Table("rotary_pos_emb")``): cut like the tokens
  where it is made, so ``_apply_rotary_partial``'s ``freqs[-S_local:]`` takes all of this rank's rows.
* ``cross_attn``: from this rank's tokens to the replicated context: ``Local``, no communication.
* The modulation is one row per element, the same for every token: used whole on each rank.

The memory tokens: **split with the sequence**, not replicated. They are ordinary tokens of the
stream (queries, keys, RoPE positions 0 .. M - 1, the same norms and feed-forward), so they are
cut with the frames at block 0's input; with M = 64 beside a few thousand frames they sit on the
first rank(s). Two places know where the memory ends, and both are made to see this rank's part:

Note [Stable Audio 3's memory boundary on a shard]
    (1) The blocks add the inpainting condition to ``hidden_states[:, num_memory_tokens:]``, with
    ``local_seq`` (batch, frames, C) over every frame. A pre-hook on every block gives it this
    rank's view: of its global token range [lo, hi), the first ``m = clamp(M - lo, 0, hi - lo)``
    are memory, so ``num_memory_tokens = m`` and ``local_seq`` = frames [max(lo - M, 0), max(hi - M, 0)):

        tokens   |mem mem mem|f0 f1 f2 f3 f4 ...|
        rank 0   |mem mem|                           m = 2, local_seq[:, 0:0]
        rank 1           |mem|f0 f1|                 m = 1, local_seq[:, 0:2]
        rank 2                     |f2 f3 f4|        m = 0, local_seq[:, 2:5]

    (2) The model drops the memory tokens (``x[:, M:]``) after the last block: the tokens are
    gathered at the last block's output (``gather_at="transformer_blocks.-1"``), not at
    ``proj_out``, so that slice, ``proj_out`` and the post-conv run on the whole sequence, as stock.

When splitting pays: audio sequences are short. SA3's SAME autoencoder makes about 11 latent
frames a second at 44.1 kHz (4096 samples a frame), so even the longest generation (384 s) is
about 4130 frames + 64 memory tokens (1050 a rank on 4, 525 on 8) at the class defaults (24 heads
x 64, 24 layers); a 30-60 s clip is about 390-710 tokens. Below a couple of thousand tokens the all-to-alls' latency
is a large part of a rank's attention: the split is for memory (fine-tuning, long clips, batches)
and latency of the longest clips; ``cfg_degree=2`` (base checkpoint, guidance on) pays first.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]). The three
pipelines (text-to-audio, audio-to-audio, inpainting) batch [uncond, cond] in one call when
``guidance_scale > 1``: ``cfg_degree=2`` splits it; the distilled checkpoint (guidance off) makes one
call a step on its batch of prompts.

Refused (NotImplementedError): at enable, processors other than the stock ones (LoRA-replaced or
custom), attention modules the plan does not name, an unsupported Diffusers cache, ``depth=0``,
blocks other than stock ``StableAudio3DiTBlock``s; at the call, an inpainting condition whose
frames are not the call's tokens less its memory tokens.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from diffusers import StableAudio3DiTModel
from diffusers.models.transformers.transformer_stable_audio3 import (
    StableAudio3CrossAttnProcessor,
    StableAudio3DiTBlock,
    StableAudio3SelfAttnProcessor,
)
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import layout_sizes

USPStableAudio3SelfAttnProcessor = routed_processor_class(StableAudio3SelfAttnProcessor)

# StableAudio3DiTBlock.forward(hidden_states, context, global_modulation, rope, context_mask, local_seq,
# num_memory_tokens): positions, for the gradient-checkpointing call, which passes them all positionally.
_BLOCK_ARGS = list(inspect.signature(StableAudio3DiTBlock.forward).parameters)[1:]
_LOCAL_SEQ, _NUM_MEMORY = _BLOCK_ARGS.index("local_seq"), _BLOCK_ARGS.index("num_memory_tokens")


def memory_split(lo: int, hi: int, num_memory: int) -> tuple[int, slice]:
    """Note [Stable Audio 3's memory boundary on a shard]: a rank holding tokens [lo, hi) of
    [memory (``num_memory``); frames]: (how many of them are memory tokens, the frames it holds as a
    slice of the frame axis)."""
    memory = min(max(num_memory - lo, 0), hi - lo)
    return memory, slice(max(lo - num_memory, 0), max(hi - num_memory, 0))


@dataclass(eq=False)
class MemoryBoundaryHooks:
    """A pre-hook on every block: ``local_seq`` (B, frames, C) -> this rank's frames and
    ``num_memory_tokens`` -> this rank's memory count (Note [Stable Audio 3's memory boundary on a
    shard]); nothing to do when the call has no inpainting condition."""

    transformer: torch.nn.Module
    state: ShardState
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        for block in self.transformer.transformer_blocks:
            self.handles.append(block.register_forward_pre_hook(self._cut, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Raises ValueError when ``local_seq``'s frames are not the call's tokens less its memory."""
        local_seq = _get_arg(args, kwargs, "local_seq", _LOCAL_SEQ)
        if local_seq is None:
            return args, kwargs
        num_memory = _get_arg(args, kwargs, "num_memory_tokens", _NUM_MEMORY) or 0
        seq_len = self.state.seq_len
        if local_seq.shape[1] != seq_len - num_memory:
            raise ValueError(
                f"local_add_cond has {local_seq.shape[1]} frames but the transformer has {seq_len} tokens, "
                f"{num_memory} of them memory tokens: they must match for it to be cut like the tokens"
            )
        mesh = self.state.mesh
        sizes = layout_sizes(seq_len, mesh, self.state.layout)
        lo = sum(sizes[:mesh.seq_rank])
        memory, frames = memory_split(lo, lo + sizes[mesh.seq_rank], num_memory)
        args, kwargs = _set_arg(args, kwargs, "local_seq", _LOCAL_SEQ, local_seq[:, frames])
        if "num_memory_tokens" in kwargs or len(args) > _NUM_MEMORY:
            return _set_arg(args, kwargs, "num_memory_tokens", _NUM_MEMORY, memory)
        return args, {**kwargs, "num_memory_tokens": memory}


def _blocks_reason(model: StableAudio3DiTModel) -> str | None:
    for i, block in enumerate(model.transformer_blocks):
        if type(block) is not StableAudio3DiTBlock:
            return f"transformer_blocks.{i} is {type(block).__name__}, not StableAudio3DiTBlock"
    return None


def _routed_call_missing(model: torch.nn.Module) -> str | None:
    if USPStableAudio3SelfAttnProcessor is None:
        return "this diffusers' StableAudio3SelfAttnProcessor does not call dispatch_attention_fn, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="StableAudio3",
    model_class=StableAudio3DiTModel,
    split_at="transformer_blocks.0",  # [memory; frames] exists whole here
    # The last block's output: the memory tokens are dropped after it (Note [Stable Audio 3's memory boundary]).
    gather_at="transformer_blocks.-1",
    attention=(
        Parallel("transformer_blocks.*.self_attn", USPStableAudio3SelfAttnProcessor or StableAudio3SelfAttnProcessor,
                 stock=(StableAudio3SelfAttnProcessor,)),
        Local("transformer_blocks.*.cross_attn", stock=(StableAudio3CrossAttnProcessor,)),
    ),
    block_lists=("transformer_blocks",),
    tables=(Table("rotary_pos_emb", dim=0),),  # (M + F, rot_dim), made before block 0
    # The three pipelines batch [uncond, cond] in one call when guidance_scale > 1.
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "global_hidden_states",
                    "encoder_attention_mask", "local_add_cond"),
    hooks=(MemoryBoundaryHooks,),
    refuse=(_blocks_reason, _routed_call_missing),
    heads=lambda model: model.config.num_heads,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
