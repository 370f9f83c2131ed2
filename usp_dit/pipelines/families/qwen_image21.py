"""Qwen-Image 2.1 adapter: ``QwenImage21Transformer2DModel`` (``QwenImage21Pipeline``) on a USP grid.

Layout: one joint sequence (batch, L, channels), L = prefix + target: the **prefix** is the prompt's
text tokens with any condition images' tokens substituted into the slots the vision-language
encoder reserved for them, the **target** the image being denoised (its last
``prod(img_shapes[0][-1])`` tokens, frame-major). The RoPE table ``rotary_emb`` (L, head_dim / 2)
complex and the modulation row selector ``target_token_mask`` (L,) have the sequence on dim 0; the
prompt mask ``key_valid`` (batch, L) is over the whole joint sequence; Q/K/V (batch, seq, heads,
head_dim). The model's output is ``proj_out`` over the whole joint sequence (batch, L, C_out) (the
pipeline keeps its last target rows); with the KV cache's ``"cached"`` mode the blocks see the
target alone (batch, target, channels) and the prefix's K/V come from the cache.

Note [block-causal prefix, full target]
    Stock attention is ``(q >= kv) or same_image_block`` over the joint sequence, with padded
    prompt tokens masked as keys. The target image is the last block, so every target query sees
    every (valid) key, while a prefix query sees only prefix keys (causal text, bidirectional
    condition images): the prefix never reads the target. So the prefix is **replicated** and only
    the target is **split**: each rank holds ``[prefix ; its target shard]``

        joint sequence   [ prefix (P_len, replicated) | target (N) ]
        rank s holds     [ prefix | target rows split_sizes(N, P)[s] ]
        Qwen-Image 2.1 at 1024 x 1024: N = 64 x 64 = 4096 (16 px a token); a prompt of ~100-500
        tokens; P = 8: 512 target rows + the prefix on every rank.

    and each block's attention is the stock ``QwenImage21AttnProcessor``'s own code, whose calls
    are routed (``_route_prefix_target``): its per-segment prefix calls (text causal, condition
    images bidirectional, keys ``[0, end)``) stay local, stock, exact (the prefix is whole on every
    rank); its target call (the target shard's queries against ``[prefix ; target]``) goes to
    ``usp_attention`` with the prefix as joint tokens, masked per element by the prompt mask
    (``_routing.joint_attention``). ``usp_attention`` needs joint queries beside joint keys: the
    call gives it zeros and drops their output (the prefix's own rows come from the stock local
    calls); that output costs prefix x L of attention, spread over the ranks (T2I at 1024^2 with
    a 300-token prompt: 7 % of the target's). The KV cache works unchanged: ``"extract"`` stores
    the replicated prefix's K/V (``key[:, :prefix_len]`` of ``[prefix ; shard]``), ``"cached"``
    runs the target shard against them (the same routed target call).

Where the tokens are split: block 0's pre-hook cuts ``hidden_states`` to ``[prefix ; shard]``;
every block's (and ``norm_out``'s) pre-hook cuts ``rotary_emb`` and ``target_token_mask`` the same
way (the forward passes them whole to each block); ``proj_out``'s output is gathered back to
(batch, L, C_out), the prefix rows being this rank's own (equal on every rank). ``key_valid``
stays whole: the prefix calls read its first ``end`` columns, the target call its prefix columns.

CFG: ``QwenImage21Pipeline`` calls the transformer once per guidance branch (``true_cfg_scale > 1``
and a negative prompt; 2.1 is meant to run without guidance, ``true_cfg_scale = 1``). The two
calls' outputs are the joint sequences of prompts of different lengths, so their shapes differ
and the cfg pair's all-gather (``usp_dit.pipelines.cfg_pair``, which needs equal shapes) cannot
serve them: no ``cfg_branch_args``. With ``cfg_degree=2`` a batch of prompts is split over the cfg
groups (each group's KV cache holds its own rows, the same rows at every step), a batch of one
runs whole on both groups (correct, no faster).

Refused (NotImplementedError): at enable, ``QwenImage21FlexAttnProcessor`` (its prefill is one
flex call over a ``BlockMask``: not routed) and any other processor than the stock
``QwenImage21AttnProcessor``, attention modules the plan does not name, a Diffusers cache that
cannot run on a grid, ``num_layers=0``; at the call, dropout / attention kwargs in the routed
call and a processor replaced after enable.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from diffusers import QwenImage21Transformer2DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines._routing import (
    ROUTED_NAME,
    Route,
    RoutedProcessor,
    _valid_text_keys,
    joint_attention,
    one_rank_call,
    with_global,
)
from usp_dit.pipelines._token_sharding import ShardState, TokenShardHooks, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, PlanPatch, check_plan
from usp_dit.pipelines.tensor import BlockCuts, Split, TensorPlan
from usp_dit.sharding.shard import gather_sequence, layout_sizes, shard_sequence

# QwenImage21TransformerBlock.forward(hidden_states, modulation, rotary_emb, attention_mask,
# target_token_mask, layer_cache, ...): positions when passed positionally (gradient checkpointing).
_ROPE_POS, _TARGET_MASK_POS = 2, 4
_NORM_OUT_MASK_POS = 2  # QwenImage21AdaLayerNormContinuous.forward(hidden_states, conditioning, target_token_mask)


@dataclass(eq=False)
class PrefixRoute:
    """The routed processor's ``_parallel_config``: the shared state, and the key count of the
    processor call in progress (``keys``: the local ``[prefix ; shard]``, cached prefix included),
    which tells the target call from the prefix segments' (Note [block-causal prefix, full target])."""

    state: ShardState
    keys: int = 0

    def shard_len(self) -> int:
        mesh = self.state.mesh
        return layout_sizes(self.state.seq_len, mesh, self.state.layout)[mesh.seq_rank]


def _route_prefix_target(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None, parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn``'s signature. A prefix segment's call (queries (B, seg, H, D), keys
    ``[0, end)`` of the replicated prefix) runs the stock call, locally; the target call (this
    rank's target shard (B, N_local, H, D) against ``[prefix ; shard]``) runs ``usp_attention``
    with the prefix as joint keys, masked per element by ``attn_mask``'s prefix columns.

    Raises:
        NotImplementedError: dropout, causal attention or attention kwargs in the target call, or a
            mask other than a key mask over the prefix.
    """
    route = parallel_config
    if not isinstance(route, PrefixRoute):
        raise TypeError(f"usp_dit's Qwen-Image 2.1 processor got parallel_config={type(route).__name__}")
    shard = route.shard_len()
    if query.shape[1] != shard or key.shape[1] != route.keys:  # a prefix segment: local and stock
        return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                     scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs,
                                     backend=backend)
    if dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(
            f"usp_dit routes plain attention only, got dropout_p={dropout_p}, is_causal={is_causal}, "
            f"attention_kwargs={attention_kwargs}"
        )
    one_rank = one_rank_call(query, key, value, attn_mask, route.state, scale)
    if one_rank is not None:  # one rank: the target rows over [prefix ; target], as stock's call
        return one_rank
    prefix = key.shape[1] - shard
    # attn_mask: (B, 1, 1, keys) over [prefix ; shard] (prefill) or [prefix ; whole target] (cached):
    # its first `prefix` columns are the prefix's, the rest (image keys) must all be valid.
    valid = _valid_text_keys(attn_mask, query.shape[0], slice(0, prefix), slice(prefix, None))
    zeros = query.new_zeros(query.shape[0], prefix, *query.shape[2:])  # joint queries whose output is dropped
    out, _ = joint_attention(query, key[:, prefix:], value[:, prefix:], zeros, key[:, :prefix], value[:, :prefix],
                             valid, route.state, scale)
    return out


# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing), with our own routed
# function: None if this diffusers' processor makes no dispatch_attention_fn call.
_ROUTED_CALL = with_global(QwenImage21AttnProcessor.__call__, ROUTED_NAME, _route_prefix_target)


class USPQwenImage21AttnProcessor(RoutedProcessor):
    """``QwenImage21AttnProcessor``'s own code on this rank's ``[prefix ; target shard]``, its
    attention calls routed (Note [block-causal prefix, full target]).

    Inputs: ``hidden_states`` (B, prefix + N_local, C) (``"cached"``: (B, N_local, C)),
    ``rotary_emb`` (the same rows, head_dim / 2) complex; ``key_valid`` (B, L) whole;
    ``attention_mask`` (B, 1, 1, keys) or None. Returns (B, rows of ``hidden_states``, C).
    """

    _stock_call = _ROUTED_CALL

    def __init__(self, route: Route) -> None:
        super().__init__(PrefixRoute(route.state))

    def __call__(
        self, attn: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: Any | None = None,
        rotary_emb: torch.Tensor | None = None, layer_cache: Any | None = None, kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None, segments: list | None = None, key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cached = layer_cache.k.shape[1] if layer_cache is not None and kv_cache_mode == "cached" else 0
        self._parallel_config.keys = cached + hidden_states.shape[1]
        return type(self)._stock_call(self, attn, hidden_states, attention_mask, rotary_emb, layer_cache,
                                      kv_cache_mode, cache_write_slice, segments, key_valid)


class PrefixShardHooks:
    """Note [block-causal prefix, full target]: ``[prefix ; target shard]`` at every block, the
    target gathered after ``proj_out``. Replaces the plan's ``TokenShardHooks``."""

    def __init__(self, transformer: QwenImage21Transformer2DModel, state: ShardState) -> None:
        self.transformer, self.state = transformer, state
        self.signature = inspect.signature(type(transformer).forward)
        self.target = 0  # target tokens of the call (prod(img_shapes[0][-1]))
        self.prefix = 0  # prefix rows of the blocks' sequence in this call (0 in "cached" mode)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        model = self.transformer
        self.handles.append(model.register_forward_pre_hook(self._read_target, with_kwargs=True))
        for i, block in enumerate(model.transformer_blocks):
            hook = functools.partial(self._cut_block, i == 0)
            self.handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
        self.handles.append(model.norm_out.register_forward_pre_hook(self._cut_norm_out, with_kwargs=True))
        self.handles.append(model.proj_out.register_forward_hook(self._gather))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _read_target(self, module, args: tuple, kwargs: dict) -> None:
        shapes = self.signature.bind_partial(module, *args, **kwargs).arguments.get("img_shapes")
        if not shapes or not shapes[0]:
            raise ValueError(f"img_shapes must list each sample's images, the target last; got {shapes!r}")
        self.target = prod(shapes[0][-1])

    def _cut(self, x: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        """``x`` (.., prefix + target, ..) along ``dim`` -> (.., prefix + N_local, ..): the prefix whole, this rank's target rows.

        Raises:
            ValueError: ``x`` has fewer rows than the target has tokens.
        """
        prefix = x.shape[dim] - self.target
        if prefix < 0:
            raise ValueError(f"{name} has {x.shape[dim]} rows, fewer than the target image's {self.target} tokens")
        if self.state.mesh.sequence_degree == 1:  # every row is this rank's: no copy
            return x
        shard = shard_sequence(x.narrow(dim, prefix, self.target), self.state.mesh, dim=dim)
        return torch.cat([x.narrow(dim, 0, prefix), shard], dim) if prefix else shard

    def _cut_block(self, first: bool, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rope = _get_arg(args, kwargs, "rotary_emb", _ROPE_POS)
        if first:
            x = _get_arg(args, kwargs, "hidden_states", 0)
            if rope is not None and rope.shape[0] != x.shape[1]:
                raise ValueError(f"rotary_emb has {rope.shape[0]} rows for {x.shape[1]} tokens")
            self.state.seq_len = self.target  # what the routed target calls and the gather cover
            self.prefix = x.shape[1] - self.target
            args, kwargs = _set_arg(args, kwargs, "hidden_states", 0, self._cut(x, 1, "hidden_states"))
        if rope is not None:
            args, kwargs = _set_arg(args, kwargs, "rotary_emb", _ROPE_POS, self._cut(rope, 0, "rotary_emb"))
        mask = _get_arg(args, kwargs, "target_token_mask", _TARGET_MASK_POS)
        if mask is not None:
            args, kwargs = _set_arg(args, kwargs, "target_token_mask", _TARGET_MASK_POS,
                                    self._cut(mask, 0, "target_token_mask"))
        return args, kwargs

    def _cut_norm_out(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        mask = _get_arg(args, kwargs, "target_token_mask", _NORM_OUT_MASK_POS)
        if mask is None:
            return None
        return _set_arg(args, kwargs, "target_token_mask", _NORM_OUT_MASK_POS, self._cut(mask, 0, "target_token_mask"))

    def _gather(self, module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """(B, prefix + N_local, C_out) -> (B, prefix + N, C_out), equal on every rank of the sequence group."""
        if self.state.mesh.sequence_degree == 1:  # already whole
            return out
        target = gather_sequence(out.narrow(1, self.prefix, out.shape[1] - self.prefix), self.state.mesh, dim=1,
                                 seq_len=self.target)
        return torch.cat([out.narrow(1, 0, self.prefix), target], 1) if self.prefix else target


class PrefixPlanPatch(PlanPatch):
    """``PlanPatch`` with ``PrefixShardHooks`` in place of the plan's ``TokenShardHooks``."""

    def __init__(self, plan: ModelPlan, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> None:
        super().__init__(plan, transformer, mesh, backend)
        tokens = [i for i, part in enumerate(self.parts) if isinstance(part, TokenShardHooks)]
        assert len(tokens) == 1, "PlanPatch installs one TokenShardHooks"
        self.parts[tokens[0]] = PrefixShardHooks(transformer, self.state)


class PrefixPlanAdapter(PlanAdapter):
    """The adapter of a plan whose blocks hold ``[prefix ; target shard]``."""

    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> PrefixPlanPatch:
        check_plan(self.plan, transformer)
        return PrefixPlanPatch(self.plan, transformer, mesh, backend)


def _routed_call_missing(transformer: QwenImage21Transformer2DModel) -> str | None:
    if _ROUTED_CALL is None:
        return f"this diffusers' QwenImage21AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


# Tensor parallelism (usp_dit.pipelines.tensor Note [tensor plans]), where Diffusers' own
# QwenImage21 ``_tp_plan`` cuts: the attention's heads (Q/K/V, the output) and the SwiGLU's hidden
# width (proj and gate_layer alike, then out). The QK norms are per head (RMSNorm over head_dim)
# and the processor reads head_dim as inner_dim // heads (both set to a rank's share): exact; the
# shared modulation, txt_in, img_in, norm_out and proj_out stay whole.
_TENSOR = TensorPlan((BlockCuts("transformer_blocks", splits=(
    Split(columns=("attn.to_q", "attn.to_k", "attn.to_v"), rows=("attn.to_out.0",), heads="attn"),
    Split(columns=("img_mlp.proj", "img_mlp.gate_layer"), rows=("img_mlp.out",)),
)),))

PLAN = ModelPlan(
    name="QwenImage21",
    model_class=QwenImage21Transformer2DModel,
    split_at="transformer_blocks.0",  # [prefix ; target shard] (PrefixShardHooks)
    gather_at="proj_out",
    attention=(
        # block-causal prefix local, target over the whole sequence (Note [block-causal prefix, full target])
        Parallel("transformer_blocks.*.attn", USPQwenImage21AttnProcessor, stock=(QwenImage21AttnProcessor,)),
    ),
    block_lists=("transformer_blocks",),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (the model reads img_mask's row 0:
    # every row has the layout). img_shapes (a list) and the kv_cache object stay whole.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "img_mask"),
    refuse=(_routed_call_missing,),
    tensor=_TENSOR,
)

ADAPTER = register_adapter(PrefixPlanAdapter(PLAN, __name__))
