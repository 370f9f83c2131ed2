"""Causal and block-causal masks between two blocks of tokens, as plans of kernel calls.

Pure index maths (no processes). Positions are int64 tensors, increasing (``usp_dit.sharding.layouts``).

Note [staircase masks]
    A mask here is "frame-causal" with frame length F: query at position p sees key at position s
    when s // F <= p // F. F = 1 is causal attention (s <= p); F = frame_len lets every token see
    its own frame and earlier ones (block-causal video models). With both blocks' positions
    increasing, query row i sees a prefix of the key block, of length

        c[i] = #{keys s : s < (p_i // F + 1) * F}     (non-decreasing in i)

    and the mask is a staircase. It becomes kernel calls by runs of rows:
    - rows with c = 0 see nothing: no call (a block pair with c = 0 everywhere is skipped);
    - a run where c stays constant: one dense call, rows x keys [0, c);
    - a run where c grows by exactly one per row (the diagonal of causal attention, in any
      layout whose blocks interleave like "stripe"): one dense call on keys [0, c_first - 1) and
      one causal call on the square that follows (``causal=True``: query i sees keys j <= i).
    Causal attention in the layouts of ``usp_dit.sharding.layouts`` gives at most two calls per block pair;
    block-causal one call per frame that straddles the diagonal.
"""
from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

import torch

from usp_dit.sharding.layouts import block_positions


class SubCall(NamedTuple):
    """One kernel call of a plan: query rows ``[q0, q1)`` against keys ``[k0, k1)`` of the block
    pair; ``causal``: the square diagonal call (q1 - q0 == k1 - k0)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False

    @property
    def pairs(self) -> int:
        """How many (query, key) pairs it computes: its share of the attention flops."""
        n, m = self.q1 - self.q0, self.k1 - self.k0
        return n * (n + 1) // 2 if self.causal else n * m


def check_frame(causal: bool, block_causal: int | None) -> int | None:
    """The frame length F of Note [staircase masks] (1 for causal), ``None`` for no mask."""
    if block_causal is None:
        return 1 if causal else None
    if causal:
        raise ValueError(f"pass causal=True or block_causal={block_causal!r}, not both (causal is block_causal=1)")
    if isinstance(block_causal, bool) or not isinstance(block_causal, int) or block_causal < 1:
        raise ValueError(f"block_causal={block_causal!r} must be a positive int (tokens per frame)")
    return block_causal


def visible_counts(q_pos: torch.Tensor, k_pos: torch.Tensor, frame: int) -> torch.Tensor:
    """``c[i]``: how many keys (a prefix of ``k_pos``) query ``i`` sees (Note [staircase masks])."""
    limits = torch.div(q_pos, frame, rounding_mode="floor").add_(1).mul_(frame)
    return torch.searchsorted(k_pos, limits, right=False)


def _runs(d: list[int]) -> list[tuple[int, int, int]]:
    """``(start, stop, value)`` runs of equal values of ``d``."""
    runs: list[tuple[int, int, int]] = []
    for i, x in enumerate(d):
        if runs and runs[-1][2] == x and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1, x)
        else:
            runs.append((i, i + 1, x))
    return runs


def _diff_runs(c: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of ``c[i + 1] - c[i]`` (vectorised: long blocks have few runs)."""
    if c.numel() < 2:
        return []
    d = torch.diff(c)
    values, counts = torch.unique_consecutive(d, return_counts=True)
    stops = torch.cumsum(counts, 0).tolist()
    return [(stop - n, stop, v) for stop, n, v in zip(stops, counts.tolist(), values.tolist())]


def plan_calls(c: torch.Tensor) -> tuple[SubCall, ...]:
    """Kernel calls covering the staircase ``c`` exactly (Note [staircase masks])."""
    n = c.numel()
    cl = c.tolist()
    runs = _diff_runs(c)
    starts = [r[0] for r in runs]
    calls: list[SubCall] = []
    i = bisect.bisect_right(cl, 0)  # rows that see nothing form a prefix
    while i < n:
        if i == n - 1:
            calls.append(SubCall(i, n, 0, cl[i]))
            break
        start, stop, step = runs[bisect.bisect_right(starts, i) - 1]
        rows = stop - i + 1 if step in (0, 1) else 1
        first = cl[i]
        if step == 1:  # the diagonal: a dense part, then a causal square
            if first > 1:
                calls.append(SubCall(i, i + rows, 0, first - 1))
            calls.append(SubCall(i, i + rows, first - 1, first - 1 + rows, True))
        else:
            calls.append(SubCall(i, i + rows, 0, first))
        i += rows
    return tuple(calls)


# Host-side index maths: under torch.compile the result is a constant of the graph (it depends on
# integers only), not something to trace (tensor ops on positions would be data-dependent). Dynamo
# honours that mark on a plain function, not on an lru_cache wrapper: hence two functions.
@torch.compiler.assume_constant_result
def ring_plans(seq_len: int, ring: int, ulysses: int, layout: str, frame: int, rank: int) -> tuple[tuple[SubCall, ...], ...]:
    """For ring rank ``rank``: the calls of its query block against every ring block ``j`` (index
    ``j``); an empty tuple where the mask hides the whole block."""
    return _ring_plans(seq_len, ring, ulysses, layout, frame, rank)


@functools.lru_cache(maxsize=1024)
def _ring_plans(seq_len: int, ring: int, ulysses: int, layout: str, frame: int, rank: int):
    blocks = block_positions(seq_len, ring, ulysses, layout)
    return tuple(plan_calls(visible_counts(blocks[rank], kb, frame)) for kb in blocks)


def rank_work(seq_len: int, ring: int, ulysses: int, layout: str, frame: int) -> list[int]:
    """(query, key) pairs each ring rank computes under the mask (its attention flops / 4 B H D)."""
    return [
        sum(call.pairs for plan in ring_plans(seq_len, ring, ulysses, layout, frame, r) for call in plan)
        for r in range(ring)
    ]
