"""PRX adapter: ``PRXTransformer2DModel`` (``PRXPipeline``, ``PRXPixelPipeline``) on a USP grid.

Layout: latents (batch, C, H, W); image tokens (batch, N, hidden) after ``img2seq`` (p x p patches,
row-major, N = (H / p) * (W / p)) and ``img_in``; text embeddings (batch, T, context_in_dim)
projected by ``txt_in`` to (batch, T, hidden) once, before the blocks; the text mask
``attention_mask`` (batch, T) bool, True = a real token (the pipeline's tokenizer pads to
``max_length``: padding at the end, a different count per prompt); the RoPE table
``pe_embedder(img_ids)`` (batch, 1, N, head_dim / 2, 2, 2), the sequence on dim 2. In attention: Q
(batch, N, heads, head_dim) of the image alone, K/V (batch, T + N, heads, head_dim), ``[text; image]``.

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): ``txt_in``,
``img_in``, the timestep (and resolution) embeddings and the RoPE table run whole on every rank;
block 0's input is sharded; ``final_layer``'s output (batch, N_local, p * p * C) is gathered and
``seq2img`` folds the whole sequence; the RoPE table is a ``Table`` cut like the tokens.

Text: **replicated, keys and values only**. A PRX block has no text stream: every block projects
the (fixed) text to K/V (``txt_kv_proj``, ``norm_added_k``) and the image queries attend over
``[text; image]`` keys, the text keys masked per element (Note [PRX's image queries over text keys]).
At 1024 x 1024 (PRX-1.2B: 16x VAE (DC-AE) or 8x (Flux VAE), patch 2 / 1): 1024 to 4096 image
tokens, 256 to 1024 a rank on 4 ranks, beside a T5Gemma prompt of up to 256 tokens.

Note [PRX's image queries over text keys]
    ``PRXAttnProcessor2_0`` calls ``dispatch_attention_fn(img_query, [txt_key; img_key], ...,
    attn_mask=(B, 1, 1, T + N_local))``: N_local queries, T + N_local keys, the mask all True on
    the image. ``usp_attention`` takes joint tokens as queries *and* keys; so the routed call
    (``_route_image_queries``) gives the text positions queries of zeros, runs
    ``_routing.route_attention`` on ``[text; shard]`` (``Route(text="first")``; the mask's text
    part read per element: ``_routing`` Note [masked text tokens]) and keeps the image rows. The
    text rows' outputs are dropped, so they carry no gradient: the image queries' outputs and every
    gradient are stock's. The price is T extra query rows, about T / (N / P) of a rank's attention
    work (NucleusMoE-Image pays the same: ``usp_dit.pipelines.families.nucleus_moe``).

Refused (NotImplementedError): at enable, processors other than the stock ``PRXAttnProcessor2_0``
(LoRA-replaced, custom, Diffusers' context parallelism), attention modules the plan does not name,
a Diffusers cache that cannot run on a grid (FasterCache), no blocks, a processor that no longer
calls ``dispatch_attention_fn``; at the call, a processor replaced after enable; in the routed call,
a mask that masks an image key (stock builds none). ``PRXPipeline`` batches its CFG halves
``[uncond, cond]`` in one call: ``cfg_degree=2`` splits them over the cfg groups (``cfg_batch_args``).
PRX configs have no dropout. Tensor parallelism is refused (no ``TensorPlan``: ``img_qkv_proj``
packs Q, K and V in one weight).
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import PRXTransformer2DModel
from diffusers.models.transformers.transformer_prx import PRXAttention, PRXAttnProcessor2_0

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, one_rank_masked_call, route_attention, with_global
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, Table


def _route_image_queries(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None, parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn``'s signature for image queries over ``[text; image shard]`` keys
    (Note [PRX's image queries over text keys]).

    Args:
        query: (B, N_local, H, D), this rank's image queries.
        key, value: (B, T + N_local, H, D), every text key then this rank's image keys.
        attn_mask: ``None`` or the stock (B, 1, 1, T + N_local) bool key mask (image part all True).

    Returns:
        (B, N_local, H, D): each image query attended over every image key and its valid text keys.
    """
    text_len = key.shape[1] - query.shape[1]
    if text_len < 0:
        raise ValueError(f"a routed PRX attention call got {query.shape[1]} queries but only {key.shape[1]} keys")
    one_rank = one_rank_masked_call(query, key, value, attn_mask, parallel_config, scale, dropout_p, is_causal,
                                    attention_kwargs)
    if one_rank is not None:  # one rank: the image queries alone over the masked keys, as stock
        return one_rank
    text_queries = query.new_zeros(query.shape[0], text_len, *query.shape[2:])  # their outputs are dropped below
    out = route_attention(torch.cat([text_queries, query], dim=1), key, value, attn_mask, dropout_p, is_causal,
                          scale, enable_gqa, attention_kwargs, backend=backend, parallel_config=parallel_config)
    return out[:, text_len:]


# The stock __call__'s code with its one dispatch_attention_fn call routed; None if it makes no such call.
_ROUTED_CALL = with_global(PRXAttnProcessor2_0.__call__, ROUTED_NAME, _route_image_queries)


class USPPRXAttnProcessor(RoutedProcessor):
    """PRX attention of this rank's image queries over every image key and the replicated, masked
    text keys (Note [PRX's image queries over text keys]).

    Inputs as ``PRXAttention.forward`` passes them: ``hidden_states`` (B, N_local, C) (modulated);
    ``encoder_hidden_states`` (B, T, C) (projected text); ``attention_mask`` (B, T) bool or
    ``None``; ``image_rotary_emb`` (B, 1, N_local, D/2, 2, 2). Returns (B, N_local, C).
    """

    _stock_call = _ROUTED_CALL

    def __call__(
        self, attn: PRXAttention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, image_rotary_emb: torch.Tensor | None = None, **kwargs: Any,
    ) -> torch.Tensor:
        return type(self)._stock_call(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                                      image_rotary_emb, **kwargs)


def _routed_call_missing(transformer: PRXTransformer2DModel) -> str | None:
    if _ROUTED_CALL is None:
        return f"this diffusers' PRXAttnProcessor2_0 does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="PRX",
    model_class=PRXTransformer2DModel,
    split_at="blocks.0",
    gather_at="final_layer",  # per token (adaLN from the pooled vector, a linear): its output gathered
    attention=(
        # image queries over [text; image shard] keys, text first, replicated, masked per element
        Parallel("blocks.*.attention", USPPRXAttnProcessor, stock=(PRXAttnProcessor2_0,), text="first"),
    ),
    block_lists=("blocks",),
    # pe_embedder(img_ids) -> (B, 1, N, head_dim / 2, 2, 2): cut on dim 2 like the tokens.
    tables=(Table("pe_embedder", dim=2),),
    # PRXPipeline's CFG: one call of [uncond, cond] (mask included when the prompts are masked).
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "attention_mask"),
    heads=lambda model: model.config.num_heads,
    refuse=(_routed_call_missing,),
)
ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
