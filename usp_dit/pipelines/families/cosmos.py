"""Cosmos adapter: ``CosmosTransformer3DModel`` (Cosmos 1 Diffusion; Cosmos Predict2, Predict2.5) on a USP grid.

Layout: latents (batch, channels, frames, height, width) (the condition mask and padding mask
concatenated on channels first); video tokens (batch, seq, channels), ``seq = frames/p_t *
height/p_h * width/p_w``, frame-major as ``patch_embed`` flattens them; text (batch, text_seq,
text_dim), with a key mask ``attention_mask`` (batch, text_seq) where a pipeline passes one;
Q/K/V (batch, heads, seq, head_dim) in the stock processor. Tables indexed by token: the RoPE
``rope(latents)`` ``(cos, sin)``, each (seq, head_dim), **the sequence on dim 0**; the learnable
positional embedding (Cosmos 1) ``extra_pos_emb`` (batch, seq, channels); and, with a per-frame
timestep (batch, 1, frames, 1, 1) (Predict2 video-to-world), ``temb`` and ``embedded_timestep``
(batch, seq, channels) instead of (batch, channels).

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the patch
embedding, the positional tables and the timestep embedding run on the full latent on every rank;
block 0's input (``transformer_blocks.0``) is sharded; ``norm_out`` and ``proj_out`` run on the
shard and ``proj_out``'s output is gathered before unpatchify. The RoPE table is cut once, by a
forward hook on ``rope`` (a ``Table``); the per-token block arguments (``extra_pos_emb``, and a
per-frame timestep's ``temb``/``embedded_timestep``) are cut by a forward pre-hook on every block
and on ``norm_out`` (Note [Cosmos's per-token arguments]).

Note [Cosmos's per-token arguments]
    The model's forward builds ``extra_pos_emb`` and, for a per-frame timestep, ``temb`` and
    ``embedded_timestep`` as (B, S, C) tensors over the whole sequence, and hands the same tensors
    to every block (the block adds ``extra_pos_emb`` to its input and modulates every token with
    the timestep rows) and to ``norm_out``. A pre-hook replaces each with this rank's rows
    (``shard_sequence`` on dim 1, the tokens' cut; a view), so token i meets row i, as in one
    process. A (B, C) timestep embedding (one timestep per element) is not per token and passes
    whole. A (B, S', C) argument with S' not the token count is refused (ValueError): its rows
    could not be lined up with the tokens. The learnable embedding is not cut at its own module
    because the model may have none (``extra_pos_embed_type=None``: Predict2).

Note [Cosmos's attention call]
    ``attn1`` (self-attention over the video tokens, RoPE on q and k) runs the stock
    ``CosmosAttnProcessor2_0.__call__``'s own code with its ``dispatch_attention_fn`` call routed to
    ``usp_attention`` (``_routing`` Note [routing a stock processor's attention call]). The stock
    call passes no ``parallel_config``, so the route cannot ride on the processor's
    ``_parallel_config``: as for SD3's ``F`` (Note [SD3's attention call]), each processor instance
    gets its own copy of the code whose ``dispatch_attention_fn`` is ``route_attention`` with the
    instance's ``Route`` bound (``functools.partial``); a deep copy rebuilds it around the copied state.

Attention: ``attn2``
(cross-attention of each video token to the text, masked by the text mask; with an image context
(``img_context_dim_in``) a second cross-attention to the image tokens, ``CosmosAttnProcessor2_5``)
is local: its queries are this rank's tokens, its keys every text (and image) token, which every
rank holds. No communication there, and the mask is the stock one, applied as stock applies it.

Text tokens: **replicated** (cross-attention only: they are keys and values, never queries, so
nothing of them is computed per rank beyond their K/V projections). Per-rank tokens, Cosmos
Predict2 14B video-to-world at 93 frames x 704 x 1280 (24 latent frames x 44 x 80 patches =
84480 video tokens, 512 T5 tokens): 21120 video tokens on 4 ranks, 10560 on 8.

Guidance: every Cosmos pipeline calls the transformer once per guidance branch (prompt, then
negative prompt). Text-to-world (Cosmos 1), text-to-image (Predict2) and Predict2.5's calls differ
in ``encoder_hidden_states`` alone: ``cfg_degree=2`` runs a step's two calls on the two cfg groups
at once (``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair`` Note [two calls a step]). The
video-to-world pipelines' two calls also differ in the latents and condition mask (the
unconditional branch's own conditioning frames) wherever those differ: such calls are not paired,
and run as any call on the cfg groups (a batch of prompts split, a batch of one whole on both:
correct, no faster).

Refused (NotImplementedError): at enable, processors other than the stock ones
(``CosmosAttnProcessor2_0`` in ``attn1``, ``CosmosAttnProcessor2_0``/``-2_5`` in ``attn2``), a
Diffusers whose processor stops calling ``dispatch_attention_fn``, an unsupported Diffusers cache,
``num_layers=0``; at the call, ``block_controlnet_hidden_states`` (Cosmos Transfer2.5's ControlNet
residuals, (B, S, C) over the whole sequence, added inside the blocks: ``Cosmos2_5_TransferPipeline``
cannot run on the grid) and a routed call with a mask or dropout (the stock ``attn1`` passes none).
The model has no dropout.
"""
from __future__ import annotations

import copy
import functools
import types

import torch
from diffusers import CosmosTransformer3DModel
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0, CosmosAttnProcessor2_5
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, Route, route_attention, with_global
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import shard_sequence

# The per-token arguments (name, position) of CosmosTransformerBlock.forward and CosmosAdaLayerNorm.forward
# (norm_out), as the model's forward passes them (positionally).
_BLOCK_ARGS = (("embedded_timestep", 2), ("temb", 3), ("extra_pos_emb", 5))
_NORM_OUT_ARGS = (("embedded_timestep", 1), ("temb", 2))


def _routed_call(route: Route) -> types.FunctionType | None:
    """``CosmosAttnProcessor2_0.__call__``'s code with ``dispatch_attention_fn`` bound to
    ``route_attention`` with this processor's ``Route`` (Note [Cosmos's attention call])."""
    return with_global(CosmosAttnProcessor2_0.__call__, ROUTED_NAME,
                       functools.partial(route_attention, parallel_config=route))


class USPCosmosAttnProcessor:
    """Cosmos self-attention (``attn1``) of this rank's video shard over the whole sequence.

    Inputs: ``hidden_states`` (B, S_local, C); ``image_rotary_emb`` this rank's rows of the RoPE
    table, each (S_local, head_dim) (cut by the hook on ``rope``). Returns (B, S_local, C).
    The signature is spelled out: ``Attention.forward`` passes a processor only the keyword
    arguments its ``__call__`` names.
    """

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, "none")
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPCosmosAttnProcessor:
        # Rebuild the routed function around the copied state (as SD3's: Note [SD3's attention call]).
        clone = type(self)(copy.deepcopy(self.route.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise NotImplementedError(
                "USPCosmosAttnProcessor routes the blocks' self-attention (attn1); it got encoder_hidden_states"
            )
        return self._call(self, attn, hidden_states, None, attention_mask, image_rotary_emb)


class PerTokenArgHooks:
    """Note [Cosmos's per-token arguments]: every block's and ``norm_out``'s (B, S, C) arguments cut
    like the tokens (the RoPE ``Table`` runs first and sets this call's ``seq_len``)."""

    def __init__(self, transformer: CosmosTransformer3DModel, state: ShardState) -> None:
        self.state = state
        self.sites = [(block, _BLOCK_ARGS) for block in transformer.transformer_blocks]
        self.sites.append((transformer.norm_out, _NORM_OUT_ARGS))
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for module, names in self.sites:
            hook = self._cut_block_args if names is _BLOCK_ARGS else self._cut_norm_out_args
            self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut_block_args(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._cut(args, kwargs, _BLOCK_ARGS)

    def _cut_norm_out_args(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._cut(args, kwargs, _NORM_OUT_ARGS)

    def _cut(self, args: tuple, kwargs: dict, names: tuple[tuple[str, int], ...]) -> tuple[tuple, dict]:
        """Each (B, S, C) argument of ``names`` -> this rank's (B, S_local, C); (B, C) ones pass.

        Raises:
            ValueError: a 3-d argument whose dim 1 is not the call's token count.
        """
        for name, index in names:
            value = _get_arg(args, kwargs, name, index)
            if not torch.is_tensor(value) or value.dim() != 3:
                continue
            if value.shape[1] != self.state.seq_len:
                raise ValueError(
                    f"{name} has {value.shape[1]} rows per batch element but the transformer has "
                    f"{self.state.seq_len} video tokens: a per-token argument must have one row per token"
                )
            local = shard_sequence(value, self.state.mesh, dim=1, layout=self.state.layout)
            args, kwargs = _set_arg(args, kwargs, name, index, local)
        return args, kwargs


def _routed_call_missing(transformer: CosmosTransformer3DModel) -> str | None:
    if _routed_call(Route(None)) is None:
        return f"this diffusers' CosmosAttnProcessor2_0 does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="Cosmos",
    model_class=CosmosTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn1", USPCosmosAttnProcessor, stock=(CosmosAttnProcessor2_0,)),
        # cross-attention of this rank's tokens to the replicated text (and image context)
        Local("transformer_blocks.*.attn2", stock=(CosmosAttnProcessor2_0, CosmosAttnProcessor2_5)),
    ),
    block_lists=("transformer_blocks",),
    # rope(latents, fps) -> (cos, sin), each (seq, head_dim): the sequence on dim 0.
    tables=(Table("rope", dim=0, items=(0, 1)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run);
    # padding_mask is (1, 1, H, W), shared by the batch.
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "attention_mask", "condition_mask"),
    # The text-to-world / text-to-image / Predict2.5 pipelines' two calls a step differ in the text
    # alone (module docstring).
    cfg_branch_args=("encoder_hidden_states",),
    hooks=(PerTokenArgHooks,),
    refuse_args={"block_controlnet_hidden_states": "Cosmos Transfer's ControlNet residuals, (B, S, C) over the "
                                                   "whole sequence"},
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
