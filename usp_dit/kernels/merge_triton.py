"""Fused, in-place LSE merge on CUDA (Triton): one kernel per merged block.

Layout: acc_out (B, S, H, D) float32 contiguous; acc_lse (B, S, H) float32 contiguous;
blk_out (B, S, H, D) any strides with a contiguous last dim (kernels often return (B, H, S, D)
memory viewed as (B, S, H, D)); blk_lse (B, S, H) any strides.

Per row (b, s, h), with the maths of ``usp_dit.merge``:
    l   = max(la, lb) + log(exp(la - max) + exp(lb - max))
    out = exp(la - l) * out_a + exp(lb - l) * out_b
The unfused PyTorch version reads and writes the float32 accumulator four times and launches about
eight kernels; this reads each input once and writes the accumulator once.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch merge is used
    triton = None


def available(t: torch.Tensor) -> bool:
    """True when the fused merge can run on ``t``'s device."""
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def _merge_kernel(
        acc_out, acc_lse, blk_out, blk_lse,
        S, H,
        ao_b, ao_s, ao_h, al_b, al_s, al_h,
        bo_b, bo_s, bo_h, bl_b, bl_s, bl_h,
        D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        b = pid_bh // H
        h = pid_bh % H
        s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        row_ok = s < S
        la = tl.load(acc_lse + b * al_b + s * al_s + h * al_h, mask=row_ok, other=0.0)
        lb = tl.load(blk_lse + b * bl_b + s * bl_s + h * bl_h, mask=row_ok, other=0.0).to(tl.float32)
        m = tl.maximum(la, lb)
        m = tl.where(m == float("-inf"), 0.0, m)  # both sides empty: keep -inf, avoid nan
        ea = tl.exp(la - m)
        eb = tl.exp(lb - m)
        total = ea + eb
        new_lse = m + tl.log(total)
        total = tl.where(total == 0.0, 1.0, total)
        wa = ea / total
        wb = eb / total
        mask = row_ok[:, None] & (d[None, :] < D)
        a_ptr = acc_out + b * ao_b + s[:, None] * ao_s + h * ao_h + d[None, :]
        b_ptr = blk_out + b * bo_b + s[:, None] * bo_s + h * bo_h + d[None, :]
        oa = tl.load(a_ptr, mask=mask, other=0.0)
        ob = tl.load(b_ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(a_ptr, oa * wa[:, None] + ob * wb[:, None], mask=mask)
        tl.store(acc_lse + b * al_b + s * al_s + h * al_h, new_lse, mask=row_ok)


def merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Merge (blk_out, blk_lse) into the float32 accumulators in place (shapes in module docstring)."""
    bsz, seq, heads, dim = acc_out.shape
    assert acc_out.dtype == torch.float32 and acc_out.is_contiguous() and acc_lse.is_contiguous()
    assert blk_out.stride(-1) == 1, "block output needs a contiguous head_dim"
    block_d = triton.next_power_of_2(dim)
    block_s = max(1, min(64, 8192 // block_d))
    grid = (bsz * heads, triton.cdiv(seq, block_s))
    _merge_kernel[grid](
        acc_out, acc_lse, blk_out, blk_lse, seq, heads,
        acc_out.stride(0), acc_out.stride(1), acc_out.stride(2),
        acc_lse.stride(0), acc_lse.stride(1), acc_lse.stride(2),
        blk_out.stride(0), blk_out.stride(1), blk_out.stride(2),
        blk_lse.stride(0), blk_lse.stride(1), blk_lse.stride(2),
        D=dim, BLOCK_S=block_s, BLOCK_D=block_d,
    )
