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
a Diffusers cache that cannot run on a grid (FasterCache; the others do:
``usp_dit.pipelines.caches``), an ``attention_mask``, dropout or causal self-attention calls (at the call: the stock
processor passes none), ``num_layers=0``. Wan configs have no dropout, so no replicated-dropout
handling is needed (the text stream is never updated per block).
"""
from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import shard_sequence

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


class WanTimestepHook:
    """Note [Wan's per-token tables]: TI2V's per-token timestep, cut like the tokens (the RoPE
    table is the plan's ``Table``; its hook runs first and sets this call's ``seq_len``)."""

    def __init__(self, transformer: WanTransformer3DModel, state: ShardState) -> None:
        self.state = state
        self.condition_embedder = transformer.condition_embedder
        self.handle: RemovableHandle | None = None

    def install(self) -> None:
        self.handle = self.condition_embedder.register_forward_pre_hook(self._shard_timestep, with_kwargs=True)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

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


def _routed_call_missing(transformer: WanTransformer3DModel) -> str | None:
    if _RoutedWanProcessor is None:
        return f"this diffusers' WanAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="Wan",
    model_class=WanTransformer3DModel,
    split_at="blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("blocks.*.attn1", USPWanAttnProcessor, stock=(WanAttnProcessor,)),  # self-attention
        Local("blocks.*.attn2", stock=(WanAttnProcessor,)),  # cross-attention to the replicated text (and image)
    ),
    block_lists=("blocks",),
    # rope(latents) -> (cos, sin), each (1, seq, 1, head_dim): Note [Wan's per-token tables].
    tables=(Table("rope", dim=1, items=(0, 1)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run).
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
    # Wan's pipelines (both Wan 2.2 experts) call it once per guidance branch, differing in the text
    # embeds (usp_dit.pipelines.cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states",),
    hooks=(WanTimestepHook,),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
