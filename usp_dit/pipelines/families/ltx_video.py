"""LTX-Video adapter: ``LTXVideoTransformer3DModel`` (LTXPipeline, image-to-video, condition pipelines) on a USP grid.

Layout: the pipeline hands the transformer packed latents, video tokens (batch, seq, channels),
``seq = frames/p_t * height/p * width/p`` frame-major (``LTXPipeline._pack_latents``); text
(batch, text_seq, caption_channels) with the prompt mask ``encoder_attention_mask`` (batch,
text_seq), 1 = real token; Q/K/V (batch, seq, heads, head_dim); the RoPE table
``self.rope(hidden_states, num_frames, height, width, ...)`` ``(cos, sin)``, each (batch, seq, inner_dim):
**the sequence on dim 1**, built from the video coordinates (the latent grid, or the pipeline's
``video_coords``) in the same frame-major order as the tokens; the timestep (batch,) or, in the
image-to-video and condition pipelines, one per token (batch, seq) (conditioning tokens at
timestep 0).

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): ``proj_in``,
the timestep embedding and the caption projection run before the first block; block 0's input is
sharded; every block, the final norm and modulation, and ``proj_out`` run on the shard;
``proj_out``'s output is gathered (the model returns tokens: the pipeline unpacks them). Two
tables follow the tokens (Note [LTX-Video's per-token tables]).

Text tokens: **replicated**, and no communication for them. LTX-Video has no joint attention:
``attn1`` is self-attention over the video tokens alone (sequence-parallel: ``usp_attention``
through the routed stock processor, ``Route(state, text="none")``), ``attn2`` is cross-attention
from the video queries to the text with the prompt mask (an additive bias built by the model's
forward). Each query of ``attn2`` reads the whole text K/V that every rank holds, so ``attn2``
runs locally on the rank's queries with its stock processor untouched. Per-rank token count,
LTX-Video 0.9 at 768 x 512 x 121 frames (16 latent frames x 16 x 24 = 6144 video tokens, 128
prompt tokens): 768 video tokens per rank on 8 ranks, plus the replicated text K/V of attn2.

Note [LTX-Video's per-token tables]
    Two inputs of the blocks are indexed by token and must be cut exactly like the tokens:

      * the RoPE table: ``rope`` returns (B, S, inner_dim) cos and sin. A forward hook on
        ``rope`` keeps this rank's rows of dim 1 (``shard_sequence``, a view), once per forward;
        every layer reuses it. (Diffusers' own ``_cp_plan`` splits the same output on the same dim.)
      * the per-token timestep of the image-to-video and condition pipelines: the model embeds
        ``timestep.flatten()`` (B * S entries) into ``temb`` (B, S, 6C), the blocks' modulation,
        and ``embedded_timestep`` (B, S, C), the final norm's shift/scale. A pre-hook on
        ``time_embed`` hands it this rank's rows of the timestep instead (B * S_local entries):
        both come out (B, S_local, ...) like the tokens, and the per-token embedding is not
        computed P times over. A timestep of one entry per batch element is left alone.

    Both hooks sit on submodules called inside the forward, so whatever wraps the forward
    (``enable_usp``'s input broadcast and cfg split) sees full tensors.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]): split at
``transformer_blocks.0``, gather at ``proj_out``, ``attn1`` parallel, ``attn2`` local, the RoPE
table a ``Table``, the per-token timestep a hook.

Refused (NotImplementedError, at enable unless noted): processors other than the stock
``LTXVideoAttnProcessor`` (custom ones, or Diffusers' context parallelism already enabled), an
attention module the plan does not name, a Diffusers cache that cannot run on a grid (FasterCache:
``usp_dit.pipelines.caches``),
``num_layers=0``, and at the call an attention mask in self-attention (the model passes none).
A timestep with neither B nor B * S entries raises ValueError. Dropout: the attention's output
dropout (``to_out[1]``) is 0 in the released configs; set, it draws each rank's mask over its own
video rows, as any per-token dropout of the shard. ``LTX2VideoTransformer3DModel`` (LTX-2) is a
different class and is not handled by this adapter.
"""
from __future__ import annotations

import torch
from diffusers import LTXVideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx import LTXAttention, LTXVideoAttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import shard_sequence

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedLTXProcessor = routed_processor_class(LTXVideoAttnProcessor, "_RoutedLTXVideoProcessor")


class USPLTXVideoAttnProcessor(_RoutedLTXProcessor or RoutedProcessor):
    """LTX-Video self-attention (``attn1``) of this rank's video shard against the whole sequence.

    Inputs: ``hidden_states`` (B, S_local, C); ``image_rotary_emb`` this rank's rows of the RoPE
    table, each (B, S_local, C) (cut by the hook on ``rope``). Returns (B, S_local, C).
    The maths is the stock ``LTXVideoAttnProcessor``'s own code, its attention call routed. The
    signature is spelled out: ``LTXAttention.forward`` passes a processor only the keyword
    arguments its ``__call__`` names.
    """

    def __call__(
        self,
        attn: LTXAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise NotImplementedError(
                "USPLTXVideoAttnProcessor is for self-attention (attn1) only; attn2 runs locally")
        if attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's LTX-Video adapter does not support an attention_mask in self-attention")
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class LTXVideoTimestepHook:
    """Note [LTX-Video's per-token tables]: a per-token timestep, cut like the tokens (the RoPE
    table is the plan's ``Table``; its hook runs first and sets this call's ``seq_len``)."""

    def __init__(self, transformer: LTXVideoTransformer3DModel, state: ShardState) -> None:
        self.state = state
        self.time_embed = transformer.time_embed
        self.handle: RemovableHandle | None = None

    def install(self) -> None:
        self.handle = self.time_embed.register_forward_pre_hook(self._shard_timestep, with_kwargs=True)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _shard_timestep(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A per-token (B * S,) timestep -> this rank's (B * S_local,); one per element is left alone.

        Raises:
            ValueError: the timestep has neither B nor B * S entries.
        """
        timestep = _get_arg(args, kwargs, "timestep", 0)
        batch = _get_arg(args, kwargs, "batch_size", 2)
        seq = self.state.seq_len
        if batch is None or timestep.numel() == batch:
            return None
        if timestep.numel() != batch * seq:
            raise ValueError(
                f"the timestep has {timestep.numel()} entries for a batch of {batch} and {seq} video tokens: "
                f"usp_dit's LTX-Video adapter takes one per batch element or one per token"
            )
        local = shard_sequence(timestep.reshape(batch, seq), self.state.mesh, dim=1)  # (B, S_local)
        return _set_arg(args, kwargs, "timestep", 0, local.flatten())


def _routed_call_missing(transformer: LTXVideoTransformer3DModel) -> str | None:
    if _RoutedLTXProcessor is None:
        return f"this diffusers' LTXVideoAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="LTX-Video",
    model_class=LTXVideoTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn1", USPLTXVideoAttnProcessor, stock=(LTXVideoAttnProcessor,)),  # self
        Local("transformer_blocks.*.attn2", stock=(LTXVideoAttnProcessor,)),  # cross-attention to the replicated text
    ),
    block_lists=("transformer_blocks",),
    # rope(...) -> (cos, sin), each (batch, seq, inner_dim): Note [LTX-Video's per-token tables].
    tables=(Table("rope", dim=1, items=(0, 1)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (LTXPipeline batches its
    # [uncond, cond] halves in one call). ``video_coords`` (B, 3, S): the condition pipeline's.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask", "video_coords"),
    hooks=(LTXVideoTimestepHook,),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
