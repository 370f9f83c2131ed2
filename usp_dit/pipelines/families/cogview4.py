"""CogView adapters: ``CogView4Transformer2DModel`` (CogView4-6B, CogView4 Control) and its relative
``CogView3PlusTransformer2DModel`` (CogView3-Plus-3B) on a USP grid.

Layout: latents (batch, channels, height, width); image tokens (batch, seq, channels),
``seq = (height / p) * (width / p)``, row-major as the patch embedding flattens them; text tokens
(batch, text_seq, channels), the pipeline's prompt padded on the left to a multiple of 16 (its
padding embedded, never masked: the pipelines pass no mask); inside ``CogView4AttnProcessor`` Q/K/V
are (batch, heads, seq, head_dim) over ``[text; image]`` (**text first**); the RoPE table
``rope(hidden_states)`` returns ``(cos, sin)``, each (seq, head_dim), **the sequence on dim 0**;
an optional ``attention_mask`` (batch, text_seq), 1 for a real text token, 0 for padding.

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the patch
embedding, the text projection and the timestep / size embeddings run whole on every rank;
``transformer_blocks.0``'s input is sharded; ``proj_out``'s output is gathered before unpatchify.
The RoPE table is the plan's ``Table("rope", dim=0)``: this rank's rows, once per forward.

Text tokens: **replicated**. CogView4 is a single-attention MMDiT: the text keeps its own stream
(``norm_context``, its own gates) and shares the attention and feed-forward weights; the processor
concatenates ``[text; image]`` for one attention. Every rank holds all text tokens and
``usp_attention`` takes them as joint tokens (``Route(state, text="first")``). The text is short
beside the image: CogView4 at 1024 x 1024 has 64 x 64 = 4096 image tokens (512 per rank on 8 ranks)
and a prompt of typically 16 - 224 tokens; Diffusers' own ``_cp_plan`` (none on this class) is not
needed for that.

Note [CogView4's mask is a bias]
    ``CogView4AttnProcessor`` turns ``attention_mask`` (B, T) into ``m`` (B, T + S), 1 for image
    tokens, and hands SDPA ``(m_i * m_j)`` as a **float** (B, 1, L, L) mask: an additive bias of
    +1 on the scores of valid (query, key) pairs and 0 elsewhere. Padded keys are therefore not
    masked out, only down-weighted by e^-1 against the valid ones, and padded queries attend to
    every key uniformly biased (plain attention). The routed call keeps this exactly with one more
    channel of the head: ``q' = [q, m_i]``, ``k' = [k, m_j / scale]``, ``v' = [v, 0]`` (zeros up to a
    multiple of 8, so that the fast kernels still take it), so that ``scale * q'.k' = scale * q.k +
    m_i * m_j``, the stock score, at the original ``scale``; the output's extra channels are zeros and
    are dropped. It is exact (one more product in each score's float sum), for any ``m`` over the
    sharded image tokens too, and costs 8 more head channels on masked calls only (no pipeline
    makes one). The mask is checked to be such an outer product of 0/1 values (the processor
    builds it so); anything else is refused.

Note [CogView4's attention call]
    ``CogView4AttnProcessor`` calls ``F.scaled_dot_product_attention`` on (B, H, L, D) tensors, not
    ``dispatch_attention_fn``. As for SD3 (``usp_dit.pipelines.families.sd3`` Note [SD3's attention
    call]), the processor here runs the stock ``__call__``'s own code with its module global ``F``
    bound to a namespace whose ``scaled_dot_product_attention`` goes to ``_routing.route_attention``
    (no mask) or through Note [CogView4's mask is a bias] (a mask); every other name is torch's.

CogView3-Plus: ``CogVideoXAttnProcessor2_0`` over ``[text; image]`` with no RoPE (its sin-cos
positions are added by the patch embedding before the split); the CogVideoX family's processor
(``usp_dit.pipelines.families.cogvideox``) runs it, text replicated. ``CogView3PlusPipeline``
batches [uncond, cond] in one call (``cfg_batch_args``).

Refused (NotImplementedError): at enable, processors other than the stock ones
(``CogView4TrainingAttnProcessor``, LoRA-replaced, custom, or Diffusers' context parallelism),
attention modules the plans do not name, a Diffusers cache that cannot run on a grid,
``num_layers=0``; at the call, ``image_rotary_emb`` passed by the caller (a table the plan cannot
see being made, so cannot cut like the tokens; no pipeline passes one), a processor replaced after
enable, and an ``attention_mask`` that is not the outer product of a 0/1 key vector.
``CogView4Pipeline`` and ``CogView4ControlPipeline`` (control latents concatenated on channels: the
same transformer class) call the transformer once per guidance branch (true CFG): with
``cfg_degree=2`` a step's two calls run on the two cfg groups at once (``cfg_branch_args``; the
negative prompt may have another padded length than the prompt). CogView4 configs have no dropout.
"""
from __future__ import annotations

import copy
import types
from typing import Any

import torch
import torch.nn.functional
from diffusers import CogView3PlusTransformer2DModel, CogView4Transformer2DModel
from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0
from diffusers.models.transformers.transformer_cogview4 import CogView4AttnProcessor

from usp_dit.pipelines._checks import require
from usp_dit.pipelines._routing import Route, route_attention, route_sdpa, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.families.cogvideox import USPCogVideoXAttnProcessor
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, Table

_ROUTED_GLOBAL = "F"  # CogView4AttnProcessor calls F.scaled_dot_product_attention (torch.nn.functional as F)
_CHANNELS = 8  # Note [CogView4's mask is a bias]: the bias channel, padded so head_dim stays a multiple of 8


def _key_weights(mask: torch.Tensor) -> torch.Tensor:
    """``m`` (B, L) of a stock float mask (B, 1, L, L) equal to ``m_i * m_j`` with ``m`` in {0, 1}.

    Raises:
        NotImplementedError: a mask of another shape, or not such an outer product.
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        raise NotImplementedError(
            f"usp_dit's CogView4 processor routes the stock (batch, 1, L, L) mask only, got {tuple(mask.shape)}")
    m = mask[:, 0].diagonal(dim1=-2, dim2=-1)  # m_i * m_i = m_i for 0 / 1 values
    require(((m == 0) | (m == 1)).all() & (mask[:, 0] == m[:, :, None] * m[:, None, :]).all(),
            "usp_dit's CogView4 processor routes a mask m_i * m_j of a 0/1 vector m only (Note [CogView4's mask "
            "is a bias]): this attn_mask is not one")
    return m


def biased_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, scale: float | None, route: Route,
) -> torch.Tensor:
    """Note [CogView4's mask is a bias]: softmax(scale * q.k + m_i * m_j) v, routed.

    Args:
        q, k, v: (B, L, H, D), L = T + S_local as the route lays them out (text first).
        m: (B, L) 0/1 per token.
    Returns:
        (B, L, H, D).
    """
    head_dim = q.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    pad = q.new_zeros(*q.shape[:3], _CHANNELS - 1)
    bias_q = m.to(q.dtype)[:, :, None, None].expand(*q.shape[:3], 1)
    bias_k = (m.to(k.dtype) / scale)[:, :, None, None].expand(*k.shape[:3], 1)
    q_aug = torch.cat([q, bias_q, pad], dim=-1)
    k_aug = torch.cat([k, bias_k, k.new_zeros(*k.shape[:3], _CHANNELS - 1)], dim=-1)
    v_aug = torch.cat([v, v.new_zeros(*v.shape[:3], _CHANNELS)], dim=-1)
    out = route_attention(q_aug, k_aug, v_aug, None, 0.0, False, scale, parallel_config=route)
    return out[..., :head_dim]


class _RoutedFunctional:
    """Stands in for ``torch.nn.functional`` in the stock processor's code (Note [CogView4's attention
    call]): ``scaled_dot_product_attention`` is routed, every other name is torch's."""

    def __init__(self, route: Route) -> None:
        self.route = route

    def scaled_dot_product_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    ) -> torch.Tensor:
        """(B, H, L, D) in and out, L = T + S_local (text first)."""
        if attn_mask is None:
            return route_sdpa(query, key, value, None, dropout_p, is_causal, scale, self.route)
        if dropout_p or is_causal:
            raise NotImplementedError(f"usp_dit routes plain attention only, got dropout_p={dropout_p}, "
                                      f"is_causal={is_causal}")
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        return biased_attention(q, k, v, _key_weights(attn_mask), scale, self.route).transpose(1, 2)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)


def _routed_call(route: Route) -> types.FunctionType | None:
    """``CogView4AttnProcessor.__call__``'s code with ``F`` bound to a ``_RoutedFunctional(route)``."""
    return with_global(CogView4AttnProcessor.__call__, _ROUTED_GLOBAL, _RoutedFunctional(route))


class USPCogView4AttnProcessor:
    """CogView4 joint attention of this rank's image shard and the replicated text (text first).

    Inputs: ``hidden_states`` (B, S_local, C); ``encoder_hidden_states`` (B, T, C);
    ``attention_mask`` (B, T) 0/1 or ``None``; ``image_rotary_emb`` ``(cos, sin)`` (S_local, D)
    (cut by the plan's table). Returns ``(image_out (B, S_local, C), text_out (B, T, C))``, text_out
    equal on every rank. The maths is the stock processor's own code (Note [CogView4's attention call]).
    """

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, "first")
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPCogView4AttnProcessor:
        # Rebuild the routed function around the copied state (as sd3.USPJointAttnProcessor).
        clone = type(self)(copy.deepcopy(self.route.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._call(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def _routed_call_missing(transformer: CogView4Transformer2DModel) -> str | None:
    if _routed_call(Route(None)) is None:
        return (f"this diffusers' CogView4AttnProcessor does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


PLAN = ModelPlan(
    name="CogView4",
    model_class=CogView4Transformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn1", USPCogView4AttnProcessor, stock=(CogView4AttnProcessor,),
                 text="first"),
    ),
    block_lists=("transformer_blocks",),
    # rope(hidden_states) -> (cos (S, D), sin (S, D)): both cut on dim 0.
    tables=(Table("rope", dim=0, items=(0, 1)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a batch of prompts).
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "original_size", "target_size",
                    "crop_coords", "attention_mask"),
    # CogView4Pipeline's true CFG: one call per branch, differing in the text (cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "attention_mask"),
    refuse_args={"image_rotary_emb": "a RoPE table made by the caller, (S, D) over the whole sequence: let the "
                                     "model make it"},
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))


PLAN_3PLUS = ModelPlan(
    name="CogView3Plus",
    model_class=CogView3PlusTransformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    # Joint attention over [text; image], no RoPE, no mask: the CogVideoX family's processor.
    attention=(Parallel("transformer_blocks.*.attn1", USPCogVideoXAttnProcessor, stock=(CogVideoXAttnProcessor2_0,)),),
    block_lists=("transformer_blocks",),
    # CogView3PlusPipeline batches [uncond, cond] in one call: split over the "cfg" axis.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "original_size", "target_size",
                    "crop_coords"),
)

ADAPTER_3PLUS = register_adapter(PlanAdapter(PLAN_3PLUS, __name__))
