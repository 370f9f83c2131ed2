"""HunyuanDiT adapter: ``HunyuanDiT2DModel`` (HunyuanDiT v1.0 - v1.2, -Distilled) on a USP grid.

Layout: latents (batch, channels, height, width); image tokens (batch, seq, channels), ``seq =
(height / p) * (width / p)`` row-major as ``PatchEmbed`` flattens them (no position table there);
text (batch, 77 + 256, cross_attention_dim): the Bert (CLIP-like) tokens then the projected mT5
tokens, each prompt's padding replaced by the learned ``text_embedding_padding`` rows before the
blocks, replicated on every rank; the 2D RoPE table the pipeline passes as ``image_rotary_emb``:
``(cos, sin)``, each (seq, head_dim); inside ``HunyuanAttnProcessor2_0`` Q/K/V are (batch, heads,
seq, head_dim).

Per block (``HunyuanDiTBlock``):

* ``attn1``: self-attention over the image tokens, RoPE on Q and K: sequence-parallel. The stock
  ``HunyuanAttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` directly; its own code runs
  with ``F`` rebound to SD3's routed namespace (``usp_dit.pipelines.families.sd3`` Note [SD3's
  attention call]): the projections, QK norms and RoPE are stock's on this rank's rows, only the
  attention call goes to ``usp_attention`` (Ulysses x Ring over the image tokens, no text).
* ``attn2``: cross-attention from this rank's image tokens (queries, RoPE on them) to the
  replicated text: the stock processor runs on the shard (``Local``), no communication. Stock
  passes no mask: the padding is already the learned rows, per element, before the split.
* the long skip connections: block ``i > L/2`` concatenates its input with block ``L - 1 - i``'s
  output, token by token (``skip_norm``, ``skip_linear``): both are this rank's rows of the same
  tokens, so they stay on the shard.

The RoPE table is a forward argument, not a submodule's output: a pre-hook on every block hands it
this rank's rows (``local_rope``, cut like the tokens), so both attentions rotate the right rows.
The tokens are split at ``blocks.0``'s input and gathered at ``proj_out``'s output (``_token_sharding``
Note [where the sequence is split]); ``norm_out``'s modulation is per element. HunyuanDiT at 1024 x
1024: 64 x 64 = 4096 image tokens (512 a rank on 8), 77 + 256 text tokens replicated.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]).
``HunyuanDiTPipeline`` batches [uncond, cond] in one call: ``cfg_degree=2`` splits it (the RoPE
table, one for the batch, stays whole).

Refused (NotImplementedError): at enable, processors other than the stock ``HunyuanAttnProcessor2_0``
(fused QKV, PAG's, LoRA-replaced or custom ones), an unsupported Diffusers cache, ``num_layers=0``;
at the call, ``controlnet_block_samples`` (HunyuanDiT ControlNet: residuals over the whole sequence)
and a RoPE table that is not a ``(cos, sin)`` pair with one row per image token.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import HunyuanDiT2DModel
from diffusers.models.attention_processor import Attention, HunyuanAttnProcessor2_0
from torch.utils.hooks import RemovableHandle

import usp_dit.pipelines.families.sd3 as sd3  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._routing import Route, with_global
from usp_dit.pipelines._token_sharding import ShardState, local_rope
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter

_ROUTED_GLOBAL = "F"  # HunyuanAttnProcessor2_0 calls F.scaled_dot_product_attention (torch.nn.functional as F)
_ROPE = "image_rotary_emb"  # HunyuanDiT2DModel passes it to every block as a keyword


def _routed_call(route: Route) -> Any:
    """``HunyuanAttnProcessor2_0.__call__``'s code with ``F`` bound to SD3's ``_RoutedFunctional(route)``,
    or ``None`` when that code no longer reads ``F``."""
    return with_global(HunyuanAttnProcessor2_0.__call__, _ROUTED_GLOBAL, sd3._RoutedFunctional(route))


class USPHunyuanDiTSelfAttnProcessor:
    """``attn1`` of this rank's image shard: self-attention over every image token of the grid.

    Inputs (as ``Attention.forward`` passes them): ``hidden_states`` (B, S_local, C);
    ``image_rotary_emb`` this rank's rows ``(cos, sin)`` (S_local, head_dim) (cut by ``HunyuanDiTRopeHooks``);
    no text, no mask. Returns (B, S_local, C): stock's rows for this rank's tokens.
    """

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, "none")
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPHunyuanDiTSelfAttnProcessor:
        # Rebuild the routed function around the copied state (sd3 Note [SD3's attention call]).
        clone = type(self)(copy.deepcopy(self.route.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's HunyuanDiT adapter runs attn1 as unmasked self-attention over the image tokens; it got "
                f"encoder_hidden_states={'given' if encoder_hidden_states is not None else None}, "
                f"attention_mask={'given' if attention_mask is not None else None}"
            )
        return self._call(self, attn, hidden_states, None, None, temb, image_rotary_emb)


@dataclass(eq=False)
class HunyuanDiTRopeHooks:
    """A pre-hook on every block: its ``image_rotary_emb`` keyword (S, head_dim) tables -> this
    rank's rows (S_local, head_dim), sliced like the tokens (block 0's token hook, installed
    before, has recorded the call's token count)."""

    transformer: torch.nn.Module
    state: ShardState
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        for block in self.transformer.blocks:
            self.handles.append(block.register_forward_pre_hook(self._cut, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) > 3:  # HunyuanDiTBlock.forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb, ...)
            raise NotImplementedError("usp_dit's HunyuanDiT adapter: image_rotary_emb passed positionally to a block")
        if kwargs.get(_ROPE) is not None:
            kwargs = {**kwargs, _ROPE: local_rope(kwargs[_ROPE], self.state, _ROPE)}
        return args, kwargs


def _routed_call_missing(model: torch.nn.Module) -> str | None:
    if _routed_call(Route(None)) is None:
        return (f"this diffusers' HunyuanAttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


PLAN = ModelPlan(
    name="HunyuanDiT",
    model_class=HunyuanDiT2DModel,
    split_at="blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("blocks.*.attn1", USPHunyuanDiTSelfAttnProcessor, stock=(HunyuanAttnProcessor2_0,)),
        Local("blocks.*.attn2", stock=(HunyuanAttnProcessor2_0,)),
    ),
    block_lists=("blocks",),
    # HunyuanDiTPipeline batches [uncond, cond] in one call (image_rotary_emb is one table for all).
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "text_embedding_mask",
                    "encoder_hidden_states_t5", "text_embedding_mask_t5", "image_meta_size", "style"),
    hooks=(HunyuanDiTRopeHooks,),
    refuse=(_routed_call_missing,),
    refuse_args={"controlnet_block_samples": "HunyuanDiT ControlNet's residuals, (B, S, C) over the whole sequence"},
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
