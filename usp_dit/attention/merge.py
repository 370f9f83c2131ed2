"""Merging partial attention results by log-sum-exp.

Layout: out (batch, seq, heads, head_dim), lse (batch, seq, heads); a stack of G blocks adds a
leading dim: outs (G, batch, seq, heads, head_dim), lses (G, batch, seq, heads).

If a query's keys are split into blocks with partial results (o_i, l_i), the full result is
    l = log(sum_i exp(l_i))          o = sum_i exp(l_i - l) o_i
computed with the running maximum subtracted, and exact when some (or all) l_i are -inf (a block
with no keys; all -inf gives out 0, lse -inf). On CUDA the merge of a running result with a stack
of G blocks is one fused Triton kernel (``usp_dit.kernels.merge_triton``).
"""
from __future__ import annotations

import torch

from usp_dit.kernels import merge_triton
from usp_dit.kernels.autograd import needs_grad


def _merge_torch(dst_out, dst_lse, src_out, src_lse, outs, lses) -> None:
    """PyTorch form of ``merge_triton.merge`` (CPU, float64): same maths, same in-place contract."""
    acc = dst_lse.dtype
    l_all = torch.cat([src_lse.unsqueeze(0).to(acc), lses.to(acc)])  # (G + 1, B, S, H)
    lse = torch.logsumexp(l_all, dim=0)
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(l_all - finite).unsqueeze(-1)  # 0 for empty blocks, never nan
    out = (w[0] * src_out.to(acc)).add_((w[1:] * outs.to(acc)).sum(dim=0))
    dst_out.copy_(out)
    dst_lse.copy_(lse)


def merge_into(dst_out, dst_lse, src_out, src_lse, outs, lses) -> None:
    """Write the merge of ``(src_out, src_lse)`` and the stacked blocks into ``dst`` (``dst`` may be
    ``src``): the fused kernel on CUDA for float32 LSEs, PyTorch otherwise, and PyTorch wherever
    autograd records the merge (a model adapter merging differentiable parts: the fused kernel
    writes its result outside autograd)."""
    recorded = needs_grad(src_out, src_lse, outs, lses)
    if dst_lse.dtype == torch.float32 and merge_triton.available(dst_out) and not recorded:
        merge_triton.merge(dst_out, dst_lse, src_out, src_lse, outs, lses)
    else:
        _merge_torch(dst_out, dst_lse, src_out, src_lse, outs, lses)


class LSEMerger:
    """Accumulates partial (out, lse) results of the same queries.

    The first block is held as it is (no copy); the first merge creates a float32 accumulator
    (float64 for float64 LSEs) that later merges update in place. ``finish`` merges a last stack
    straight into the output dtype, so the accumulator is never read back just to be cast.
    """

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self._owned = False  # True once ``out``/``lse`` are our accumulator (safe to update in place)

    def add(self, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
        """Merge one block's ``out_blk`` (B, S, H, D) and ``lse_blk`` (B, S, H)."""
        if self.out is None:  # the common first call: hold it, no stack views (eager CPU cost)
            self.out, self.lse = out_blk, lse_blk
            return
        self.add_stack(out_blk.unsqueeze(0), lse_blk.unsqueeze(0))

    def add_stack(self, outs: torch.Tensor, lses: torch.Tensor) -> None:
        """Merge G blocks at once: ``outs`` (G, B, S, H, D), ``lses`` (G, B, S, H)."""
        outs, lses = self._take_first(outs, lses)
        if not outs.shape[0]:
            return
        if self._owned:
            dst_out, dst_lse = self.out, self.lse
        else:
            dst_out = torch.empty(self.out.shape, dtype=lses.dtype, device=lses.device)
            dst_lse = torch.empty(self.lse.shape, dtype=lses.dtype, device=lses.device)
        merge_into(dst_out, dst_lse, self.out, self.lse, outs, lses)
        self.out, self.lse, self._owned = dst_out, dst_lse, True

    def _take_first(self, outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With no running result yet, the stack's first block becomes it; returns what is left."""
        if self.out is not None:
            return outs, lses
        self.out, self.lse = outs[0], lses[0]
        return outs[1:], lses[1:]

    def finish(self, dtype: torch.dtype, outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge a last stack and return ``(out, lse)``, ``out`` written directly in ``dtype``."""
        outs, lses = self._take_first(outs, lses)
        if not outs.shape[0]:
            return self.result(dtype)
        dst_out = torch.empty(self.out.shape, dtype=dtype, device=lses.device)
        dst_lse = torch.empty(self.lse.shape, dtype=lses.dtype, device=lses.device)
        merge_into(dst_out, dst_lse, self.out, self.lse, outs, lses)
        return dst_out, dst_lse

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged ``(out, lse)``, ``out`` cast to ``dtype`` and ``lse`` contiguous."""
        assert self.out is not None and self.lse is not None, "no block was merged"
        return self.out.to(dtype), self.lse.contiguous()
