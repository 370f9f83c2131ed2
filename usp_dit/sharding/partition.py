"""Index maths for splitting sequences and heads over ranks (no processes, no tensors).

Everything here is a pure function of a few integers so that the schedules can be unit-tested
without a process group.

Conventions:
- A length ``n`` split into ``parts`` pieces gives the first ``n % parts`` pieces one extra item,
  so pieces differ by at most one (``split_sizes``).
- Sequence shards are laid out rank-major over the sequence group: rank ``i = ring_rank * U +
  ulysses_rank`` holds the ``i``-th piece. A Ulysses all-to-all then leaves ring rank ``r`` with
  the contiguous *ring block* made of pieces ``r*U .. r*U+U-1``.
- Heads are split over the Ulysses ranks as contiguous ranges (``HeadPlan``).
"""
from __future__ import annotations

from dataclasses import dataclass


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous pieces of ``n`` items, differing by at most one."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # Piece i holds the items j < n with j = i (mod parts): ceil((n - i) / parts) of them, the same
    # as base + (i < n % parts) but without a branch on n, so a symbolic n under torch.compile's
    # dynamic shapes stays symbolic (no guard, no recompile per remainder).
    return [(n + parts - 1 - i) // parts for i in range(parts)]


def offsets(sizes: list[int]) -> list[int]:
    """Start offset of each piece: ``offsets([3, 2, 2]) == [0, 3, 5]``."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def ring_block_sizes(shard_sizes: list[int], ulysses_degree: int) -> list[int]:
    """Length of each ring block: the sum of the ``U`` shards that one Ulysses group gathers.

    ``shard_sizes`` has one entry per rank of the sequence group in rank order (ring-major).
    """
    if len(shard_sizes) % ulysses_degree:
        raise ValueError(
            f"len(shard_sizes)={len(shard_sizes)} is not a multiple of ulysses_degree={ulysses_degree}"
        )
    u = ulysses_degree
    return [sum(shard_sizes[r * u:(r + 1) * u]) for r in range(len(shard_sizes) // u)]


@dataclass(frozen=True)
class HeadPlan:
    """Which query and key/value heads each Ulysses rank owns after the all-to-all.

    ``q_ranges[u] = (lo, hi)`` are the query heads of Ulysses rank ``u``; ``kv_ranges[u]`` the
    key/value heads that those queries read (ranges of different ranks may overlap when there are
    fewer K/V heads than ranks, e.g. MQA). ``kv_index[u]`` maps each local query head to its local
    K/V head; ``kv_group[u]`` is the uniform GQA group size when the map is ``i // group``, else
    ``None`` (the caller then expands K/V to one head per query head).
    """

    num_heads: int
    num_kv_heads: int
    q_ranges: tuple[tuple[int, int], ...]
    kv_ranges: tuple[tuple[int, int], ...]
    kv_index: tuple[tuple[int, ...], ...]
    kv_group: tuple[int | None, ...]

    @property
    def kv_is_partition(self) -> bool:
        """True when the K/V ranges tile ``[0, num_kv_heads)`` without overlap."""
        return all(self.kv_ranges[i][1] == self.kv_ranges[i + 1][0] for i in range(len(self.kv_ranges) - 1)) and (
            self.kv_ranges[0][0] == 0 and self.kv_ranges[-1][1] == self.num_kv_heads
        )


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    return [(o, o + s) for o, s in zip(offsets(sizes), sizes)]


def head_plan(num_heads: int, num_kv_heads: int, ulysses_degree: int) -> HeadPlan:
    """Split ``num_heads`` query heads and ``num_kv_heads`` K/V heads over ``ulysses_degree`` ranks.

    With at least as many K/V heads as ranks, K/V heads are split evenly and each rank takes the
    query heads of its K/V heads: no K/V head is sent twice and the GQA map stays uniform. With
    fewer K/V heads than ranks (e.g. MQA), query heads are split evenly and each rank receives only
    the K/V heads its queries read.
    """
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"num_heads={num_heads} and num_kv_heads={num_kv_heads} must be >= 1")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} (query heads) must be a multiple of num_kv_heads={num_kv_heads} (key/value heads)"
        )
    if ulysses_degree > num_heads:
        raise ValueError(
            f"ulysses_degree={ulysses_degree} exceeds the number of query heads {num_heads}: "
            f"use ulysses_degree <= {num_heads} and put the remaining ranks on the ring"
        )
    group = num_heads // num_kv_heads
    if num_kv_heads >= ulysses_degree:
        kv_ranges = _ranges(split_sizes(num_kv_heads, ulysses_degree))
        q_ranges = [(lo * group, hi * group) for lo, hi in kv_ranges]
    else:
        q_ranges = _ranges(split_sizes(num_heads, ulysses_degree))
        kv_ranges = [(lo // group, (hi - 1) // group + 1) for lo, hi in q_ranges]
    kv_index, kv_group = [], []
    for (qlo, qhi), (kvlo, kvhi) in zip(q_ranges, kv_ranges):
        index = tuple(h // group - kvlo for h in range(qlo, qhi))
        kv_index.append(index)
        n_q, n_kv = qhi - qlo, kvhi - kvlo
        uniform = n_q % n_kv == 0 and all(i == j // (n_q // n_kv) for j, i in enumerate(index))
        kv_group.append(n_q // n_kv if uniform else None)
    return HeadPlan(num_heads, num_kv_heads, tuple(q_ranges), tuple(kv_ranges), tuple(kv_index), tuple(kv_group))
