"""Wan adapter: ``WanTransformer3DModel`` (Wan 2.1 T2V / I2V / FLF2V; Wan 2.2 A14B experts, TI2V-5B) on a USP grid.

Layout: latents (batch, channels, frames, height, width); video tokens (batch, seq, channels),
``seq = frames/p_t * height/p_h * width/p_w``, frame-major as ``patch_embedding(x).flatten(2)``
orders them; text (batch, text_seq, channels) and I2V image tokens (batch, image_seq, channels),
both replicated; Q/K/V (batch, seq, heads, head_dim); the RoPE table ``self.rope(latents)``
``(cos, sin)``, each (1, seq, 1, head_dim): **the sequence on dim 1**; the timestep (batch,) or,
for TI2V-5B (the pipeline's ``expand_timesteps``), one per token (batch, seq).

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the patch
embedding and the condition embedder run on every rank; block 0's input is sharded; ``proj_out``'s
output is gathered before unpatchify. Two tables follow the tokens (Note [Wan's per-token tables]).

Text and image tokens: **replicated**, and no communication for them. Wan has no joint attention:
``attn1`` is self-attention over the video tokens alone (sequence-parallel: ``usp_attention``) and
``attn2`` is cross-attention from the video queries to the text tokens and, for I2V, to the CLIP
image tokens through the added K/V projections (``add_k_proj`` / ``add_v_proj``). Each query of
``attn2`` reads whole K/V that every rank holds, so ``attn2`` runs locally on the rank's queries
with its stock processor untouched. Per-rank token count, Wan 2.1-14B 720p x 81 frames (21 latent
frames x 45 x 80 patches = 75600 video tokens; 512 text, +257 image tokens for I2V): 9450 video
tokens per rank on 8 ranks, plus the replicated text K/V of cross-attention (its projection is
per rank: 512 x 4096 -> 5120 per layer, ~2 % of a rank's linear work).

Note [Wan's per-token tables]
    Two inputs of the blocks are indexed by token and must be cut exactly like the tokens:

      * the RoPE table: ``rope`` returns (1, seq, 1, head_dim) cos and sin, built from the
        latent's shape inside the forward. A forward hook on ``rope`` keeps this rank's rows of
        dim 1 (``shard_sequence``, a view), once per forward; every layer reuses it. (Diffusers'
        own ``_cp_plan`` splits the same output on the same dim.)
      * TI2V-5B's per-token timestep: the model flattens (B, seq) to (B * seq,) and calls
        ``condition_embedder(timestep, ..., timestep_seq_len=seq)``, which embeds every token's
        timestep into ``temb`` (B, seq, C) and the blocks' modulation (B, seq, 6C). A pre-hook on
        ``condition_embedder`` hands it this rank's rows of the timestep instead (and
        ``timestep_seq_len=seq_local``): the modulation comes out (B, seq_local, ...) like the
        tokens, the final norm's shift/scale too, and the per-token time embedding is not
        computed P times over.

    Both hooks sit on submodules called inside the forward, so whatever wraps the forward
    (``enable_usp``'s input broadcast and cfg split) sees full tensors.

Self-attention keeps diffusers' maths: ``USPWanAttnProcessor`` runs the stock
``WanAttnProcessor.__call__``'s own code (projections, RMS norm across heads, RoPE on this rank's
rows, output projection) with its one ``dispatch_attention_fn`` call routed to ``usp_attention``
(``usp_dit.pipelines._routing``, Note [routing a stock processor's attention call]).

Refused (NotImplementedError, at enable unless noted): processors other than the stock
``WanAttnProcessor`` (LoRA-replaced, custom, or diffusers' context parallelism already enabled),
a diffusers cache (``enable_cache``: its skip decisions would be taken per rank on the shard), an
``attention_mask``, dropout or causal self-attention calls (at the call: the stock
processor passes none), ``num_layers=0``. Wan configs have no dropout, so no replicated-dropout
handling is needed (the text stream is never updated per block).
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.mesh import USPMesh
from usp_dit.pipelines._token_sharding import PatchingAdapter, ShardState, TokenShardHooks, _get_arg, _set_arg
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, routed_processor_class
from usp_dit.pipelines.base import register_adapter
from usp_dit.sharding import shard_sequence

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedWanProcessor = routed_processor_class(WanAttnProcessor, "_RoutedWanProcessor")


class USPWanAttnProcessor(_RoutedWanProcessor or RoutedProcessor):
    """Wan self-attention (``attn1``) of this rank's video shard against the whole sequence.

    Inputs: ``hidden_states`` (B, S_local, C); ``rotary_emb`` this rank's rows of the RoPE table,
    each (1, S_local, 1, head_dim) (sliced by the hook on ``rope``). Returns (B, S_local, C).
    The maths is the stock ``WanAttnProcessor``'s own code, its attention call routed.
    """

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attn.add_k_proj is not None:
            raise NotImplementedError("USPWanAttnProcessor is for self-attention (attn1) only; attn2 runs locally")
        if attention_mask is not None:
            raise NotImplementedError("usp_dit's Wan adapter does not support an attention_mask in self-attention")
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


class WanTableHooks:
    """Note [Wan's per-token tables]: the RoPE table and TI2V's per-token timestep, cut like the tokens."""

    def __init__(self, state: ShardState, rope: torch.nn.Module, condition_embedder: torch.nn.Module) -> None:
        self.state = state
        self.rope, self.condition_embedder = rope, condition_embedder
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        self.handles.append(self.rope.register_forward_hook(self._shard_rope))
        self.handles.append(
            self.condition_embedder.register_forward_pre_hook(self._shard_timestep, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _shard_rope(self, module, args: tuple, table: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (1, S, 1, D) -> (1, S_local, 1, D); records S as this call's ``seq_len``."""
        pair = isinstance(table, tuple) and len(table) == 2
        if not (pair and all(torch.is_tensor(t) and t.dim() == 4 for t in table)):
            raise NotImplementedError(
                f"usp_dit's Wan adapter expects rope to return (cos, sin), each (1, seq, 1, head_dim); "
                f"got {type(table).__name__}"
            )
        # Block 0's pre-hook sets the same value from the tokens; the timestep hook runs before it.
        self.state.seq_len = table[0].shape[1]
        return tuple(shard_sequence(t, self.state.mesh, dim=1) for t in table)

    def _shard_timestep(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """TI2V-5B: the flattened (B * S,) timestep -> this rank's (B * S_local,), ``timestep_seq_len`` S_local.

        Raises:
            ValueError: the per-token timestep's length is not the video token count.
        """
        seq = _get_arg(args, kwargs, "timestep_seq_len", 3)
        if seq is None:  # one timestep per batch element (Wan 2.1, Wan 2.2 A14B): nothing per token
            return None
        if seq != self.state.seq_len:
            raise ValueError(
                f"the timestep has {seq} entries per batch element but the latent has {self.state.seq_len} video "
                f"tokens: a per-token timestep (TI2V, expand_timesteps) must have one entry per token"
            )
        timestep = _get_arg(args, kwargs, "timestep", 0)
        local = shard_sequence(timestep.unflatten(0, (-1, seq)), self.state.mesh, dim=1)  # (B, S_local)
        args, kwargs = _set_arg(args, kwargs, "timestep", 0, local.flatten())
        return _set_arg(args, kwargs, "timestep_seq_len", 3, local.shape[1])


class _Patch:
    """Everything ``enable`` changed on one transformer, and how to undo it."""

    def __init__(self, transformer: WanTransformer3DModel, mesh: USPMesh, backend: str) -> None:
        self.state = ShardState(mesh, backend)
        self.self_attentions = [block.attn1 for block in transformer.blocks]
        self.original_processors = [attn.processor for attn in self.self_attentions]
        self.tables = WanTableHooks(self.state, transformer.rope, transformer.condition_embedder)
        self.tokens = TokenShardHooks(self.state, transformer.blocks[0], transformer.proj_out)

    def install(self) -> None:
        self.tables.install()
        self.tokens.install()
        processor = USPWanAttnProcessor(Route(self.state))
        for attn in self.self_attentions:
            attn.processor = processor

    def remove(self) -> None:
        for attn, original in zip(self.self_attentions, self.original_processors):
            attn.processor = original
        self.tokens.remove()
        self.tables.remove()


def _check_supported(transformer: WanTransformer3DModel) -> None:
    """NotImplementedError for a model this adapter would not run exactly."""
    name = type(transformer).__name__
    if _RoutedWanProcessor is None:
        raise NotImplementedError(
            f"this diffusers' WanAttnProcessor does not call {ROUTED_NAME}: usp_dit's Wan adapter routes that call"
        )
    if len(transformer.blocks) == 0:
        raise NotImplementedError(f"{name} with num_layers=0 has nothing to parallelise")
    if transformer.is_cache_enabled:
        raise NotImplementedError(
            f"{name} has a diffusers cache enabled (enable_cache): its decisions would be taken per rank on a "
            f"shard of the tokens; call disable_cache() before enable_usp"
        )
    for path, module in transformer.named_modules():
        if not isinstance(module, WanAttention):
            continue
        proc = module.processor
        if type(proc) is not WanAttnProcessor:
            raise NotImplementedError(
                f"{path}.processor is {type(proc).__name__}; usp_dit's Wan adapter runs only the stock "
                f"WanAttnProcessor (its maths would be lost silently otherwise)"
            )
        if proc._parallel_config is not None:
            raise NotImplementedError(
                f"{path} runs diffusers' own context parallelism (enable_parallelism); use one or the other"
            )


class WanAdapter(PatchingAdapter):
    """``ModelAdapter`` for ``WanTransformer3DModel`` (see the module docstring)."""

    name = "Wan"
    # Arguments batched on dim 0, split over the "cfg" axis by enable_usp. (Wan's pipelines call the
    # transformer once per guidance branch, so with batch 1 there is nothing to split: api.py refuses.)
    cfg_batch_args = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image")
    model_class = WanTransformer3DModel

    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> _Patch:
        _check_supported(transformer)
        return _Patch(transformer, mesh, backend)


ADAPTER = register_adapter(WanAdapter())
