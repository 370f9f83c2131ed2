"""Attention inside a VAE over row pieces: each rank's queries against every rank's keys and values.

Layout: (batch, heads, tokens, head_dim) as ``F.scaled_dot_product_attention`` takes it; a rank's
tokens are its rows flattened (row-major within a frame), so concatenating the ranks' tokens in
rank order gives the whole image's (or frame's) tokens in the stock order.

The stock code of a VAE attention (Diffusers' ``AttnProcessor2_0``, Wan's attention block) runs
unchanged with its ``F`` bound to ``GATHERED_F`` (``_routing.with_global``): its
``scaled_dot_product_attention`` gathers K and V over the ranks (pieces of unequal length allowed)
and attends this rank's queries to all of them. The mid-block attention runs at the decoder's
lowest resolution, so the gathered K/V are small next to the activations of the upper levels.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
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
