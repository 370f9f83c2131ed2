"""The ring schedule simulated on one device: N virtual ranks in one process, no communication.

Layout: q (B, Sq, H, D); k, v (B, Sk, Hk, D); out like q; lse (B, Sq, H).

Query and K/V sequences are cut into N blocks (uneven lengths allowed, as ``split_sizes`` cuts
them); every query block attends to every K/V block through the backend and the partial results
are merged by LSE exactly as a ring rank merges them, in each forward schedule of
``usp_dit.attention.ring`` (Note [ring schedule]): "stream" merges block by block, "gather_merge" attends to the
local block and then to each run of equal-length remote blocks in one call, through the same
functions the ring runs; "gather_one_call" makes one call per rank against the whole sequence. The
backward feeds each block the merged out/LSE, as the ring backward does. Used by the GPU kernel
tests (a backend is ring-safe when its blockwise result matches its whole-sequence result) and the
ring-block benchmark.
"""
from __future__ import annotations

import torch

from usp_dit.attention.merge import LSEMerger
from usp_dit.attention.ring import attend_local, attend_stacks, remote_runs
from usp_dit.distributed.config import canonical_schedule
from usp_dit.kernels.protocol import AttentionBackend, lse_dtype
from usp_dit.sharding.partition import offsets, split_sizes


def _blocks(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(x.split(split_sizes(x.shape[1], n), dim=1))


def _stack(x: torch.Tensor, sizes: list[int], start: int, stop: int, length: int) -> torch.Tensor:
    """Blocks ``start:stop`` of ``x`` (B, S, Hk, D), all ``length`` long, as a (G, B, length, Hk, D) view."""
    first = offsets(sizes)[start]
    return x[:, first:first + (stop - start) * length].unflatten(1, (stop - start, length)).movedim(1, 0)


def _rank_forward(q_blk, k_blocks, v_blocks, stacks, backend, scale: float, rank: int, schedule: str):
    """What ring rank ``rank`` computes for its queries ``q_blk`` in the given forward schedule;
    ``stacks(rank)`` gives the gather schedule's (k_stack, v_stack) runs of remote blocks."""
    n = len(k_blocks)
    if schedule == "gather_merge":
        merger = attend_local(q_blk, k_blocks[rank], v_blocks[rank], backend, scale)
        return attend_stacks(merger, q_blk, stacks(rank), backend, scale)
    merger = LSEMerger()
    for step in range(n):
        j = (rank - step) % n
        merger.add(*backend.forward(q_blk, k_blocks[j], v_blocks[j], scale))
    return merger.result(q_blk.dtype)


def blockwise_forward(q, k, v, backend: AttentionBackend, scale: float, n: int, schedule: str = "stream"):
    """Returns ``(out, lse)`` of ``n`` x ``n`` blocks merged by LSE, as ``n`` ring ranks compute them."""
    schedule = canonical_schedule(schedule)
    sizes = split_sizes(k.shape[1], n)
    k_blocks, v_blocks = _blocks(k, n), _blocks(v, n)

    def stacks(rank: int):
        return [(_stack(k, sizes, a, b, m), _stack(v, sizes, a, b, m)) for a, b, m in remote_runs(tuple(sizes), rank)]

    if schedule == "gather_one_call":  # the gathered K/V is the whole sequence, used in place (batch 1)
        results = [backend.forward(q_blk, k, v, scale) for q_blk in _blocks(q, n) if q_blk.shape[1]]
    else:
        results = [_rank_forward(q_blk, k_blocks, v_blocks, stacks, backend, scale, r, schedule)
                   for r, q_blk in enumerate(_blocks(q, n))]
    return torch.cat([o for o, _ in results], dim=1), torch.cat([lse for _, lse in results], dim=1)


def blockwise_backward(dout, q, k, v, out, lse, backend: AttentionBackend, scale: float, n: int):
    """Returns ``(dq, dk, dv)``, block gradients accumulated in float32 as the ring does."""
    acc = lse_dtype(q.dtype)
    k_blocks, v_blocks = _blocks(k, n), _blocks(v, n)
    dk = [torch.zeros(b.shape, dtype=acc, device=b.device) for b in k_blocks]
    dv = [torch.zeros(b.shape, dtype=acc, device=b.device) for b in v_blocks]
    dqs = []
    for q_blk, do_blk, o_blk, l_blk in zip(_blocks(q, n), _blocks(dout, n), _blocks(out, n), _blocks(lse, n)):
        dq = torch.zeros(q_blk.shape, dtype=acc, device=q.device)
        for j, (k_blk, v_blk) in enumerate(zip(k_blocks, v_blocks)):
            g_q, g_k, g_v = backend.backward(do_blk, q_blk, k_blk, v_blk, o_blk, l_blk, scale)
            dq += g_q
            dk[j] += g_k
            dv[j] += g_v
        dqs.append(dq)
    cat = lambda xs, like: torch.cat(xs, dim=1).to(like.dtype)  # noqa: E731
    return cat(dqs, q), cat(dk, k), cat(dv, v)
