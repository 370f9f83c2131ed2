"""Attention of one query block against one key block under a staircase mask, by plan.

Layout: q, out, dq (batch, seq_q, heads, head_dim); k, v, dk, dv (batch, seq_k, kv_heads,
head_dim); lse (batch, seq_q, heads), float32 (float64 for float64 inputs).

A plan (``usp_dit.attention.masks``) is a tuple of ``SubCall``s: dense or causal-diagonal kernel calls on
row and key ranges. ``RowMerger`` merges their partial results by log-sum-exp into the rows they
cover; ``masked_block_grads`` is the matching backward, given the final out / LSE of the queries
and the final LSE's gradient, if any (as in ring attention, that makes each call's gradient its
exact share: Note [LSE gradient] in ``usp_dit.kernels.lse_grad``). ``MaskedAttention`` is the
autograd node of one block pair with no ring (one rank, or Ulysses only).
"""
from __future__ import annotations

import torch

from usp_dit.attention.masks import SubCall
from usp_dit.attention.merge import merge_into
from usp_dit.kernels.autograd import attend, kernel_backward, kernel_forward, needs_grad
from usp_dit.kernels.lse_grad import lse_cotangent
from usp_dit.kernels.protocol import AttentionBackend, lse_dtype


class RowMerger:
    """Accumulates partial ``(out, lse)`` of row ranges of the same queries ``q`` (B, S, H, D).

    A first result covering every row is held as it is (no copy); otherwise, or from the second
    result on, a float32 (float64) accumulator starting at out 0, lse -inf takes the merges.
    """

    def __init__(self, q: torch.Tensor) -> None:
        self.shape, self.device = q.shape, q.device
        self.acc = lse_dtype(q.dtype)
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self._owned = False

    def _own(self) -> None:
        out = torch.zeros(self.shape, dtype=self.acc, device=self.device)
        lse = torch.full(self.shape[:3], float("-inf"), dtype=self.acc, device=self.device)
        if self.out is not None:
            out.copy_(self.out)
            lse.copy_(self.lse)
        self.out, self.lse, self._owned = out, lse, True

    def add(self, q0: int, q1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge ``out`` (B, q1 - q0, H, D) and ``lse`` (B, q1 - q0, H) into rows ``[q0, q1)``."""
        if self.out is None and q0 == 0 and q1 == self.shape[1]:
            self.out, self.lse = out, lse
            return
        if not self._owned:
            self._own()
        o, l = self.out[:, q0:q1], self.lse[:, q0:q1]
        merge_into(o, l, o, l, out.unsqueeze(0), lse.unsqueeze(0))

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: rows no call reached have out 0 and lse -inf."""
        if self.out is None:
            self._own()
        return self.out.to(dtype), self.lse.contiguous()


def attend_plan(merger: RowMerger, q, k, v, calls: tuple[SubCall, ...], backend: AttentionBackend, scale: float) -> None:
    """Run ``calls`` of ``q`` against the block ``k``/``v`` into ``merger`` (no autograd)."""
    for c in calls:
        out, lse = kernel_forward(backend, q[:, c.q0:c.q1], k[:, c.k0:c.k1], v[:, c.k0:c.k1], scale, c.causal)
        merger.add(c.q0, c.q1, out, lse)


def masked_block_grads(backend: AttentionBackend, dout, q, k, v, out, lse, scale: float, calls: tuple[SubCall, ...],
                       dlse=None):
    """``(dq, dk, dv)`` of the block pair (float32, float64 for float64 inputs; zeros where the
    mask hides everything), ``out``/``lse`` being the queries' final (merged) results and
    ``dlse`` the final LSE's gradient (``None``: none)."""
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for c in calls:
        rows, keys = slice(c.q0, c.q1), slice(c.k0, c.k1)
        g_q, g_k, g_v = kernel_backward(
            backend, dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, rows], scale, c.causal,
            dlse=None if dlse is None else dlse[:, rows],
        )
        dq[:, rows] += g_q
        dk[:, keys] += g_k
        dv[:, keys] += g_v
    return dq, dk, dv


def covers_all(calls: tuple[SubCall, ...], n_q: int, n_k: int) -> SubCall | None:
    """The one call of a plan that is the whole block pair (dense or causal), else ``None``."""
    if len(calls) == 1 and calls[0][:4] == (0, n_q, 0, n_k):
        return calls[0]
    return None


class MaskedAttention(torch.autograd.Function):
    """One block pair under a plan, with its backward, ``out`` and ``lse`` both differentiable;
    ``lse_grad``: the caller may read ``lse`` (as ``RingAttention``'s)."""

    @staticmethod
    def forward(ctx, q, k, v, calls: tuple[SubCall, ...], backend: AttentionBackend, scale: float,
                lse_grad: bool = False):
        merger = RowMerger(q)
        attend_plan(merger, q, k, v, calls, backend, scale)
        out, lse = merger.result(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls, ctx.backend, ctx.scale, ctx.lse_grad = calls, backend, scale, lse_grad
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dlse = lse_cotangent(dlse, ctx.lse_grad)
        if dout is None and dlse is None:
            return None, None, None, None, None, None, None
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = masked_block_grads(ctx.backend, dout, q, k, v, out, lse, ctx.scale, ctx.calls, dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def masked_attend(q, k, v, calls: tuple[SubCall, ...], backend: AttentionBackend, scale: float, lse_grad: bool = False):
    """``(out, lse)`` of ``q`` against ``k``/``v`` under ``calls``: one plain kernel call when the
    plan is the whole pair (causal attention on one rank: the kernel's own causal mode, no merge).
    ``lse_grad``: the caller may read ``lse`` in a loss (``attend``)."""
    whole = covers_all(calls, q.shape[1], k.shape[1])
    if whole is not None:
        return attend(q, k, v, backend, scale, whole.causal, lse_grad)
    if needs_grad(q, k, v):
        return MaskedAttention.apply(q, k, v, calls, backend, scale, lse_grad)
    merger = RowMerger(q)
    attend_plan(merger, q, k, v, calls, backend, scale)
    return merger.result(q.dtype)
