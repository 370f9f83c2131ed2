"""SD3 adapter: ``SD3Transformer2DModel`` (Stable Diffusion 3 Medium, 3.5 Large / Medium) on a USP grid.

Layout: latents (batch, channels, height, width); image tokens (batch, seq, channels),
``seq = (height / p) * (width / p)``, row-major as ``PatchEmbed`` flattens them; text tokens
(batch, text_seq, channels), no mask (the pipeline's CLIP and T5 tokens, padding included, are
all attended, in stock too); inside ``JointAttnProcessor2_0`` Q/K/V are (batch, heads, seq, head_dim)
and the joint sequence is ``[image; text]``: **image first, text last**.

Where the tokens are split: ``pos_embed`` (patch embedding + the cropped sin-cos position table,
added per token) runs on the full latent, and a forward hook on it hands the blocks this rank's
tokens; ``proj_out``'s output is gathered before unpatchify (``_token_sharding`` Note [where the
sequence is split], with the split moved from block 0's input to ``pos_embed``'s output because
``forward(skip_layers=...)`` (the pipeline's skip-layer guidance) may skip block 0 itself). SD3
has no RoPE: the positions are already in the tokens when they are split.

Text tokens: **replicated**. SD3 is an MMDiT: text keeps its own stream (``add_*_proj``,
``ff_context``) and every rank holds all of it; ``usp_attention`` takes it as joint tokens
(``Route(state, text="last")``). SD3's text is 77 CLIP + up to 256 T5 tokens = 333 beside 4096
image tokens at 1024 x 1024 (512 per rank on 8 ranks, + 333 text). The last block is
``context_pre_only`` (no ``to_add_out``, its text output dropped), as in stock.
SD3.5 Medium's dual-attention layers have ``attn2``: self-attention over the image tokens alone,
routed with ``Route(state, text="none")``.

Note [SD3's attention call]
    ``JointAttnProcessor2_0`` does not call ``dispatch_attention_fn``: it calls
    ``F.scaled_dot_product_attention(q, k, v)`` on (B, H, L, D) tensors. To keep its maths (the
    projections, optional RMS QK norms, concatenation, split and output projections), the
    processor here runs the stock ``__call__``'s own code with its module global ``F`` rebound
    (``_routing.with_global``) to a namespace whose ``scaled_dot_product_attention`` transposes to
    (B, L, H, D) and calls ``_routing.route_attention``, the shared router, with this processor's
    ``Route``; every other ``F.`` name resolves to ``torch.nn.functional``. The stock code passes no
    ``self._parallel_config``, so the route lives in the namespace, one per processor instance
    (joint and self-attention differ); a deep copy of the processor (an EMA copy of an enabled
    transformer: ``base`` Note [deep copies]) rebuilds that function around the copied route.
    Writing a processor of our own would have meant copying the stock maths; this is the same
    code object, so a Diffusers fix to it is picked up. If a future Diffusers' processor stops
    calling ``F.scaled_dot_product_attention``, ``with_global`` returns ``None`` and enable refuses.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]): split at
``pos_embed``'s output (``split="output"``), gather at ``proj_out``, ``attn`` parallel (text last),
``attn2`` parallel (image only), the call-time checks the plan's ``CallChecks`` (ControlNet residuals in ``refuse_args``).

Refused (NotImplementedError): at enable, processors other than the stock ``JointAttnProcessor2_0``
(fused QKV, IP-Adapter, PAG, LoRA-replaced or custom ones), attention modules the plan does not
name, an unsupported Diffusers cache (``usp_dit.pipelines.caches``), ``num_layers=0``; at the call (the plan's ``CallChecks``),
``block_controlnet_hidden_states`` (SD3 ControlNet: full-sequence residuals) and a processor
replaced after enable (a PAG pipeline swaps them at call time). (An ``attention_mask`` handed to
the processor is ignored, as the stock code ignores it: it never reaches its attention call.)
SD3 configs have no dropout. The pipeline batches its CFG halves in one transformer call, so
``cfg_degree=2`` splits them; its skip-layer-guidance call (``skip_guidance_layers``) has batch 1,
which ``cfg_degree=2`` cannot split (``enable_usp`` raises there).
"""
from __future__ import annotations

import copy
import types
from typing import Any

import torch
import torch.nn.functional
from diffusers import SD3Transformer2DModel
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

from usp_dit.pipelines._routing import Route, route_sdpa, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter

_ROUTED_GLOBAL = "F"  # JointAttnProcessor2_0 calls F.scaled_dot_product_attention (torch.nn.functional as F)


class _RoutedFunctional:
    """Stands in for ``torch.nn.functional`` in the stock processor's code: ``scaled_dot_product_attention``
    is routed (Note [SD3's attention call]), every other name is torch's."""

    def __init__(self, route: Route) -> None:
        self.route = route

    def scaled_dot_product_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    ) -> torch.Tensor:
        """(B, H, L, D) in and out, L = S_local (+ T, text last): ``route_attention`` on (B, L, H, D) views."""
        return route_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, self.route)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)


def _routed_call(route: Route) -> types.FunctionType | None:
    """``JointAttnProcessor2_0.__call__``'s code with ``F`` bound to a ``_RoutedFunctional(route)``."""
    return with_global(JointAttnProcessor2_0.__call__, _ROUTED_GLOBAL, _RoutedFunctional(route))


class USPJointAttnProcessor:
    """SD3 attention of this rank's image shard: joint with the replicated text (``attn``,
    ``USPSD3JointProcessor``, text last) or self-attention over the image alone (SD3.5's ``attn2``,
    ``USPSD3ImageProcessor``); ``text`` is the subclass's ``Route`` text mode.

    Inputs: ``hidden_states`` (B, S_local, C); ``encoder_hidden_states`` (B, T, C) for ``attn``,
    ``None`` for ``attn2``. Returns ``(image_out (B, S_local, C), text_out (B, T, C))`` (text_out
    before ``to_add_out`` in the ``context_pre_only`` block, as stock) or ``image_out`` alone.
    The maths is the stock processor's own code (Note [SD3's attention call]).
    """

    text: str = "none"

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, self.text)
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPJointAttnProcessor:
        # Rebuild the routed function around the copied state (Note [SD3's attention call]).
        clone = type(self)(copy.deepcopy(self.route.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # The signature is the stock one: Attention.forward passes the keyword arguments it names
        # (here, like stock, all of them; the stock code ignores the extra ones).
        joint = self.text != "none"
        if joint != (encoder_hidden_states is not None):
            raise ValueError(
                f"this SD3 processor routes {'joint' if joint else 'self-'}attention, but encoder_hidden_states is "
                f"{'None' if encoder_hidden_states is None else 'given'}: it was installed on the wrong attention"
            )
        return self._call(self, attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)


class USPSD3JointProcessor(USPJointAttnProcessor):
    """``attn``: joint attention over ``[image shard; text]``, the text replicated and last."""

    text = "last"


class USPSD3ImageProcessor(USPJointAttnProcessor):
    """SD3.5's ``attn2``: self-attention over the image tokens alone."""

    text = "none"


def _routed_call_missing(transformer: SD3Transformer2DModel) -> str | None:
    if _routed_call(Route(None)) is None:
        return (f"this diffusers' JointAttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


PLAN = ModelPlan(
    name="SD3",
    model_class=SD3Transformer2DModel,
    # pos_embed's output, the tokens with their positions added (its input is the latent):
    # outside the blocks, so the split holds when skip_layers skips block 0.
    split_at="pos_embed",
    split="output",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn", USPSD3JointProcessor, stock=(JointAttnProcessor2_0,), text="last"),
        Parallel("transformer_blocks.*.attn2", USPSD3ImageProcessor, stock=(JointAttnProcessor2_0,)),
    ),
    block_lists=("transformer_blocks",),
    # Batched on dim 0, split over the "cfg" axis by enable_usp: StableDiffusion3Pipeline batches
    # [uncond, cond] in one call.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
    refuse_args={"block_controlnet_hidden_states": "SD3 ControlNet's residuals, (B, S, C) over the whole sequence"},
    refuse=(_routed_call_missing,),
)


ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
