"""Placing tokens on ranks exactly as ``usp_attention`` expects, and bringing them back.

Layout: any tensor with a sequence dimension ``dim`` (default 1: (batch, seq, ...)).

Sequence rank i = ring_rank * ulysses_degree + ulysses_rank holds the i-th of P contiguous pieces;
the first ``S % P`` pieces hold one token more (at most one token of imbalance).
"""
from __future__ import annotations

import torch

from usp_dit.comm import all_gather_uneven
from usp_dit.handshake import agree, calls_verified
from usp_dit.mesh import USPMesh, resolve_mesh
from usp_dit.partition import offsets, split_sizes


def shard_sequence(x: torch.Tensor, mesh: USPMesh | None = None, dim: int = 1) -> torch.Tensor:
    """This rank's piece of the full (replicated) ``x`` along ``dim``.

    A narrow view: its gradient reaches only this rank's rows of ``x`` (per-rank partials whose sum
    over the sequence group is the full gradient).
    """
    mesh = resolve_mesh(mesh)
    sizes = split_sizes(x.shape[dim], mesh.sequence_degree)
    i = mesh.seq_rank
    return x.narrow(dim, offsets(sizes)[i], sizes[i])


def gather_sequence(
    x_local: torch.Tensor, mesh: USPMesh | None = None, dim: int = 1, seq_len: int | None = None
) -> torch.Tensor:
    """The full sequence from every rank's piece, identical on all ranks of the sequence group.

    ``gather_sequence(shard_sequence(x)) == x`` bit for bit, contiguous. The ranks first agree on
    dtype and shape (Note [call handshake] in ``usp_dit.handshake``: one small all-gather that also
    brings the piece lengths); ``seq_len`` (the full length) is checked against every rank's piece,
    and inside ``verified_calls(mesh)`` it saves that gather. Backward: each rank's piece receives the sum over ranks
    of the gradients of the gathered tensor (every rank's loss reads it).
    """
    mesh = resolve_mesh(mesh)
    if mesh.sequence_degree == 1:
        return x_local
    dim = dim % x_local.dim()
    if seq_len is None and torch.compiler.is_compiling():
        raise ValueError(
            "seq_len=None: under torch.compile gather_sequence needs seq_len (the full length along "
            "dim) since the handshake that gathers the piece lengths cannot be traced"
        )
    if seq_len is not None and calls_verified(mesh):
        sizes = split_sizes(seq_len, mesh.sequence_degree)
    else:  # Note [call handshake]: the gather of piece lengths checks the rest of the shape too
        others = tuple(n for i, n in enumerate(x_local.shape) if i != dim)
        fields = {"dtype": x_local.dtype, "dim": dim, "other dims": others, "seq_len": seq_len}
        sizes = agree(fields, mesh.seq_group, x_local.device, varying=x_local.shape[dim], what="a gather_sequence call")
        if seq_len is not None and sizes != split_sizes(seq_len, mesh.sequence_degree):
            raise ValueError(
                f"seq_len={seq_len} gives shards of {split_sizes(seq_len, mesh.sequence_degree)} tokens along "
                f"dim={dim}, but the ranks hold {sizes}: shard with usp_dit.shard_sequence or omit seq_len"
            )
    if sizes[mesh.seq_rank] != x_local.shape[dim]:
        raise ValueError(
            f"seq_len={seq_len} gives rank {mesh.seq_rank} {sizes[mesh.seq_rank]} tokens, "
            f"but x_local has {x_local.shape[dim]} along dim={dim}"
        )
    return all_gather_uneven(x_local, sizes, dim, mesh.seq_group)
