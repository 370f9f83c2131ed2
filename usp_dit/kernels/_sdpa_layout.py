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
    SDPA ops read (0 where attended, -inf where masked; the ops refuse a bool one); ``None`` stays
    ``None``. Rows are padded to a multiple of 8 elements, then cut: CUDA's mem-efficient kernel
    wants its bias's batch stride so (the CPU kernel takes any stride)."""
    if key_mask is None:
        return None
    batch, keys = key_mask.shape
    bias = torch.zeros(batch, (keys + 7) // 8 * 8, dtype=dtype, device=key_mask.device)[:, :keys]
    bias.masked_fill_(~key_mask, float("-inf"))  # in place: keeps the padded row stride
    return bias[:, None, None, :]


def keyless_rows(out: torch.Tensor, lse: torch.Tensor, key_mask: torch.Tensor | None):
    """``(out, lse)`` (B, S, H, D) / (B, S, H) with the protocol's result for a batch element whose
    keys are all masked: out 0, lse -inf (the SDPA kernels leave lse 0, and out 0 or NaN)."""
    if key_mask is None:
        return out, lse
    some = key_mask.any(dim=1)
    out = torch.where(some[:, None, None, None], out, torch.zeros_like(out))
    return out, lse.masked_fill(~some[:, None, None], float("-inf"))
