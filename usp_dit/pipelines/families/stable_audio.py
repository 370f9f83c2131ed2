"""Stable Audio adapter: ``StableAudioDiTModel`` (Stable Audio Open 1.0) on a USP grid.

Layout: latents (batch, in_channels, frames), one token per latent frame; inside the model the
tokens are (batch, 1 + frames, channels): the **global token** (the projected start/end-seconds
embedding plus the timestep embedding, ``global_hidden_states`` (batch, 1, global_dim)) prepended
to the audio frames; T5 text plus the two seconds tokens (batch, text_len, cross_attention_input_dim)
for cross-attention, replicated on every rank; the RoPE table the pipeline passes as
``rotary_embedding``: ``(cos, sin)``, each (1 + frames, attention_head_dim // 2) (partial RoPE: the
first half of every head's channels), covering the global token at position 0 too; inside
``StableAudioAttnProcessor2_0`` Q/K/V are (batch, heads, seq, head_dim).

Per block (``StableAudioDiTBlock``, pre-LayerNorm, no modulation):

* ``attn1``: self-attention over [global; frames] with partial RoPE: sequence-parallel. The stock
  ``StableAudioAttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` directly; its own code
  runs with ``F`` rebound to SD3's routed namespace (``usp_dit.pipelines.families.sd3`` Note [SD3's
  attention call]): projections and RoPE are stock's on this rank's rows, only the attention call
  goes to ``usp_attention`` (Ulysses x Ring, no joint tokens). The RoPE table reaches the
  processor whole and is cut there with ``local_rope`` (row i rotates token i, the global token's
  row 0 included), exactly like the tokens.
* ``attn2``: cross-attention (GQA: ``num_key_value_attention_heads`` K/V heads) from this rank's
  tokens to the replicated text, with its optional text mask: every query row needs all the keys
  and nothing else, so the stock processor runs unchanged on the shard (``Local``).
* ``ff`` (SwiGLU) and the norms are per token.

The global token: **split with the sequence**, not replicated. It is one more token through the
same per-token work (norms, both attentions, feed-forward) with its own RoPE position, so it is
cut with the frames at block 0's input (rank 0 holds it) and gathered with them at ``proj_out``'s
output, before the model drops it (``[:, :, 1:]``); nothing special is done for it.

Where the tokens are split: ``transformer_blocks.0``'s input, gathered at ``proj_out``'s output
(``_token_sharding`` Note [where the sequence is split]); the 1x1 pre/post convolutions run whole.

When splitting pays: audio sequences are short. Stable Audio Open 1.0 has ``sample_size=1024``
latent frames (about 47 s at 44.1 kHz) and the pipeline always generates that many: 1 + 1024 =
1025 tokens (257 a rank on 4, 129 on 8), 24 heads x 64, 24 layers. At that length each rank's
attention is small and the all-to-alls' latency is a large part of it: the sequence split is for
memory (fine-tuning, large batches of waveforms) or a modest latency cut on NVLink (Ulysses 2),
not for throughput. ``cfg_degree=2`` (the [uncond, cond] halves on two groups, one all-gather of
the output a step) is the axis that pays first for inference.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]).
``StableAudioPipeline`` batches [uncond, cond] in one call: ``cfg_degree=2`` splits it (the
timestep, one for the batch, and the RoPE table stay whole).

Refused (NotImplementedError): at enable, processors other than the stock
``StableAudioAttnProcessor2_0`` (LoRA-replaced or custom), attention modules the plan does not
name, an unsupported Diffusers cache, ``num_layers=0``; at the call, ``attention_mask`` (a mask
over the audio tokens, which attn1 would apply to its shard; no pipeline passes one) and a RoPE
table that is not a ``(cos, sin)`` pair with one row per token.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from diffusers import StableAudioDiTModel
from diffusers.models.attention_processor import Attention, StableAudioAttnProcessor2_0

import usp_dit.pipelines.families.sd3 as sd3  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._routing import Route, with_global
from usp_dit.pipelines._token_sharding import ShardState, local_rope
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter

_ROUTED_GLOBAL = "F"  # StableAudioAttnProcessor2_0 calls F.scaled_dot_product_attention (torch.nn.functional as F)
_ROPE = "rotary_embedding"  # the transformer's argument: the (cos, sin) table over [global; frames]


def _routed_call(route: Route) -> Any:
    """``StableAudioAttnProcessor2_0.__call__``'s code with ``F`` bound to SD3's ``_RoutedFunctional(route)``,
    or ``None`` when that code no longer reads ``F``."""
    return with_global(StableAudioAttnProcessor2_0.__call__, _ROUTED_GLOBAL, sd3._RoutedFunctional(route))


class USPStableAudioSelfAttnProcessor:
    """``attn1`` of this rank's tokens: self-attention over every token of [global; frames].

    Inputs (as ``Attention.forward`` passes them): ``hidden_states`` (B, S_local, C); ``rotary_emb``
    the whole ``(cos, sin)`` table, each (S, rot_dim), cut here to this rank's rows; no text, no
    mask. Returns (B, S_local, C): stock's rows for this rank's tokens.
    """

    def __init__(self, state: ShardState) -> None:
        self.state = state
        self.route = Route(state, "none")
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPStableAudioSelfAttnProcessor:
        # Rebuild the routed function around the copied state (sd3 Note [SD3's attention call]).
        clone = type(self)(copy.deepcopy(self.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's Stable Audio adapter runs attn1 as unmasked self-attention over the audio tokens; it got "
                f"encoder_hidden_states={'given' if encoder_hidden_states is not None else None}, "
                f"attention_mask={'given' if attention_mask is not None else None}"
            )
        rope = local_rope(rotary_emb, self.state, _ROPE)
        return self._call(self, attn, hidden_states, None, None, rope)


def _routed_call_missing(model: torch.nn.Module) -> str | None:
    if _routed_call(Route(None)) is None:
        return (f"this diffusers' StableAudioAttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


PLAN = ModelPlan(
    name="StableAudio",
    model_class=StableAudioDiTModel,
    split_at="transformer_blocks.0",  # [global; frames] exists whole here (module docstring)
    gather_at="proj_out",  # before the global token is dropped and the post-conv runs
    attention=(
        Parallel("transformer_blocks.*.attn1", USPStableAudioSelfAttnProcessor, stock=(StableAudioAttnProcessor2_0,)),
        Local("transformer_blocks.*.attn2", stock=(StableAudioAttnProcessor2_0,)),  # to the replicated text
    ),
    block_lists=("transformer_blocks",),
    # StableAudioPipeline batches [uncond, cond] in one call (its timestep (1,) and the RoPE table stay whole).
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "global_hidden_states",
                    "encoder_attention_mask"),
    refuse=(_routed_call_missing,),
    refuse_args={"attention_mask": "a mask over the audio tokens, which attn1 would apply to its shard"},
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
