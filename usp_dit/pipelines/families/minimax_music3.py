"""MiniMax Music 3 adapter: ``MiniMaxMusic3Transformer1DModel`` (the flow-matching DiT of MiniMax Music 3) on a USP grid.

Layout: Flow-VAE latents (batch, in_channels, frames) and the frame-aligned condition
(batch, frames, condition_dim) from the language-model stage; after a pointwise (kernel 1)
``preprocess_conv`` and ``proj_in``: tokens (batch, 1 + frames, inner_dim), the timestep embedding
prepended as token 0; Q/K/V (batch, 1 + frames, heads, head_dim); the partial RoPE table
``rotary_emb(1 + frames)`` ``(cos, sin)``, each (1 + frames, rotary_dim).

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the pointwise
convolutions, ``proj_in`` and the time embedding run whole on every rank (kernel 1: no token
mixing); ``transformer_blocks.0``'s input, the whole ``[time token; frames]`` sequence, is sharded;
the last block's output (``transformer_blocks.-1``) is gathered, so the drop of the time token,
``proj_out`` and the pointwise ``postprocess_conv`` run whole, exactly as in one process. The RoPE
table is ``rotary_emb``'s output, cut on dim 0 like the tokens (the plan's ``Table``).

Note [MiniMax Music 3's time token]
    The timestep embedding is a token of the sequence, not a separate stream: every block runs
    the same per-token work on it (norms, feed-forward, RoPE at position 0) and it is a query and
    a key of the one self-attention, with no mask. So it is **split with the frames**: it is row 0
    of the sequence and sits on the first rank's shard (one token of imbalance at most, as any
    uneven split). Replicating it would make every rank compute it, for nothing.

There is no other stream: the condition is added on channels, frame by frame, before the split,
and ``transformer_blocks.*.attn`` is the model's only attention (self-attention over every token):
the stock processor's code with its ``dispatch_attention_fn`` call routed to ``usp_attention``.
Per-rank tokens: 1 + frames (the Flow-VAE's latent rate times the clip's length) over P.

CFG: Diffusers ships MiniMax Music 3 as modular blocks whose guider calls the transformer once per
branch, the unconditional branch with zeros for ``encoder_hidden_states``: ``cfg_branch_args``, so
``cfg_degree=2`` runs both calls of a step at once on the two cfg groups
(``usp_dit.pipelines.cfg_pair``). ``pipe.enable_usp()`` wraps ``DiffusionPipeline`` s only: enable
the transformer (``usp_dit.enable_usp(pipe.transformer, mesh=...)``).

Refused (NotImplementedError): at enable, processors other than the stock
``MiniMaxMusic3AttnProcessor`` (LoRA-replaced, custom, Diffusers' context parallelism), an
unsupported Diffusers cache, ``num_layers=0``.
"""
from __future__ import annotations

import torch
from diffusers import MiniMaxMusic3Transformer1DModel
from diffusers.models.transformers.transformer_minimax_music3 import (
    MiniMaxMusic3Attention,
    MiniMaxMusic3AttnProcessor,
)

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, Table

_RoutedMusic3Processor = routed_processor_class(MiniMaxMusic3AttnProcessor, "_RoutedMiniMaxMusic3Processor")


class USPMiniMaxMusic3AttnProcessor(_RoutedMusic3Processor or RoutedProcessor):
    """A block's self-attention: this rank's rows of ``[time token; frames]`` against all of them.

    Inputs: ``hidden_states`` (B, S_local, inner_dim); ``rotary_emb`` this rank's rows ``(cos,
    sin)``, each (S_local, rotary_dim) (cut by the plan's ``Table``). Returns (B, S_local,
    inner_dim): the stock processor's code, its attention call routed.
    """

    def __call__(
        self, attn: MiniMaxMusic3Attention, hidden_states: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        return super().__call__(attn, hidden_states, rotary_emb)


def _routed_call_missing(transformer: MiniMaxMusic3Transformer1DModel) -> str | None:
    if _RoutedMusic3Processor is None:
        return f"this diffusers' MiniMaxMusic3AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="MiniMax-Music3",
    model_class=MiniMaxMusic3Transformer1DModel,
    split_at="transformer_blocks.0",  # [time token; frames]: Note [MiniMax Music 3's time token]
    gather_at="transformer_blocks.-1",  # the time token dropped, proj_out and postprocess_conv: whole
    attention=(Parallel("transformer_blocks.*.attn", USPMiniMaxMusic3AttnProcessor, stock=(MiniMaxMusic3AttnProcessor,)),),
    block_lists=("transformer_blocks",),
    tables=(Table("rotary_emb", dim=0, items=(0, 1)),),  # (cos, sin), each (1 + frames, rotary_dim)
    cfg_branch_args=("encoder_hidden_states",),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
