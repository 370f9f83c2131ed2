"""Attention inside a VAE over row pieces: each rank's queries against every rank's keys and values.

Layout: (batch, heads, tokens, head_dim) as ``F.scaled_dot_product_attention`` takes it; a rank's
tokens are its rows flattened (row-major within a frame), so concatenating the ranks' tokens in
rank order gives the whole image's (or frame's) tokens in the stock order.

The stock code of a VAE attention (Diffusers' ``AttnProcessor2_0``, Wan's attention block) runs
unchanged with its ``F`` bound to ``GATHERED_F`` (``_routing.with_global``): its
``scaled_dot_product_attention`` gathers K and V over the ranks (pieces of unequal length allowed)
and attends this rank's queries to all of them. The mid-block attention runs at the decoder's
lowest resolution, so the gathered K/V are small next to the activations of the upper levels.

DC-AE's ReLU linear attention (``SanaMultiscaleLinearAttention``; layout (batch, heads, head_dim,
tokens)) needs no K/V: its one sum over tokens, V' K^T ((batch, heads, head_dim + 1, head_dim)),
is all-reduced (``linear_attention``). Its processor picks the quadratic form for a piece of at
most ``attention_head_dim`` tokens; ``quadratic_attention`` decides on every rank's tokens instead,
as the whole image does (Note [DC-AE attention path]).

Cosmos 1's tokenizer (``CosmosCausalAttention``) attends over space with its spatial processor
(keys and values gathered: ``cosmos_attention_forward``) and over one pixel's frames with its
temporal one (per row: unchanged).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import functools

import torch
import torch.distributed as dist
import torch.nn.functional

from usp_dit.distributed.comm import gather_uneven
from usp_dit.pipelines.vae.halo import active, gathered_counts

TOKENS = -2


def _gathered_mask(mask: torch.Tensor, keys: int, queries: int) -> torch.Tensor:
    """A mask over the gathered keys: only one ``hunyuan_causal_mask`` built (columns = ``keys``),
    possibly followed by the ``queries`` zero columns that ``Attention.prepare_attention_mask``
    appends when a mask's length differs from the local sequence's (they are cut off here)."""
    if mask.shape[-1] == keys + queries and not mask[..., keys:].any():
        mask = mask[..., :keys]
    if mask.shape[-1] != keys:
        raise NotImplementedError(
            f"parallel VAE: an attention mask over {mask.shape[-1]} keys, not the {keys} keys of every rank's rows"
        )
    return mask


def hunyuan_causal_mask(num_frames: int, height_width: int, dtype, device, batch_size: int | None = None, *,
                        stock: Callable[..., torch.Tensor] | None = None):
    """HunyuanVideo's (and 1.5's) frame-causal mask (a token sees every token of its own and earlier
    frames) for this rank's queries against every rank's keys, keys in gathered order (rank, frame,
    row, column): (batch, local tokens, all tokens). Outside a parallel decode, ``stock`` (default
    HunyuanVideo's ``prepare_causal_attention_mask``; 1.5's own staticmethod builds the same mask)."""
    rows = active()
    if rows is None:
        if stock is None:
            from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import (
                prepare_causal_attention_mask as stock,
            )
        return stock(num_frames, height_width, dtype, device, batch_size=batch_size)
    frames = torch.arange(num_frames, device=device)
    per_frame = gathered_counts(height_width, rows, device)
    query_frame = frames.repeat_interleave(height_width)
    key_frame = torch.cat([frames.repeat_interleave(n) for n in per_frame])
    mask = torch.zeros(query_frame.numel(), key_frame.numel(), dtype=dtype, device=device)
    mask.masked_fill_(key_frame[None, :] > query_frame[:, None], float("-inf"))
    return mask if batch_size is None else mask.unsqueeze(0).expand(batch_size, -1, -1)


class _GatheredFunctional:
    """Stands in for ``torch.nn.functional`` in a VAE attention's code (every other name is torch's)."""

    @staticmethod
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        rows = active()
        if rows is None:
            return torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
        if is_causal or dropout_p:
            raise NotImplementedError("parallel VAE: a causal attention or one with dropout is not split")
        sizes = gathered_counts(key.shape[TOKENS], rows, key.device)
        key = gather_uneven(key.contiguous(), sizes, TOKENS, rows.group)
        value = gather_uneven(value.contiguous(), sizes, TOKENS, rows.group)
        if attn_mask is not None:
            attn_mask = _gathered_mask(attn_mask, key.shape[TOKENS], query.shape[TOKENS])
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)


GATHERED_F = _GatheredFunctional()


class _GatheredNN:
    """Stands in for ``torch.nn`` in a VAE attention whose code calls ``nn.functional.scaled_dot_product_attention``
    (HunyuanVideo 1.5's): its ``functional`` is ``GATHERED_F``, every other name torch's."""

    functional = GATHERED_F

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn, name)


GATHERED_NN = _GatheredNN()


# ---- DC-AE's linear attention --------------------------------------------------------------------

def _all_sum(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def _linear(attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows) -> torch.Tensor:
    """The stock ``apply_linear_attention`` with its sum over tokens (V' K^T, V' = V with a row of
    ones for the normaliser) taken over every rank's tokens: (batch, heads, head_dim, local tokens)."""
    value = torch.nn.functional.pad(value, (0, 0, 0, 1), mode="constant", value=1)
    scores = _all_sum(torch.matmul(value, key.transpose(-1, -2)), rows.group)  # (B, h, d + 1, d)
    out = torch.matmul(scores, query).to(dtype=torch.float32)
    return out[:, :, :-1] / (out[:, :, -1:] + attn.eps)


def _whole_tokens(key: torch.Tensor, rows) -> tuple[list[int], int]:
    sizes = gathered_counts(key.shape[-1], rows, key.device)
    return sizes, sum(sizes)


def linear_attention(attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``SanaMultiscaleLinearAttention.apply_linear_attention`` over row pieces (bound to the module).

    Note [DC-AE attention path]
        The stock processor takes the linear form when the (piece's) height x width exceeds
        ``attention_head_dim``, else the quadratic one, in float32 only for the linear form. Both
        replaced methods first count every rank's tokens (one small all-gather, on every rank, so
        the collectives match whichever form a rank's processor picked) and then compute the form
        the whole image takes: linear (sums all-reduced; the quadratic entry upcasts to float32 as
        the stock linear path does) or quadratic (K and V gathered). A piece can have few tokens
        while the image has many, never the other way round."""
    rows = active()
    if rows is None:
        return type(attn).apply_linear_attention(attn, query, key, value)
    _whole_tokens(key, rows)  # the same collectives as quadratic_attention (the Note)
    return _linear(attn, query, key, value, rows)


def quadratic_attention(attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``SanaMultiscaleLinearAttention.apply_quadratic_attention`` over row pieces (Note [DC-AE attention path])."""
    rows = active()
    if rows is None:
        return type(attn).apply_quadratic_attention(attn, query, key, value)
    sizes, tokens = _whole_tokens(key, rows)
    if tokens > attn.attention_head_dim:  # the whole image's form: linear, in float32, back in the input's dtype
        return _linear(attn, query.float(), key.float(), value.float(), rows).to(query.dtype)
    key = gather_uneven(key.contiguous(), sizes, -1, rows.group)
    value = gather_uneven(value.contiguous(), sizes, -1, rows.group)
    return type(attn).apply_quadratic_attention(attn, query, key, value)


# ---- Cosmos 1's tokenizer ---------------------------------------------------------------------------

@functools.cache
def _cosmos_spatial_call() -> Callable:
    """``CosmosSpatialAttentionProcessor2_0.__call__`` with its ``F`` bound to ``GATHERED_F`` (built once)."""
    from diffusers.models.autoencoders.autoencoder_kl_cosmos import CosmosSpatialAttentionProcessor2_0

    from usp_dit.pipelines._routing import with_global

    return with_global(CosmosSpatialAttentionProcessor2_0.__call__, "F", GATHERED_F)


def cosmos_attention_forward(attn, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """``CosmosCausalAttention.forward`` over row pieces (bound to the module; hidden_states
    (batch, channels, frames, local rows, width)). The spatial processor attends each frame's
    tokens (rows x width, row-major) to every rank's: its code runs with K/V gathered (it is called
    without a mask). The temporal processor attends each pixel to its own frames: per row, stock.
    The recipe admits only these two stock processors (``recipes._cosmos_refuse``)."""
    from diffusers.models.autoencoders.autoencoder_kl_cosmos import CosmosSpatialAttentionProcessor2_0

    if type(attn.processor) is CosmosSpatialAttentionProcessor2_0:
        return _cosmos_spatial_call()(attn.processor, attn, hidden_states=hidden_states, attention_mask=attention_mask)
    return attn.processor(attn, hidden_states=hidden_states, attention_mask=attention_mask)
