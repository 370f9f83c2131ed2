"""Ring attention over the ring axis, as an autograd Function with a full backward.

Layout: q (batch, seq_q, heads, head_dim); k, v (batch, seq_k, kv_heads, head_dim);
joint_k, joint_v (batch, seq_joint, kv_heads, head_dim) or None; out like q; lse (batch, seq_q, heads).

Note [ring schedule]
    Ring rank r owns K/V block r. At step t it computes its queries against block j = (r - t) mod R
    while block j-1 travels from rank r-1 (double buffering), then merges by LSE:

        step:      0        1        2      ...   R-1
        block:     r       r-1      r-2     ...   r+1
        + joint K/V at step 0 only, so every query sees the joint tokens exactly once.

    Backward runs the same schedule. The gradient of block j is accumulated in float32 on the way
    round: rank r adds its contribution to the accumulator it received and passes it on; after the
    last step the accumulator of block r+1 goes to rank r+1, its owner. So each rank sends R - 1
    K/V blocks and R gradient blocks per backward. Blocks may have different lengths (uneven
    sequences); every rank knows all lengths, so empty blocks are skipped in step on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from usp_dit.comm import RingExchanger
from usp_dit.kernels.base import AttentionBackend, lse_dtype
from usp_dit.merge import LSEMerger

_KV_TAG, _DKV_TAG = 0, 1


@dataclass(frozen=True)
class RingSpec:
    """The ring of one call: its exchanger and the K/V block length of every ring rank."""

    exchanger: RingExchanger
    block_sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.exchanger.size

    @property
    def rank(self) -> int:
        return self.exchanger.rank

    def block_at(self, step: int) -> int:
        """Which ring rank's K/V block this rank holds at ``step``."""
        return (self.rank - step) % self.size


def _kv_buffer(like: torch.Tensor, length: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty (2, B, length, kv_heads, D) buffer for one K/V block (or its gradient)."""
    _, b, _, h, d = like.shape
    return torch.empty((2, b, length, h, d), dtype=dtype or like.dtype, device=like.device)


def _ring_blocks(k: torch.Tensor, v: torch.Tensor, spec: RingSpec):
    """Yield ``(step, kv)``: the (2, B, S_j, Hk, D) K/V block held at each step of the ring.

    The next block's transfer is posted before yielding, so it travels while the caller computes;
    it is waited for when the caller asks for the next step (after any transfer the caller posted).
    """
    cur = torch.stack([k, v])  # one contiguous buffer, one send per step
    for step in range(spec.size):
        nxt, works = None, []
        if step < spec.size - 1:
            nxt = _kv_buffer(cur, spec.block_sizes[spec.block_at(step + 1)])
            works = spec.exchanger.start(cur, nxt, _KV_TAG)
        yield step, cur
        spec.exchanger.wait(works)
        cur = nxt if nxt is not None else cur


def _with_joint(kv: torch.Tensor, joint_k: torch.Tensor | None, joint_v: torch.Tensor | None, step: int):
    """K and V of one step: the block, plus the joint tokens at step 0."""
    k, v = kv[0], kv[1]
    if step == 0 and joint_k is not None:
        k, v = torch.cat([k, joint_k], dim=1), torch.cat([v, joint_v], dim=1)
    return k, v


def ring_forward(q, k, v, joint_k, joint_v, spec: RingSpec, backend: AttentionBackend, scale: float):
    """Forward of Note [ring schedule]; returns ``(out, lse)``."""
    merger = LSEMerger()
    for step, cur in _ring_blocks(k, v, spec):
        k_t, v_t = _with_joint(cur, joint_k, joint_v, step)
        if q.shape[1] and k_t.shape[1]:
            merger.add(*backend.forward(q, k_t, v_t, scale))
    if merger.out is None:  # no queries on this rank: nothing to compute, shapes still right
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))
    return merger.result(q.dtype)


def _block_grads(backend, dout, q, k_t, v_t, out, lse, scale):
    """(dq, dk, dv) of one step, zeros when the step has no work."""
    if q.shape[1] and k_t.shape[1]:
        return backend.backward(dout, q, k_t, v_t, out, lse, scale)
    return torch.zeros_like(q), torch.zeros_like(k_t), torch.zeros_like(v_t)


def ring_backward(dout, q, k, v, joint_k, joint_v, out, lse, spec: RingSpec, backend, scale):
    """Backward of Note [ring schedule]; returns ``(dq, dk, dv, djoint_k, djoint_v)``."""
    acc = lse_dtype(q.dtype)  # gradients accumulate in the dtype of the merges
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    djk = djv = None
    dkv_recv, dworks = None, []
    for step, cur in _ring_blocks(k, v, spec):
        k_t, v_t = _with_joint(cur, joint_k, joint_v, step)
        dq_t, dk_t, dv_t = _block_grads(backend, dout, q, k_t, v_t, out, lse, scale)
        dq += dq_t
        n = cur.shape[2]
        if step == 0 and joint_k is not None:
            djk, djv = dk_t[:, n:], dv_t[:, n:]
        dkv = torch.stack([dk_t[:, :n], dv_t[:, :n]]).to(acc)
        spec.exchanger.wait(dworks)
        if dkv_recv is not None:
            dkv += dkv_recv
        # The accumulator we receive next belongs to the block we hold at the next step; after the
        # last step that is our own block, coming home.
        dkv_recv = _kv_buffer(cur, spec.block_sizes[spec.block_at(step + 1)], acc)
        dworks = spec.exchanger.start(dkv, dkv_recv, _DKV_TAG)
        keep_alive = dkv  # the send buffer must outlive its transfer
    spec.exchanger.wait(dworks)
    del keep_alive
    return dq.to(q.dtype), dkv_recv[0].to(k.dtype), dkv_recv[1].to(v.dtype), djk, djv


class RingAttention(torch.autograd.Function):
    """Differentiable ring attention; ``lse`` is returned but not differentiable (a gradient raises)."""

    @staticmethod
    def forward(ctx, q, k, v, joint_k, joint_v, spec: RingSpec, backend: AttentionBackend, scale: float):
        out, lse = ring_forward(q, k, v, joint_k, joint_v, spec, backend, scale)
        ctx.save_for_backward(q, k, v, joint_k, joint_v, out, lse)
        ctx.spec, ctx.backend, ctx.scale = spec, backend, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dlse is not None:
            raise NotImplementedError("backpropagating through the returned log-sum-exp is not supported")
        q, k, v, joint_k, joint_v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)  # every rank must still run the ring to serve its peers
        grads = ring_backward(dout.contiguous(), q, k, v, joint_k, joint_v, out, lse, ctx.spec, ctx.backend, ctx.scale)
        return (*grads, None, None, None)
