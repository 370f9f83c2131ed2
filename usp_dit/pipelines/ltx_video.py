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

Refused (NotImplementedError, at enable unless noted): processors other than the stock
``LTXVideoAttnProcessor`` (custom ones, or Diffusers' context parallelism already enabled), a
Diffusers cache (``enable_cache``: its skip decisions would be taken per rank on a shard),
``num_layers=0``, and at the call an attention mask in self-attention (the model passes none).
A timestep with neither B nor B * S entries raises ValueError. Dropout: the attention's output
dropout (``to_out[1]``) is 0 in the released configs; set, it draws each rank's mask over its own
video rows, as any per-token dropout of the shard. ``LTX2VideoTransformer3DModel`` (LTX-2) is a
different class and is not handled by this adapter.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import LTXVideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx import LTXAttention, LTXVideoAttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.mesh import USPMesh
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import PatchingAdapter, ShardState, TokenShardHooks, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.sharding import shard_sequence

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


class LTXVideoTableHooks:
    """Note [LTX-Video's per-token tables]: the RoPE table and a per-token timestep, cut like the tokens."""

    def __init__(self, state: ShardState, rope: torch.nn.Module, time_embed: torch.nn.Module) -> None:
        self.state = state
        self.rope, self.time_embed = rope, time_embed
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        self.handles.append(self.rope.register_forward_hook(self._shard_rope))
        self.handles.append(self.time_embed.register_forward_pre_hook(self._shard_timestep, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _shard_rope(self, module, args: tuple, table: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (B, S, C) -> (B, S_local, C); records S as this call's ``seq_len``."""
        pair = isinstance(table, tuple) and len(table) == 2
        if not (pair and all(torch.is_tensor(t) and t.dim() == 3 for t in table)):
            raise NotImplementedError(
                f"usp_dit's LTX-Video adapter expects rope to return (cos, sin), each (batch, seq, dim); "
                f"got {type(table).__name__}"
            )
        # Block 0's pre-hook sets the same value from the tokens; the timestep hook runs before it.
        self.state.seq_len = table[0].shape[1]
        return tuple(shard_sequence(t, self.state.mesh, dim=1) for t in table)

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


class _Patch:
    """Everything ``enable`` changed on one transformer, and how to undo it."""

    def __init__(self, transformer: LTXVideoTransformer3DModel, mesh: USPMesh, backend: str) -> None:
        self.state = ShardState(mesh, backend)
        self.self_attentions = [block.attn1 for block in transformer.transformer_blocks]
        self.original_processors = [attn.processor for attn in self.self_attentions]
        self.tables = LTXVideoTableHooks(self.state, transformer.rope, transformer.time_embed)
        self.tokens = TokenShardHooks(self.state, transformer.transformer_blocks[0], transformer.proj_out)

    def install(self) -> None:
        self.tables.install()
        self.tokens.install()
        processor = USPLTXVideoAttnProcessor(Route(self.state, text="none"))
        for attn in self.self_attentions:
            attn.processor = processor

    def remove(self) -> None:
        for attn, original in zip(self.self_attentions, self.original_processors):
            attn.processor = original
        self.tokens.remove()
        self.tables.remove()


def _check_supported(transformer: LTXVideoTransformer3DModel) -> None:
    """NotImplementedError for a model this adapter would not run exactly."""
    name = type(transformer).__name__
    if _RoutedLTXProcessor is None:
        raise NotImplementedError(
            f"this diffusers' LTXVideoAttnProcessor does not call {ROUTED_NAME}: usp_dit's LTX-Video adapter "
            f"routes that call"
        )
    if len(transformer.transformer_blocks) == 0:
        raise NotImplementedError(f"{name} with num_layers=0 has nothing to parallelise")
    if transformer.is_cache_enabled:
        raise NotImplementedError(
            f"{name} has a diffusers cache enabled (enable_cache): its decisions would be taken per rank on a "
            f"shard of the tokens; call disable_cache() before enable_usp"
        )
    for path, module in transformer.named_modules():
        if not isinstance(module, LTXAttention):
            continue
        proc = module.processor
        if type(proc) is not LTXVideoAttnProcessor:
            raise NotImplementedError(
                f"{path}.processor is {type(proc).__name__}; usp_dit's LTX-Video adapter runs only the stock "
                f"LTXVideoAttnProcessor (its maths would be lost silently otherwise)"
            )
        if proc._parallel_config is not None:
            raise NotImplementedError(
                f"{path} runs diffusers' own context parallelism (enable_parallelism); use one or the other"
            )


class LTXVideoAdapter(PatchingAdapter):
    """``ModelAdapter`` for ``LTXVideoTransformer3DModel`` (see the module docstring)."""

    name = "LTX-Video"
    # Arguments batched on dim 0, split over the "cfg" axis by enable_usp (LTXPipeline batches its
    # [uncond, cond] halves in one call). ``video_coords`` (B, 3, S): the condition pipeline's.
    cfg_batch_args = ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask", "video_coords")
    model_class = LTXVideoTransformer3DModel

    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> _Patch:
        _check_supported(transformer)
        return _Patch(transformer, mesh, backend)


ADAPTER = register_adapter(LTXVideoAdapter())
