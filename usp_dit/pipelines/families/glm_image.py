"""GLM-Image adapter: ``GlmImageTransformer2DModel`` (GLM-Image's diffusion decoder; ``GlmImagePipeline``) on a USP grid.

Layout: latents (batch, channels, height, width); image tokens (batch, N, channels),
``N = (height / p) * (width / p)``, row-major as ``image_projector`` flattens them; each image
token's prior (an AR-generated VQ token) ``prior_token_id`` (batch, N), embedded and added to it
before the blocks; text (glyph) tokens (batch, T, channels); inside ``GlmImageAttnProcessor`` Q/K/V
(batch, T + N, heads, head_dim) over ``[text; image]`` (**text first**); the RoPE table
``rope(hidden_states)`` returns ``(cos, sin)``, each (N, head_dim), **the sequence on dim 0**,
rotating the image tokens only; an optional ``attention_mask`` (batch, T), 1 for a real text token.

GLM-Image's decoder is CogView4's block (``usp_dit.pipelines.families.cogview4``): a
single-attention MMDiT whose text keeps its own stream (its own norms and gates) and shares the
attention and feed-forward weights. It is run as CogView4 is:

* the patch embedding, the prior embedding (added per token), the glyph projection and the
  timestep / size embeddings run whole on every rank; ``transformer_blocks.0``'s input is sharded
  and ``proj_out``'s output gathered (``_token_sharding`` Note [where the sequence is split]); the
  RoPE table is the plan's ``Table("rope", dim=0)``: this rank's rows, once per forward;
* text tokens are **replicated**: ``usp_attention`` takes them as joint tokens
  (``Route(state, text="first")``). GLM-Image at 1024 x 1024 has 64 x 64 = 4096 image tokens (512
  a rank on 8) beside a glyph prompt of the quoted text only (usually tens of tokens);
* the processor calls ``dispatch_attention_fn`` (routed, ``_routing``); with a text mask it turns
  it into the float (B, 1, L, L) ``m_i * m_j`` **bias** CogView4's processor makes, which the
  routed call keeps exactly with cogview4's Note [CogView4's mask is a bias] (one more head
  channel). ``GlmImagePipeline`` passes no mask.

CFG: ``GlmImagePipeline`` calls the transformer once per guidance branch (true CFG: the prompt's
glyph embeddings and priors, then the negative glyph embeddings with every prior dropped): with
``cfg_degree=2`` a step's two calls run on the two cfg groups at once (``cfg_branch_args``).

Refused (NotImplementedError): at enable, processors other than the stock
``GlmImageAttnProcessor`` (LoRA-replaced, custom, Diffusers' context parallelism), attention
modules the plan does not name, an unsupported Diffusers cache, ``num_layers=0``; at the call,
``image_rotary_emb`` passed by the caller (a table the plan does not see made), a processor
replaced after enable, a mask that is not the outer product of a 0/1 key vector, and
``kv_caches`` in "write" or "read" mode: image-to-image (editing) first runs each condition image
through the model to store its K/V, then prepends them to every later call's keys; those keys
would be this rank's shard of the condition image alone (mode None or "skip", text-to-image's,
runs). GLM-Image has no dropout. Tensor parallelism is refused (no ``TensorPlan``).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import GlmImageTransformer2DModel
from diffusers.models.transformers.transformer_glm_image import GlmImageAttnProcessor

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, route_attention, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.families.cogview4 import _key_weights, biased_attention
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, Table, TransformerPreHook


def route_glm_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None, parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn``'s signature: (B, L, H, D) in and out, L = T + N_local (text first).
    No mask: ``route_attention``. GLM-Image's float (B, 1, L, L) ``m_i * m_j`` mask: its bias kept
    exactly (cogview4 Note [CogView4's mask is a bias])."""
    if attn_mask is None:
        return route_attention(query, key, value, None, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
                               backend=backend, parallel_config=parallel_config)
    if dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(f"usp_dit routes plain attention only, got dropout_p={dropout_p}, "
                                  f"is_causal={is_causal}, attention_kwargs={attention_kwargs}")
    return biased_attention(query, key, value, _key_weights(attn_mask), scale, parallel_config)


# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_routed_call = with_global(GlmImageAttnProcessor.__call__, ROUTED_NAME, route_glm_attention)


class USPGlmImageAttnProcessor(RoutedProcessor):
    """GLM-Image joint attention of this rank's image shard and the replicated text (text first).

    Inputs: ``hidden_states`` (B, N_local, C); ``encoder_hidden_states`` (B, T, C);
    ``attention_mask`` (B, T) 0/1 or ``None``; ``image_rotary_emb`` ``(cos, sin)`` (N_local, D)
    (cut by the plan's table); ``kv_cache`` unused (None or "skip" mode: refused otherwise).
    Returns ``(image_out (B, N_local, C), text_out (B, T, C))``. The stock processor's own code."""

    _stock_call = _routed_call

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _routed_call(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                            kv_cache)


class GlmImageKVCacheCheck(TransformerPreHook):
    """A forward pre-hook refusing ``kv_caches`` in "write" or "read" mode (the condition images'
    K/V of image-to-image: this rank's shard of them alone would be stored and prepended)."""

    def __init__(self, transformer: GlmImageTransformer2DModel, state: ShardState) -> None:
        super().__init__(transformer, state)
        self.signature = inspect.signature(type(transformer).forward)

    def _check(self, module, args: tuple, kwargs: dict) -> None:
        caches = self.signature.bind_partial(module, *args, **kwargs).arguments.get("kv_caches")
        modes = {cache.mode for cache in getattr(caches, "caches", ())} - {None, "skip"}
        if modes:
            raise NotImplementedError(
                f"usp_dit's GlmImage adapter does not shard kv_caches in mode {sorted(modes)} (image-to-image's "
                f"condition-image K/V, stored and prepended to every call's keys): call disable_usp() for editing"
            )


def _routed_call_missing(transformer: GlmImageTransformer2DModel) -> str | None:
    if _routed_call is None:
        return f"this diffusers' GlmImageAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="GlmImage",
    model_class=GlmImageTransformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn1", USPGlmImageAttnProcessor, stock=(GlmImageAttnProcessor,),
                 text="first"),
    ),
    block_lists=("transformer_blocks",),
    # rope(hidden_states) -> (cos (N, D), sin (N, D)): both cut on dim 0.
    tables=(Table("rope", dim=0, items=(0, 1)),),
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "prior_token_id", "prior_token_drop", "timestep",
                    "target_size", "crop_coords", "attention_mask"),
    # GlmImagePipeline's true CFG: one call per branch, differing in the glyph text and the dropped priors.
    cfg_branch_args=("encoder_hidden_states", "prior_token_drop", "attention_mask"),
    hooks=(GlmImageKVCacheCheck,),
    refuse_args={"image_rotary_emb": "a RoPE table made by the caller, (N, D) over the whole image: let the "
                                     "model make it"},
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
