"""Layout glue shared by the PyTorch SDPA adapters: our (B, S, H, D) <-> SDPA's (B, H, S, D).

The transposes are views (no copy); SDPA kernels accept strided inputs whose last dim is contiguous.
"""
from __future__ import annotations

import torch

from usp_dit.kernels.protocol import expand_kv, lse_dtype, reduce_kv


def to_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(B, S, H, D) views -> (B, H, S, D) views, K/V expanded to the query heads (GQA)."""
    h = q.shape[2]
    return q.transpose(1, 2), expand_kv(k, h).transpose(1, 2), expand_kv(v, h).transpose(1, 2)


def grads_to_bshd(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, num_kv_heads: int):
    """(B, H, S, D) gradients -> (B, S, H, D), K/V gradients summed back onto their K/V heads."""
    return (
        dq.transpose(1, 2),
        reduce_kv(dk.transpose(1, 2), num_kv_heads),
        reduce_kv(dv.transpose(1, 2), num_kv_heads),
    )


def lse_to_bsh(lse: torch.Tensor, seq_q: int, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's LSE ((B, H, S), (B, H, S, 1) or padded along S) -> (B, S, H) view.

    Cast to ``lse_dtype(dtype)`` (float32, float64 for float64 inputs) where it differs.
    """
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[:, :, :seq_q].to(lse_dtype(dtype)).transpose(1, 2)


def lse_to_bhs(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Our (B, S, H) LSE -> the contiguous (B, H, S) tensor the SDPA backward kernels read."""
    return lse.transpose(1, 2).to(lse_dtype(dtype)).contiguous()


def additive_key_mask(key_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A (B, Sk) bool key mask (True = attend) -> the additive (B, 1, 1, Sk) mask of ``dtype`` the
    SDPA ops read (0 where attended, -inf where masked); ``None`` stays ``None``."""
    if key_mask is None:
        return None
    bias = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return bias.masked_fill(~key_mask, float("-inf"))[:, None, None, :]
