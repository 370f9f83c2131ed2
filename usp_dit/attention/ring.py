"""Ring attention over the ring axis, as an autograd Function with a full backward.

Layout: q (batch, seq_q, heads, head_dim); k, v (batch, seq_k, kv_heads, head_dim);
joint_k, joint_v (batch, seq_joint, kv_heads, head_dim) or None, joint_mask (batch, seq_joint) bool
or None (Note [masked joint tokens] in ``usp_dit.attention.masked_joint``); out like q; lse (batch, seq_q, heads).

Note [ring schedule]
    Ring rank r owns K/V block r. At step t it computes its queries against block j = (r - t) mod R
    while block j-1 travels from rank r-1 (double buffering), then merges by LSE:

        step:      0        1        2      ...   R-1
        block:     r       r-1      r-2     ...   r+1
        + joint K/V at step 0 only, so every query sees the joint tokens exactly once (in the
          step's call; masked joint tokens in a call of their own, merged at step 0).

    That is the "stream" schedule: two K/V blocks in memory, every transfer hidden behind one
    block's attention when a block computes longer than it travels. Its cost is many small kernel
    calls and one merge per block, which dominate when blocks are short (Flux at R = 4: 1152-token
    blocks, a quarter of the GPU's throughput on one H200). The "gather_merge" forward schedule instead
    all-gathers every ring rank's K/V block (asynchronously), computes the local block (+ joint)
    while the blocks travel, then attends to the remote blocks of each equal length in one kernel
    call (the blocks folded into the batch) and merges them all in one fused pass. It holds the
    whole sequence's K/V (of this rank's heads) for the duration of the call, and exposes the part
    of the gather that one local block does not hide. The "gather_one_call" schedule waits for the
    gathered K/V and makes ONE kernel call of the rank's queries against the whole sequence (+ joint):
    no merge at all and the kernel's best efficiency, but nothing overlaps the gather. With batch 1
    and equal blocks the blocks are gathered straight into one buffer that ends with the joint
    tokens (no copy of the gathered K/V); otherwise they are copied into one sequence first.
    Note [ring schedule choice] says which schedule "auto" takes. The backward always streams.

    Under a causal or block-causal mask (``RingSpec.plans``, Note [staircase masks] in
    ``usp_dit.attention.masks``) each step runs the plan of its block pair: the kernel's causal mode on the
    diagonal, dense calls where the whole block is visible, nothing where it is hidden (the blocks
    still travel: later ranks need them). Only the two schedules that merge can run a plan
    ("stream", and "gather_merge" over the gathered blocks); "auto" streams.

    Backward runs the same schedule. The gradient of block j is accumulated in float32 on the way
    round: rank r adds its contribution to the accumulator it received and passes it on; after the
    last step the accumulator of block r+1 goes to rank r+1, its owner. So each rank sends R - 1
    K/V blocks and R gradient blocks per backward. Blocks may have different lengths (uneven
    sequences); every rank knows all lengths, so empty blocks are skipped in step on both sides.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from usp_dit.attention.masked import RowMerger, attend_plan, masked_block_grads
from usp_dit.attention.masked_joint import JointKV, add_masked_joint, joint_grads
from usp_dit.attention.masks import SubCall
from usp_dit.attention.merge import LSEMerger
from usp_dit.distributed.comm import RingExchanger, start_all_gather, start_all_gather_into, wait_gathered
from usp_dit.distributed import fp8_wire
from usp_dit.distributed.config import canonical_schedule
from usp_dit.kernels.autograd import kernel_backward
from usp_dit.kernels.lse_grad import lse_cotangent
from usp_dit.kernels.protocol import AttentionBackend, forward_stack, lse_dtype

_KV_TAG, _DKV_TAG = 0, 1

# Note [ring schedule choice]
#     A K/V block of L tokens takes time k ~ L^2 to attend and c ~ L to pass on. With one H200
#     node's estimates (cuDNN about 600 TF/s, NVLink about 370 GB/s each way) k = c at about
#     L0 = 1600 tokens, scaled by kv_heads / heads (grouped K/V travel less). Below L0 no schedule
#     hides the transfers (each block travels longer than it computes), and what decides is how
#     little the GPU wastes on short calls and merges: "auto" takes "gather_one_call", one call
#     per rank (by far the fastest of the three at Flux R = 4 on one H200: docs/PERFORMANCE.md,
#     the ring schedule sections). Above L0 the stream ring
#     hides every transfer, while "gather_merge" exposes about (R - 1) c - k of it; "auto" gathers when
#     that estimate is at most 10% of the rank's attention time R k, i.e. when
#     L >= (R - 1) L0 / (1 + 0.1 R), and streams otherwise (e.g. Mochi at R = 8). The constants are
#     estimates until measured across GPUs (the multi-GPU issue); pass ring_schedule to choose.
_L0_TOKENS = 1600


def choose_schedule(
    requested: str, block_sizes: tuple[int, ...], heads: int, kv_heads: int, masked: bool = False
) -> RingSchedule:
    """The forward schedule for ``requested`` ("auto" or a name of ``SCHEDULES``, old aliases
    included), Note [ring schedule choice]; ``masked``: the call runs plans (``MASKED_SCHEDULES``)."""
    requested = canonical_schedule(requested)
    if masked:
        return masked_schedule(requested)
    if requested != "auto":
        return SCHEDULES[requested]
    ring, longest = len(block_sizes), _longest(block_sizes)
    l0 = _L0_TOKENS * kv_heads / heads
    if longest < l0:
        return SCHEDULES["gather_one_call"]
    return SCHEDULES["gather_merge" if longest >= (ring - 1) * l0 / (1 + 0.1 * ring) else "stream"]


@dataclass(frozen=True)
class RingSpec:
    """The ring of one call: its exchanger and the K/V block length of every ring rank."""

    exchanger: RingExchanger
    block_sizes: tuple[int, ...]
    schedule: RingSchedule  # the forward's (Note [ring schedule]); the backward always streams
    # Under a mask: this rank's query block against ring block j runs plans[j] (``usp_dit.attention.masks``).
    plans: tuple[tuple[SubCall, ...], ...] | None = None

    @property
    def size(self) -> int:
        return self.exchanger.size

    @property
    def rank(self) -> int:
        return self.exchanger.rank

    def block_at(self, step: int) -> int:
        """Which ring rank's K/V block this rank holds at ``step``."""
        return (self.rank - step) % self.size


def _kv_shape(like: torch.Tensor, length: int) -> tuple[int, ...]:
    """The (2, B, length, kv_heads, D) shape of one K/V block (or its gradient) like ``like``."""
    _, b, _, h, d = like.shape
    return (2, b, length, h, d)


def _ring_blocks(k: torch.Tensor, v: torch.Tensor, spec: RingSpec, v_wire: torch.Tensor | None = None):
    """Yield ``(step, kv)``: the K/V block held at each step of the ring, a stacked
    (2, B, S_j, Hk, D) tensor, or with ``v_wire`` (Note [fp8 ring V]) a ``(k, v)`` pair unpacked
    from the travelling bytes (the own block at step 0 is ``(k, v)`` as given).

    The next block's transfer is posted before yielding, so it travels while the caller computes;
    it is waited for when the caller asks for the next step (after any transfer the caller posted).
    """
    # one contiguous buffer, one send per step
    cur = torch.stack([k, v]) if v_wire is None else fp8_wire.pack_kv(k, v_wire)
    for step in range(spec.size):
        receive = None
        if step < spec.size - 1:
            shape = _travel_shape(cur, spec.block_sizes[spec.block_at(step + 1)], v_wire is not None)
            receive = spec.exchanger.post(cur, shape, cur.dtype, _KV_TAG, kind="ring_kv")
        try:
            if v_wire is None:
                yield step, cur
            else:
                yield step, ((k, v) if step == 0 else fp8_wire.unpack_kv(cur, k.dtype, k.shape[-1]))
        except BaseException:  # the caller raised or closed the loop early: Note [draining a posted transfer]
            if receive is not None:
                receive.drain()
            raise
        cur = receive() if receive is not None else cur


def _travel_shape(cur: torch.Tensor, length: int, packed: bool) -> tuple[int, ...]:
    """The shape of another rank's travelling block of ``length`` tokens like ``cur``: stacked
    (2, B, length, Hk, D), or packed bytes (B, length, Hk, W)."""
    if packed:
        b, _, h, w = cur.shape
        return (b, length, h, w)
    return _kv_shape(cur, length)


def _in_call(joint: JointKV | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(joint_k, joint_v)`` that join a step's kernel call: unmasked joint tokens (masked ones have
    a call of their own), ``(None, None)`` otherwise."""
    return (joint.k, joint.v) if joint is not None and joint.mask is None else (None, None)


def _with_joint(kv, joint: JointKV | None, step: int):
    """K and V of one step: the block ``kv`` (a stacked (2, ...) tensor or a (k, v) pair), plus the
    unmasked joint tokens at step 0."""
    k, v = kv[0], kv[1]
    joint_k, joint_v = _in_call(joint)
    if step == 0 and joint_k is not None:
        k, v = torch.cat([k, joint_k], dim=1), torch.cat([v, joint_v], dim=1)
    return k, v


def _empty_result(q: torch.Tensor):
    """``(out, lse)`` of a rank with no queries (or no keys): shapes right, nothing computed."""
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


def ring_forward(q, k, v, joint: JointKV | None, spec: RingSpec, backend: AttentionBackend, scale: float,
                 v_wire: torch.Tensor | None = None):
    """Forward of Note [ring schedule] in ``spec``'s schedule; returns ``(out, lse)``. ``v_wire``
    (B, S, Hk, D + 4) uint8: ``v``'s FP8 wire rows, which then travel instead of ``v`` (Note
    [fp8 ring V]; ``v`` must be their decoding)."""
    return spec.schedule.forward(q, k, v, joint, spec, backend, scale, v_wire)


def _stream_forward(q, k, v, joint: JointKV | None, spec: RingSpec, backend: AttentionBackend, scale: float,
                    v_wire=None):
    """The "stream" forward of Note [ring schedule]: block by block, merged as they come."""
    merger = LSEMerger()
    for step, cur in _ring_blocks(k, v, spec, v_wire):
        k_t, v_t = _with_joint(cur, joint, step)
        if q.shape[1] and k_t.shape[1]:
            merger.add(*backend.forward(q, k_t, v_t, scale))
        if step == 0:
            add_masked_joint(merger, q, joint, backend, scale)
    return _empty_result(q) if merger.out is None else merger.result(q.dtype)


def remote_runs(block_sizes: tuple[int, ...], rank: int) -> list[tuple[int, int, int]]:
    """``(start, stop, length)`` runs of consecutive ring ranks other than ``rank`` whose K/V blocks
    have one (non-zero) length: each run is one batched kernel call of the "gather_merge" schedule."""
    runs: list[tuple[int, int, int]] = []
    for j, n in enumerate(block_sizes):
        if j == rank or n == 0:
            continue
        if runs and runs[-1][1] == j and runs[-1][2] == n:
            runs[-1] = (runs[-1][0], j + 1, n)
        else:
            runs.append((j, j + 1, n))
    return runs


def attend_local(q, k_loc, v_loc, backend: AttentionBackend, scale: float) -> LSEMerger:
    """A merger holding ``q`` against the local K/V block (empty when there are no keys)."""
    merger = LSEMerger()
    if q.shape[1] and k_loc.shape[1]:
        merger.add(*backend.forward(q, k_loc, v_loc, scale))
    return merger


def attend_stacks(merger: LSEMerger, q, stacks, backend: AttentionBackend, scale: float):
    """Merge ``q`` against each ``(k_stack, v_stack)`` of (G, B, S_k, Hk, D) equal-length blocks,
    one kernel call per stack, into ``merger``; the last merge writes the output dtype directly.
    Returns ``(out, lse)``."""
    if q.shape[1]:
        for i, (ks, vs) in enumerate(stacks):
            outs, lses = forward_stack(backend, q, ks, vs, scale)
            if i == len(stacks) - 1:
                return merger.finish(q.dtype, outs, lses)
            merger.add_stack(outs, lses)
    return _empty_result(q) if merger.out is None else merger.result(q.dtype)


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` (B, S, Hk, D) zero-padded along S to ``length`` (all-gather needs equal sizes)."""
    # Compiled: always pad (by 0 if need be), no branch on a symbolic length (a guard, a recompile per size).
    if torch.compiler.is_compiling() or x.shape[1] < length:
        return F.pad(x, (0, 0, 0, 0, 0, length - x.shape[1]))
    return x


def _longest(block_sizes: tuple[int, ...]) -> int:
    """The longest block. Symbolic sizes (a compiled call under dynamic shapes) come from the
    contiguous layout's ``split_sizes`` (Note [compiled calls]; other layouts and masks specialise
    the length), whose first piece is the longest: taking it compares no symbolic sizes (no
    guards). Concrete sizes take the maximum: a zigzag ring's longest block need not be the first."""
    if any(isinstance(n, torch.SymInt) for n in block_sizes):
        return block_sizes[0]
    return max(block_sizes)


def _start_block_gather(k, v, spec: RingSpec, v_wire=None) -> list[torch.Tensor]:
    """Post the all-gather of every ring rank's K and V block (V's wire rows where given), padded
    to the longest block."""
    longest = _longest(spec.block_sizes)
    return [start_all_gather(_padded(t, longest), spec.exchanger.group, kind="ring_gather")
            for t in (k, v if v_wire is None else v_wire)]


def _gathered_blocks(pending: torch.Tensor, spec: RingSpec, batch: int) -> torch.Tensor:
    """The result of one ``_start_block_gather`` transfer as (R, B, L, Hk, D) blocks (waits for it)."""
    return wait_gathered(pending).unflatten(0, (spec.size, batch))


def _gathered_kv(pending: list[torch.Tensor], spec: RingSpec, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_all, v_all) (R, B, L, Hk, D) of ``_start_block_gather``'s two transfers; V's wire rows
    (uint8) decoded to K's dtype (padding rows decode to zeros)."""
    k_all, v_all = (_gathered_blocks(p, spec, k.shape[0]) for p in pending)
    return k_all, (fp8_wire.decode(v_all, k.dtype) if v_all.dtype == torch.uint8 else v_all)


def _gather_merge_forward(q, k, v, joint: JointKV | None, spec: RingSpec, backend: AttentionBackend, scale: float,
                          v_wire=None):
    """The "gather_merge" forward of Note [ring schedule]; returns ``(out, lse)``."""
    pending = _start_block_gather(k, v, spec, v_wire)  # travels during the local block
    merger = attend_local(q, *_with_joint((k, v), joint, 0), backend, scale)
    add_masked_joint(merger, q, joint, backend, scale)
    k_all, v_all = _gathered_kv(pending, spec, k)
    stacks = [(k_all[a:b, :, :n], v_all[a:b, :, :n]) for a, b, n in remote_runs(spec.block_sizes, spec.rank)]
    return attend_stacks(merger, q, stacks, backend, scale)


def gathered_sequence(blocks: torch.Tensor, block_sizes: tuple[int, ...], joint: torch.Tensor | None) -> torch.Tensor:
    """All-gathered blocks (R, B, L, Hk, D), block r holding ``block_sizes[r]`` real tokens (the
    rest padding), as one (B, sum(block_sizes) [+ joint], Hk, D) sequence (one copy)."""
    parts = [blocks[i, :, :n] for i, n in enumerate(block_sizes) if n]
    return torch.cat(parts + ([joint] if joint is not None else []), dim=1)


def _gather_in_place(k, v, joint_k, joint_v, spec: RingSpec):
    """Batch 1, equal blocks: all-gather straight into (1, R L + J, Hk, D) buffers whose tail holds
    the joint tokens, so the whole sequence is one tensor with no copy of the gathered K/V."""
    _, length, hk, d = k.shape
    joint = joint_k.shape[1] if joint_k is not None else 0
    bufs, works = [], []
    for t, jt in ((k, joint_k), (v, joint_v)):
        buf = t.new_empty((1, spec.size * length + joint, hk, d))
        works.append(start_all_gather_into(buf[0, :spec.size * length], t[0], spec.exchanger.group, kind="ring_gather"))
        if joint:
            buf[:, spec.size * length:] = jt
        bufs.append(buf)
    for work in works:
        work.wait()
    return bufs


def _gather_one_call_forward(q, k, v, joint: JointKV | None, spec: RingSpec, backend: AttentionBackend, scale: float,
                             v_wire=None):
    """The "gather_one_call" forward of Note [ring schedule]: one call against the whole sequence
    (masked joint tokens: one more call, merged)."""
    joint_k, joint_v = _in_call(joint)
    # Under torch.compile the gather into a preallocated buffer (an in-place collective) cannot be
    # traced; the functional gather below can. Wire rows are decoded into a new tensor anyway.
    if (not torch.compiler.is_compiling() and v_wire is None and k.shape[0] == 1
            and len(set(spec.block_sizes)) == 1):
        k_all, v_all = _gather_in_place(k, v, joint_k, joint_v, spec)
    else:
        blocks = _gathered_kv(_start_block_gather(k, v, spec, v_wire), spec, k)
        k_all, v_all = (gathered_sequence(b, spec.block_sizes, j) for b, j in zip(blocks, (joint_k, joint_v)))
    merger = LSEMerger()
    if q.shape[1] and k_all.shape[1]:
        merger.add(*backend.forward(q, k_all, v_all, scale))
    add_masked_joint(merger, q, joint, backend, scale)
    return _empty_result(q) if merger.out is None else merger.result(q.dtype)


class RingSchedule(Protocol):
    """One way for a ring's forward to move K/V blocks (Note [ring schedule]), chosen per call.

    ``forward`` returns this rank's ``(out, lse)``; ``keys_per_call`` is how many keys its main
    kernel call attends to, which "auto" weighs against a kernel's per-call cost.
    """

    name: str

    def forward(self, q, k, v, joint: JointKV | None, spec: RingSpec, backend: AttentionBackend, scale: float,
                v_wire: torch.Tensor | None = None): ...

    def keys_per_call(self, block: int, ring: int, joint: int) -> int: ...


@dataclass(frozen=True)
class _Schedule:
    """A ``RingSchedule`` from its forward and its main call's key count."""

    name: str
    forward_fn: Callable
    keys_fn: Callable[[int, int, int], int]

    def forward(self, q, k, v, joint: JointKV | None, spec: RingSpec, backend: AttentionBackend, scale: float,
                v_wire: torch.Tensor | None = None):
        return self.forward_fn(q, k, v, joint, spec, backend, scale, v_wire)

    def keys_per_call(self, block: int, ring: int, joint: int) -> int:
        return self.keys_fn(block, ring, joint)


SCHEDULES: dict[str, RingSchedule] = {
    s.name: s for s in (
        _Schedule("stream", _stream_forward, lambda block, ring, joint: block),
        _Schedule("gather_merge", _gather_merge_forward, lambda block, ring, joint: block * (ring - 1)),
        _Schedule("gather_one_call", _gather_one_call_forward, lambda block, ring, joint: block * ring + joint),
    )
}


def _masked_stream_forward(q, k, v, joint, spec: RingSpec, backend: AttentionBackend, scale: float, v_wire=None):
    """"stream" under a mask: each arriving block runs its plan (nothing for a hidden block)."""
    merger = RowMerger(q)
    for step, cur in _ring_blocks(k, v, spec, v_wire):
        attend_plan(merger, q, cur[0], cur[1], spec.plans[spec.block_at(step)], backend, scale)
    return merger.result(q.dtype)


def _masked_gather_forward(q, k, v, joint, spec: RingSpec, backend: AttentionBackend, scale: float, v_wire=None):
    """"gather_merge" under a mask: the local block's plan while the blocks travel, then the
    gathered blocks' plans (blocks the mask hides are never read)."""
    pending = _start_block_gather(k, v, spec, v_wire)
    merger = RowMerger(q)
    attend_plan(merger, q, k, v, spec.plans[spec.rank], backend, scale)
    k_all, v_all = _gathered_kv(pending, spec, k)
    for j, n in enumerate(spec.block_sizes):
        if j != spec.rank and spec.plans[j]:
            attend_plan(merger, q, k_all[j, :, :n], v_all[j, :, :n], spec.plans[j], backend, scale)
    return merger.result(q.dtype)


MASKED_SCHEDULES: dict[str, RingSchedule] = {
    s.name: s for s in (
        _Schedule("stream", _masked_stream_forward, lambda block, ring, joint: block),
        _Schedule("gather_merge", _masked_gather_forward, lambda block, ring, joint: block),
    )
}


def masked_schedule(requested: str) -> RingSchedule:
    """The masked forward for ``requested`` (canonical name or "auto", which streams)."""
    if requested == "auto":
        return MASKED_SCHEDULES["stream"]
    if requested not in MASKED_SCHEDULES:
        raise NotImplementedError(
            f"ring_schedule={requested!r} with a causal or block-causal mask: one call over the whole "
            f"sequence cannot hold a mask between interleaved blocks; use one of {sorted(MASKED_SCHEDULES)} or 'auto'"
        )
    return MASKED_SCHEDULES[requested]


def _block_grads(backend, dout, q, k_t, v_t, out, lse, scale, dlse=None):
    """(dq, dk, dv) of one step, zeros when the step has no work; ``dlse``: the gradient of the
    final LSE, if any (Note [LSE gradient] in ``usp_dit.kernels.lse_grad``)."""
    if q.shape[1] and k_t.shape[1]:
        return kernel_backward(backend, dout, q, k_t, v_t, out, lse, scale, dlse=dlse)
    return torch.zeros_like(q), torch.zeros_like(k_t), torch.zeros_like(v_t)


def ring_backward(dout, q, k, v, joint: JointKV | None, out, lse, spec: RingSpec, backend, scale, dlse=None):
    """Backward of Note [ring schedule]; returns ``(dq, dk, dv, djoint_k, djoint_v)``. ``dlse``
    (B, Sq, H) or ``None``: the gradient of the final LSE, which every block's backward takes with
    the final out and LSE (Note [LSE gradient] in ``usp_dit.kernels.lse_grad``)."""
    acc = lse_dtype(q.dtype)  # gradients accumulate in the dtype of the merges
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    djk = djv = None
    if joint is not None and joint.mask is not None:  # their own call (Note [masked joint tokens])
        djk, djv = torch.zeros_like(joint.k), torch.zeros_like(joint.v)
        if q.shape[1]:
            dq_j, djk, djv = joint_grads(dout, q, joint, out, lse, backend, scale, dlse)
            dq += dq_j
    receive = None
    try:
        for step, cur in _ring_blocks(k, v, spec):
            k_t, v_t = _with_joint(cur, joint, step)
            if spec.plans is None:
                dq_t, dk_t, dv_t = _block_grads(backend, dout, q, k_t, v_t, out, lse, scale, dlse)
            else:  # under a mask (no joint tokens): the plan of this block pair
                plan = spec.plans[spec.block_at(step)]
                dq_t, dk_t, dv_t = masked_block_grads(backend, dout, q, k_t, v_t, out, lse, scale, plan, dlse)
            dq += dq_t
            n = cur[0].shape[1]
            if step == 0 and _in_call(joint)[0] is not None:
                djk, djv = dk_t[:, n:], dv_t[:, n:]
            dkv = torch.stack([dk_t[:, :n], dv_t[:, :n]]).to(acc)
            if receive is not None:
                dkv += receive()
            # The accumulator we receive next belongs to the block we hold at the next step; after the
            # last step that is our own block, coming home.
            shape = _kv_shape(cur, spec.block_sizes[spec.block_at(step + 1)])
            receive = spec.exchanger.post(dkv, shape, acc, _DKV_TAG, kind="ring_grad")
    except BaseException:  # Note [draining a posted transfer]
        if receive is not None:
            receive.drain()
        raise
    dkv_home = receive()
    return dq.to(q.dtype), dkv_home[0].to(k.dtype), dkv_home[1].to(v.dtype), djk, djv


class RingAttention(torch.autograd.Function):
    """Differentiable ring attention, ``out`` and ``lse`` both (Note [LSE gradient] in
    ``usp_dit.kernels.lse_grad``); ``lse_grad``: the caller may read ``lse`` in a loss (what a
    traced backward, whose LSE gradient is zeros where unread, goes by)."""

    @staticmethod
    def forward(ctx, q, k, v, joint_k, joint_v, joint_mask, spec: RingSpec, backend: AttentionBackend, scale: float,
                lse_grad: bool = False, v_wire: torch.Tensor | None = None):
        joint = None if joint_k is None else JointKV(joint_k, joint_v, joint_mask)
        out, lse = ring_forward(q, k, v, joint, spec, backend, scale, v_wire)
        ctx.save_for_backward(q, k, v, joint_k, joint_v, joint_mask, out, lse)
        ctx.spec, ctx.backend, ctx.scale, ctx.lse_grad = spec, backend, scale, lse_grad
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, joint_k, joint_v, joint_mask, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)  # every rank must still run the ring to serve its peers
        joint = None if joint_k is None else JointKV(joint_k, joint_v, joint_mask)
        dlse = lse_cotangent(dlse, ctx.lse_grad)
        grads = ring_backward(dout.contiguous(), q, k, v, joint, out, lse, ctx.spec, ctx.backend, ctx.scale, dlse)
        return (*grads, None, None, None, None, None, None)
