"""Sequence layouts: which global token positions each rank of the sequence group holds.

Pure index maths (no processes); tensors only as position lists. Layout of the data itself is the
caller's (``usp_dit.sharding.shard`` slices any tensor along its sequence dim).

Note [sequence layouts]
    The sequence group has P = U * R ranks, rank i = r * U + u (ring rank r, Ulysses rank u). The
    Ulysses all-to-all concatenates the U shards of ring rank r in u order into its *ring block*
    (``usp_dit.attention.ulysses``), so a layout is defined by the ring blocks, and each Ulysses rank takes the
    u-th contiguous piece of its ring block (``split_sizes`` of the block's length):

    - "contiguous": the P shards are ``split_sizes(S, P)`` contiguous pieces (what ``usp_attention``
      has always taken); ring block r is contiguous too.
    - "zigzag": the sequence is cut into 2R chunks (``split_sizes(S, 2R)``) and ring block r holds
      chunks r and 2R-1-r, in that order. With U = 1 that is rank r holding chunks r and 2P-1-r.
      Under a causal mask every ring rank then has the same work (one early and one late chunk).
    - "stripe": ring block r holds tokens r, r + R, r + 2R, ... (with U = 1: token i on rank i mod P).

    Every ring block lists its positions in increasing order. That is what makes a causal mask
    between two blocks a staircase (``usp_dit.attention.masks``): query row i sees a prefix of the key block.
    Lengths need not divide: blocks and shards differ by at most one token (two for zigzag blocks).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from usp_dit.sharding.partition import offsets, split_sizes

LAYOUTS = ("contiguous", "zigzag", "stripe")


class Piece(NamedTuple):
    """Positions ``start + i * step`` for ``i < count`` (a strided run of the sequence)."""

    start: int
    count: int
    step: int = 1


def check_layout(layout: str) -> str:
    """``layout`` itself, or ValueError naming the allowed ones."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a sequence layout; choose one of {list(LAYOUTS)}")
    return layout


def _take(pieces: tuple[Piece, ...], start: int, count: int) -> tuple[Piece, ...]:
    """Items ``[start, start + count)`` of the concatenated ``pieces``, as pieces."""
    out, skip = [], start
    for p in pieces:
        if count <= 0:
            break
        if skip >= p.count:
            skip -= p.count
            continue
        n = min(p.count - skip, count)
        out.append(Piece(p.start + skip * p.step, n, p.step))
        count, skip = count - n, 0
    return tuple(out)


def _ring_blocks(seq_len: int, ring: int, layout: str) -> list[tuple[Piece, ...]]:
    """Positions of every ring block of a non-contiguous layout (Note [sequence layouts])."""
    if layout == "zigzag":
        sizes = split_sizes(seq_len, 2 * ring)
        starts = offsets(sizes)
        return [
            tuple(Piece(starts[c], sizes[c]) for c in (r, 2 * ring - 1 - r) if sizes[c])
            for r in range(ring)
        ]
    return [(Piece(r, n, ring),) if n else () for r, n in enumerate(split_sizes(seq_len, ring))]


@functools.lru_cache(maxsize=256)
def shard_pieces(seq_len: int, ring: int, ulysses: int, layout: str) -> tuple[tuple[Piece, ...], ...]:
    """The positions of every rank's shard, in sequence-rank order (rank i = r * U + u)."""
    check_layout(layout)
    if layout == "contiguous":
        sizes = split_sizes(seq_len, ring * ulysses)
        return tuple((Piece(o, n),) if n else () for o, n in zip(offsets(sizes), sizes))
    shards = []
    for block in _ring_blocks(seq_len, ring, layout):
        sizes = split_sizes(sum(p.count for p in block), ulysses)
        shards += [_take(block, o, n) for o, n in zip(offsets(sizes), sizes)]
    return tuple(shards)


def shard_sizes(seq_len: int, ring: int, ulysses: int, layout: str) -> list[int]:
    """Token count of every rank's shard, in sequence-rank order."""
    return [sum(p.count for p in s) for s in shard_pieces(seq_len, ring, ulysses, layout)]


def positions(pieces: tuple[Piece, ...]) -> torch.Tensor:
    """The positions of ``pieces`` as one int64 CPU tensor, in order."""
    parts = [torch.arange(p.start, p.start + p.count * p.step, p.step, dtype=torch.int64) for p in pieces]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@functools.lru_cache(maxsize=256)
def block_positions(seq_len: int, ring: int, ulysses: int, layout: str) -> tuple[torch.Tensor, ...]:
    """Positions of every ring block (its U shards in Ulysses-rank order), increasing."""
    shards = shard_pieces(seq_len, ring, ulysses, layout)
    return tuple(positions(sum(shards[r * ulysses:(r + 1) * ulysses], ())) for r in range(ring))


@functools.lru_cache(maxsize=64)
def gather_index(seq_len: int, ring: int, ulysses: int, layout: str) -> torch.Tensor:
    """``idx`` with ``natural = in_rank_order.index_select(dim, idx)``: where each position sits in
    the concatenation of every rank's shard in rank order."""
    order = positions(sum(shard_pieces(seq_len, ring, ulysses, layout), ()))
    return torch.argsort(order)
