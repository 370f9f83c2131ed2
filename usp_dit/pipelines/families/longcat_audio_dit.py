"""LongCat-AudioDiT adapter: ``LongCatAudioDiTTransformer`` (LongCat-AudioDiT 1B, text-to-audio) on a USP grid.

Layout: audio latents (batch, frames, latent_dim), one token per latent frame (no patchify);
audio tokens (batch, seq, dim); the audio mask ``attention_mask`` (batch, seq) bool; the text
(UMT5) states (batch, text_seq, text_dim) with ``encoder_attention_mask`` (batch, text_seq);
Q/K/V (batch, seq, heads, head_dim); the audio RoPE table ``rope`` ``(cos, sin)``, each (seq,
head_dim), and the text's ``cond_rope`` (text_seq, head_dim), both passed to every block.

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the text
embedder and its ConvNeXt stack (``text_conv_layer``: depthwise convolutions and a GRN over the
*text* sequence, replicated, so whole on every rank), the audio and latent-condition embedders
(per frame) and the time embedding run whole on every rank; ``blocks.0``'s input is sharded and
the last block's output (``blocks.-1``) is gathered: the long skip (``hidden_states + residual``,
the residual being block 0's whole input), ``norm_out``, ``proj_out`` and the final mask then run
whole, exactly as in one process (they are per token and narrow; splitting them would need the
residual cut too). ``LongCatBlockHooks`` hands every block this rank's rows of ``rope`` and of the
audio mask (used by the stock code as a key mask in self-attention and as an output multiplier in
both attentions).

Text: a separate stream, replicated, read only as keys of cross-attention (``blocks.*.cross_attn``:
``Local``, the stock processor on this rank's audio queries with the text key mask, per element,
as stock); its length-normalised mean feeds the global AdaLN (per element, whole on every rank).
Self-attention (``blocks.*.self_attn``) is over the audio tokens alone: the stock processor's code
with its ``dispatch_attention_fn`` call routed to ``usp_attention``. Per-rank tokens, LongCat's
longest clip (30 s at 24 kHz, 2048x VAE): 351 audio tokens, 44 a rank on 8.

Note [LongCat-AudioDiT's audio mask]
    ``attention_mask`` marks valid audio frames. ``LongCatAudioDiTPipeline`` gives every element the
    same duration, so its mask is all True; a mask with padded frames would be a key mask over the
    audio tokens, which ``usp_attention`` cannot apply on a grid. A call whose mask has a False is
    refused at block 0 (NotImplementedError, on every rank alike: the mask is the same everywhere)
    instead of attending to the padded frames (compiled: the same check as an op of the graph). An
    all-True mask is cut like the tokens for cross-attention's stock code (an output multiplier) and
    not passed to self-attention, where it masks nothing and multiplies by ones.

CFG: the pipeline calls the transformer twice a step (prompt, then negative prompt: zeros or its
own embeds, possibly of another length), differing in ``encoder_hidden_states`` and
``encoder_attention_mask``: ``cfg_branch_args``, so ``cfg_degree=2`` runs both calls of a step at
once on the two cfg groups (``usp_dit.pipelines.cfg_pair``).

Refused (NotImplementedError): at enable, processors other than the stock
``AudioDiTSelfAttnProcessor`` / ``AudioDiTCrossAttnProcessor`` (LoRA-replaced, custom, Diffusers'
context parallelism), an unsupported Diffusers cache, ``dit_depth=0``; at the call, an audio mask
with padded frames (above).
"""
from __future__ import annotations

import functools

import torch
from diffusers import LongCatAudioDiTTransformer
from diffusers.models.transformers.transformer_longcat_audio_dit import (
    AudioDiTAttention,
    AudioDiTCrossAttnProcessor,
    AudioDiTSelfAttnProcessor,
)
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._checks import require
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, local_rope
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import shard_sequence

_RoutedSelfAttnProcessor = routed_processor_class(AudioDiTSelfAttnProcessor, "_RoutedAudioDiTSelfAttnProcessor")


class USPLongCatSelfAttnProcessor(_RoutedSelfAttnProcessor or RoutedProcessor):
    """A block's self-attention: this rank's audio tokens against every audio token of the grid.

    Inputs: ``hidden_states`` (B, S_local, dim); ``attention_mask`` this rank's columns of the
    all-True audio mask (B, S_local), or ``None``: not used; ``audio_rotary_emb`` this rank's rows ``(cos, sin)``, each
    (S_local, head_dim) (both cut by ``LongCatBlockHooks``). Returns (B, S_local, dim): the stock
    processor's code, its attention call routed.
    """

    def __call__(
        self,
        attn: AudioDiTAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        audio_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # The mask is all True (checked at block 0: Note [LongCat-AudioDiT's audio mask]): without it the
        # stock code computes the same attention and skips a multiplication by ones, and the routed
        # call gets no key mask over the audio tokens to inspect.
        return super().__call__(attn, hidden_states, None, audio_rotary_emb)


class LongCatBlockHooks:
    """A forward pre-hook on every block (``AudioDiTBlock.forward`` takes keywords from the model):
    this rank's rows of ``rope`` (``local_rope``) and of ``mask`` (B, S) -> (B, S_local); at block 0,
    Note [LongCat-AudioDiT's audio mask]."""

    def __init__(self, transformer: LongCatAudioDiTTransformer, state: ShardState) -> None:
        self.state = state
        self.blocks = list(transformer.blocks)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for i, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(functools.partial(self._cut, i == 0), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, first: bool, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Raises NotImplementedError for positional arguments or a mask with padded frames; ValueError
        for a table or mask of another length than the tokens."""
        if args[1:]:
            raise NotImplementedError("usp_dit's LongCat-AudioDiT adapter: a block called with positional arguments")
        mask = kwargs.get("mask")
        if mask is not None:
            if mask.shape[1] != self.state.seq_len:
                raise ValueError(f"attention_mask has {mask.shape[1]} frames but the latent has {self.state.seq_len}")
            if first:  # compiled: the same check as an op of the graph (usp_dit.pipelines._checks)
                require(mask.all(), "usp_dit's LongCat-AudioDiT adapter: attention_mask marks padded audio frames, a "
                                    "key mask over the audio tokens, which usp_attention cannot apply on a grid "
                                    "(LongCatAudioDiTPipeline's is all True)")
            mask = shard_sequence(mask, self.state.mesh, dim=1, layout=self.state.layout)
        rope = local_rope(kwargs.get("rope"), self.state, "rope")
        return args, {**kwargs, "mask": mask, "rope": rope}


def _routed_call_missing(transformer: LongCatAudioDiTTransformer) -> str | None:
    if _RoutedSelfAttnProcessor is None:
        return f"this diffusers' AudioDiTSelfAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="LongCat-AudioDiT",
    model_class=LongCatAudioDiTTransformer,
    split_at="blocks.0",
    gather_at="blocks.-1",  # the long skip, norm_out, proj_out and the final mask: whole
    attention=(
        Parallel("blocks.*.self_attn", USPLongCatSelfAttnProcessor, stock=(AudioDiTSelfAttnProcessor,)),
        Local("blocks.*.cross_attn", stock=(AudioDiTCrossAttnProcessor,)),  # to the replicated text
    ),
    block_lists=("blocks",),
    cfg_branch_args=("encoder_hidden_states", "encoder_attention_mask"),
    hooks=(LongCatBlockHooks,),
    refuse=(_routed_call_missing,),
    heads=lambda model: model.config.dit_heads,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
