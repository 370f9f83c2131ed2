"""Fused LSE merge on CUDA (Triton): one kernel merges a running result with a stack of G blocks.

Layout: src_out, dst_out (B, S, H, D); src_lse, dst_lse (B, S, H) float32; blk_outs
(G, B, S, H, D) and blk_lses (G, B, S, H), any strides with a contiguous head_dim (kernels often
return (B, H, S, D) memory viewed as (B, S, H, D)). ``dst`` may be ``src`` (an in-place update of a
float32 accumulator) or a fresh tensor of any float dtype (the last merge writes the final output
straight in the model's dtype, skipping a float32 round trip).

Per row (b, s, h), with the maths of ``usp_dit.attention.merge``:
    m   = max(l_src, l_1, ..., l_G)
    lse = m + log(exp(l_src - m) + sum_i exp(l_i - m))
    out = exp(l_src - lse) * out_src + sum_i exp(l_i - lse) * out_i
Each input is read once and the result written once, so merging G blocks at a time costs one pass
over the data instead of G (the unfused PyTorch form reads and writes float32 four times per block).
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
        dst_out, dst_lse, src_out, src_lse, blk_out, blk_lse,
        G, S, H,
        do_b, do_s, do_h, dl_b, dl_s, dl_h,
        so_b, so_s, so_h, sl_b, sl_s, sl_h,
        bo_g, bo_b, bo_s, bo_h, bl_g, bl_b, bl_s, bl_h,
        D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        b = pid_bh // H
        h = pid_bh % H
        s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        row_ok = s < S
        mask = row_ok[:, None] & (d[None, :] < D)
        l_src = tl.load(src_lse + b * sl_b + s * sl_s + h * sl_h, mask=row_ok, other=float("-inf")).to(tl.float32)
        m = l_src
        for i in range(G):
            l_max = tl.load(blk_lse + i * bl_g + b * bl_b + s * bl_s + h * bl_h, mask=row_ok, other=float("-inf"))
            m = tl.maximum(m, l_max.to(tl.float32))
        m = tl.where(m == float("-inf"), 0.0, m)  # every side empty: keep -inf, avoid nan
        w_src = tl.exp(l_src - m)
        total = w_src
        o_src = tl.load(src_out + b * so_b + s[:, None] * so_s + h * so_h + d[None, :], mask=mask, other=0.0)
        acc = o_src.to(tl.float32) * w_src[:, None]
        for i in range(G):
            l_blk = tl.load(blk_lse + i * bl_g + b * bl_b + s * bl_s + h * bl_h, mask=row_ok, other=float("-inf"))
            w_blk = tl.exp(l_blk.to(tl.float32) - m)
            total += w_blk
            o_blk = tl.load(blk_out + i * bo_g + b * bo_b + s[:, None] * bo_s + h * bo_h + d[None, :], mask=mask, other=0.0)
            acc += o_blk.to(tl.float32) * w_blk[:, None]
        safe = tl.where(total == 0.0, 1.0, total)
        acc = acc / safe[:, None]
        tl.store(dst_out + b * do_b + s[:, None] * do_s + h * do_h + d[None, :], acc.to(dst_out.dtype.element_ty), mask=mask)
        tl.store(dst_lse + b * dl_b + s * dl_s + h * dl_h, m + tl.log(total), mask=row_ok)


def merge(
    dst_out: torch.Tensor, dst_lse: torch.Tensor, src_out: torch.Tensor, src_lse: torch.Tensor,
    blk_outs: torch.Tensor, blk_lses: torch.Tensor,
) -> None:
    """Write the merge of ``src`` and the ``G`` stacked blocks into ``dst`` (shapes in module docstring)."""
    bsz, seq, heads, dim = dst_out.shape
    assert dst_lse.dtype == torch.float32 and blk_outs.dim() == 5 and blk_lses.dim() == 4
    for t in (dst_out, src_out, blk_outs):
        assert t.stride(-1) == 1, "outputs need a contiguous head_dim"
    block_d = triton.next_power_of_2(dim)
    block_s = max(1, min(64, 8192 // block_d))
    grid = (bsz * heads, triton.cdiv(seq, block_s))
    _merge_kernel[grid](
        dst_out, dst_lse, src_out, src_lse, blk_outs, blk_lses, blk_outs.shape[0], seq, heads,
        *dst_out.stride()[:3], *dst_lse.stride(), *src_out.stride()[:3], *src_lse.stride(),
        *blk_outs.stride()[:4], *blk_lses.stride(),
        D=dim, BLOCK_S=block_s, BLOCK_D=block_d,
    )
