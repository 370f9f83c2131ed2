"""AuraFlow adapter: ``AuraFlowTransformer2DModel`` (AuraFlow v0.1 - v0.3) on a USP grid.

Layout: latents (batch, channels, height, width); image tokens (batch, seq, channels),
``seq = (height / p) * (width / p)``, row-major as ``AuraFlowPatchEmbed`` flattens them; text tokens
(batch, 8 + text_seq, channels): the 8 learned register tokens, then the projected UMT5 tokens;
inside ``AuraFlowAttnProcessor2_0`` Q/K/V are (batch, seq, heads, head_dim) and the joint sequence
is ``[text; image]``: **text first**.

Where the tokens are split: ``pos_embed`` (patch embedding + its cropped learned position table,
added per token) runs on the full latent, and a forward hook on its output hands the blocks this
rank's image tokens; ``proj_out``'s output is gathered before unpatchify (``_token_sharding`` Note
[where the sequence is split]). AuraFlow has no RoPE: the positions are in the tokens when they
are split (as SD3's, ``usp_dit.pipelines.families.sd3``).

Text tokens (register tokens included): **replicated**. The MMDiT blocks
(``joint_transformer_blocks``) keep text in its own stream (``add_*_proj``, ``ff_context``), which
every rank holds whole; the single-stream blocks (``single_transformer_blocks``) run on
``torch.cat([text, image])``, which on a rank is ``[text; image shard]``: every per-token layer
(AdaLN, QK LayerNorms, projections, MLP) gives the same rows as one process, and attention takes
the text rows as joint tokens (``Route(state, text="first")``: the text length of a call is what
the shard leaves of its sequence). The model then keeps ``combined[:, text_len:]``, the image
shard. Per-rank tokens, AuraFlow v0.3 at 1024 x 1024 (4096 image tokens, 8 + 256 text): 1024
image + 264 text on 4 ranks, 512 + 264 on 8.

Note [AuraFlow's attention call]
    ``AuraFlowAttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` on (B, H, L, D) tensors,
    not ``dispatch_attention_fn``, exactly as SD3's ``JointAttnProcessor2_0`` does; the processor
    here runs the stock ``__call__``'s own code with ``F`` rebound to SD3's routed namespace
    (``sd3._RoutedFunctional``, Note [SD3's attention call]), one per processor instance. No mask
    reaches it (the model's forward takes none; the pipeline zeroes padded prompt embeddings,
    which stock attends to as it does here).

Refused (NotImplementedError): at enable, processors other than the stock ``AuraFlowAttnProcessor2_0``
(``FusedAuraFlowAttnProcessor2_0`` after ``fuse_qkv_projections``, LoRA-replaced, custom ones), a
Diffusers whose processor stops calling ``F.scaled_dot_product_attention``, an unsupported Diffusers
cache (``usp_dit.pipelines.caches``). AuraFlow configs have no dropout. ``AuraFlowPipeline`` batches
[uncond, cond] in one call, which ``cfg_degree=2`` splits.
"""
from __future__ import annotations

import copy
import types
from typing import Any

import torch
from diffusers import AuraFlowTransformer2DModel
from diffusers.models.attention_processor import Attention, AuraFlowAttnProcessor2_0

import usp_dit.pipelines.families.sd3 as sd3  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._routing import Route, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter
from usp_dit.pipelines.tensor import BlockCuts, Split, TensorPlan

_ROUTED_GLOBAL = "F"  # AuraFlowAttnProcessor2_0 calls F.scaled_dot_product_attention


def _routed_call(route: Route) -> types.FunctionType | None:
    """``AuraFlowAttnProcessor2_0.__call__``'s code with ``F`` bound to SD3's routed namespace."""
    return with_global(AuraFlowAttnProcessor2_0.__call__, _ROUTED_GLOBAL, sd3._RoutedFunctional(route))


class USPAuraFlowAttnProcessor:
    """AuraFlow attention of this rank's image shard with the replicated text first.

    Joint blocks: ``hidden_states`` (B, S_local, C), ``encoder_hidden_states`` (B, T, C); returns
    ``(image_out (B, S_local, C), text_out (B, T, C))``. Single-stream blocks: ``hidden_states``
    (B, T + S_local, C) = [text; image shard]; returns (B, T + S_local, C). The maths is the stock
    processor's own code (Note [AuraFlow's attention call]).
    """

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, "first")
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPAuraFlowAttnProcessor:
        # Rebuild the routed function around the copied state (Note [SD3's attention call]).
        clone = type(self)(copy.deepcopy(self.route.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        *args: Any, **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # The stock signature: Attention.forward passes what it names (the stock code ignores the rest).
        return self._call(self, attn, hidden_states, encoder_hidden_states, *args, **kwargs)


def _routed_call_missing(transformer: AuraFlowTransformer2DModel) -> str | None:
    if _routed_call(Route(None)) is None:
        return (f"this diffusers' AuraFlowAttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


_STOCK = (AuraFlowAttnProcessor2_0,)

# Tensor parallelism (usp_dit.pipelines.tensor Note [tensor plans]): the attention's heads (image
# and text projections, both outputs) and the gated MLPs' hidden widths (silu(linear_1) * linear_2,
# two column-parallel Linears, out_projection row-parallel). Every Linear is bias-free; the QK
# norms are LayerNorms over head_dim, per head: exact on a rank's heads (the processor reads the
# head count from ``attn.heads``); the AdaLN modulation and the pre-MLP LayerNorms stay whole.
_ATTN = ("attn.to_q", "attn.to_k", "attn.to_v")
_TENSOR = TensorPlan((
    BlockCuts("joint_transformer_blocks", splits=(
        Split(columns=(*_ATTN, "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
              rows=("attn.to_out.0", "attn.to_add_out"), heads="attn"),
        Split(columns=("ff.linear_1", "ff.linear_2"), rows=("ff.out_projection",)),
        Split(columns=("ff_context.linear_1", "ff_context.linear_2"), rows=("ff_context.out_projection",)),
    )),
    BlockCuts("single_transformer_blocks", splits=(
        Split(columns=_ATTN, rows=("attn.to_out.0",), heads="attn"),
        Split(columns=("ff.linear_1", "ff.linear_2"), rows=("ff.out_projection",)),
    )),
))

PLAN = ModelPlan(
    name="AuraFlow",
    model_class=AuraFlowTransformer2DModel,
    # pos_embed's output: the image tokens with their positions added (its input is the latent).
    split_at="pos_embed",
    split="output",
    gather_at="proj_out",
    attention=(
        Parallel("joint_transformer_blocks.*.attn", USPAuraFlowAttnProcessor, stock=_STOCK, text="first"),
        Parallel("single_transformer_blocks.*.attn", USPAuraFlowAttnProcessor, stock=_STOCK, text="first"),
    ),
    block_lists=("joint_transformer_blocks", "single_transformer_blocks"),
    # Batched on dim 0, split over the "cfg" axis by enable_usp: AuraFlowPipeline batches [uncond, cond].
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep"),
    refuse=(_routed_call_missing,),
    tensor=_TENSOR,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
