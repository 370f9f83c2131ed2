"""Placing tokens on ranks exactly as ``usp_attention`` expects, and bringing them back.

Layout: any tensor with a sequence dimension ``dim`` (default 1: (batch, seq, ...)).

Sequence rank i = ring_rank * ulysses_degree + ulysses_rank holds the i-th of P contiguous pieces;
the first ``S % P`` pieces hold one token more (at most one token of imbalance). That is the
"contiguous" layout; "zigzag" and "stripe" balance causal attention over the ring (Note [sequence
layouts] in ``usp_dit.sharding.layouts``): pass the same ``layout`` to ``shard_sequence``, ``usp_attention``
and ``gather_sequence``.
"""
from __future__ import annotations

import operator

import torch

from usp_dit.distributed.comm import all_gather_uneven
from usp_dit.distributed.handshake import agree, calls_verified
from usp_dit.distributed.mesh import USPMesh, resolve_mesh
from usp_dit.sharding.layouts import Piece, check_layout, gather_index, shard_pieces, shard_sizes
from usp_dit.sharding.partition import offsets, split_sizes


def _piece(x: torch.Tensor, dim: int, piece: Piece) -> torch.Tensor:
    """The rows of ``piece`` of ``x`` along ``dim`` (a view)."""
    if piece.step == 1:
        return x.narrow(dim, piece.start, piece.count)
    index = [slice(None)] * x.dim()
    index[dim] = slice(piece.start, piece.start + (piece.count - 1) * piece.step + 1, piece.step)
    return x[tuple(index)]


def shard_sequence(x: torch.Tensor, mesh: USPMesh | None = None, dim: int = 1, layout: str = "contiguous") -> torch.Tensor:
    """This rank's piece of the full (replicated) ``x`` along ``dim``, in ``layout`` ("contiguous",
    "zigzag" or "stripe": Note [sequence layouts] in ``usp_dit.sharding.layouts``).

    Contiguous and stripe shards are views, zigzag shards a copy of two views (one when the shard
    lies in one chunk); either way the gradient reaches only this rank's rows of ``x`` (per-rank
    partials whose sum over the sequence group is the full gradient).
    """
    mesh = resolve_mesh(mesh)
    check_layout(layout)
    dim = dim % x.dim()
    if layout == "contiguous":
        sizes = split_sizes(x.shape[dim], mesh.sequence_degree)
        i = mesh.seq_rank
        return x.narrow(dim, offsets(sizes)[i], sizes[i])
    pieces = shard_pieces(x.shape[dim], mesh.ring_degree, mesh.ulysses_degree, layout)[mesh.seq_rank]
    parts = [_piece(x, dim, p) for p in pieces]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim) if parts else x.narrow(dim, 0, 0)


def layout_sizes(seq_len: int, mesh: USPMesh, layout: str) -> list[int]:
    """Every rank's shard length for ``seq_len`` tokens in ``layout``, in sequence-rank order.

    Contiguous shards are ``split_sizes``, which keeps a symbolic length symbolic under
    torch.compile. The other layouts are index maths on the value (cached per length), so a
    compiled call specialises the length (``operator.index``: ``int()`` of a symbolic length
    stays symbolic under Dynamo)."""
    if layout == "contiguous":
        return split_sizes(seq_len, mesh.sequence_degree)
    return shard_sizes(operator.index(seq_len), mesh.ring_degree, mesh.ulysses_degree, layout)


def gather_sequence(
    x_local: torch.Tensor, mesh: USPMesh | None = None, dim: int = 1, seq_len: int | None = None,
    layout: str = "contiguous",
) -> torch.Tensor:
    """The full sequence from every rank's piece, identical on all ranks of the sequence group.

    ``gather_sequence(shard_sequence(x, layout=l), layout=l) == x`` bit for bit, contiguous (a
    non-contiguous layout puts the rows back in order with one ``index_select``). The ranks first agree on
    dtype and shape (Note [call handshake] in ``usp_dit.distributed.handshake``: one small all-gather that also
    brings the piece lengths); ``seq_len`` (the full length) is checked against every rank's piece,
    and inside ``verified_calls(mesh)`` it saves that gather. Backward: each rank's piece receives the sum over ranks
    of the gradients of the gathered tensor (every rank's loss reads it).
    """
    mesh = resolve_mesh(mesh)
    check_layout(layout)
    if mesh.sequence_degree == 1:
        return x_local
    dim = dim % x_local.dim()
    if seq_len is None and torch.compiler.is_compiling():
        raise ValueError(
            "seq_len=None: under torch.compile gather_sequence needs seq_len (the full length along "
            "dim) since the handshake that gathers the piece lengths cannot be traced"
        )
    if seq_len is not None and calls_verified(mesh):
        sizes = layout_sizes(seq_len, mesh, layout)
    else:  # Note [call handshake]: the gather of piece lengths checks the rest of the shape too
        others = tuple(n for i, n in enumerate(x_local.shape) if i != dim)
        fields = {"dtype": x_local.dtype, "dim": dim, "other dims": others, "seq_len": seq_len, "layout": layout}
        sizes = agree(fields, mesh.seq_group, x_local.device, varying=x_local.shape[dim], what="a gather_sequence call")
        expected = layout_sizes(sum(sizes) if seq_len is None else seq_len, mesh, layout)
        # Any split gathers in the contiguous layout; the others put rows back by their positions.
        if (seq_len is not None or layout != "contiguous") and sizes != expected:
            raise ValueError(
                f"seq_len={seq_len} gives shards of {expected} tokens along dim={dim} in layout={layout!r}, "
                f"but the ranks hold {sizes}: shard with usp_dit.shard_sequence(..., layout={layout!r})"
            )
    if sizes[mesh.seq_rank] != x_local.shape[dim]:
        raise ValueError(
            f"seq_len={seq_len} gives rank {mesh.seq_rank} {sizes[mesh.seq_rank]} tokens, "
            f"but x_local has {x_local.shape[dim]} along dim={dim}"
        )
    full = all_gather_uneven(x_local, sizes, dim, mesh.seq_group, kind="seq_gather")
    if layout == "contiguous":
        return full
    index = gather_index(sum(sizes), mesh.ring_degree, mesh.ulysses_degree, layout)
    return full.index_select(dim, index.to(full.device))
