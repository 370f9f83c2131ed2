"""Merging partial attention results by log-sum-exp.

Layout: out (batch, seq, heads, head_dim), lse (batch, seq, heads).

If a query's keys are split into blocks A and B with partial results (o_A, l_A) and (o_B, l_B),
the full result is
    l = log(exp(l_A) + exp(l_B))                 = l_A - logsigmoid(l_A - l_B)
    o = (exp(l_A) o_A + exp(l_B) o_B) / exp(l)   = o_A - sigmoid(l_B - l_A) (o_A - o_B)
The sigmoid form needs no max-subtraction and is exact when one side is -inf. On CUDA the same
update runs as one fused in-place Triton kernel (``usp_dit.kernels.merge_triton``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from usp_dit.kernels import merge_triton


class LSEMerger:
    """Accumulates partial (out, lse) blocks of the same queries in float32 (float64 for float64)."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
        """Merge one block's ``out_blk`` (B, S, H, D) and ``lse_blk`` (B, S, H) into the running result."""
        acc = lse_blk.dtype
        if self.out is None:  # contiguous float32 copies: the accumulators are updated in place
            self.out = torch.empty(out_blk.shape, dtype=acc, device=out_blk.device).copy_(out_blk)
            self.lse = torch.empty(lse_blk.shape, dtype=acc, device=lse_blk.device).copy_(lse_blk)
            return
        if acc == torch.float32 and merge_triton.available(out_blk):
            merge_triton.merge_(self.out, self.lse, out_blk, lse_blk)
            return
        weight = torch.sigmoid(lse_blk - self.lse).unsqueeze(-1)
        self.out.sub_(weight * (self.out - out_blk.to(acc)))
        self.lse.sub_(F.logsigmoid(self.lse - lse_blk))

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged ``(out, lse)``, ``out`` cast to ``dtype``."""
        assert self.out is not None and self.lse is not None, "no block was merged"
        return self.out.to(dtype), self.lse
