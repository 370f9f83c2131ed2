"""Placing tokens on ranks exactly as ``usp_attention`` expects, and bringing them back.

Layout: any tensor with a sequence dimension ``dim`` (default 1: (batch, seq, ...)).

Sequence rank i = ring_rank * ulysses_degree + ulysses_rank holds the i-th of P contiguous pieces;
the first ``S % P`` pieces hold one token more (at most one token of imbalance).
"""
from __future__ import annotations

import torch

from usp_dit.comm import all_gather_sizes, all_gather_uneven
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

    ``gather_sequence(shard_sequence(x)) == x`` bit for bit. ``seq_len`` (the full length) saves
    one small all-gather of piece lengths. Backward: each rank's piece receives the sum over ranks
    of the gradients of the gathered tensor (every rank's loss reads it).
    """
    mesh = resolve_mesh(mesh)
    if mesh.sequence_degree == 1:
        return x_local
    if seq_len is None:
        sizes = all_gather_sizes(x_local.shape[dim], mesh.seq_group, x_local.device)
    else:
        sizes = split_sizes(seq_len, mesh.sequence_degree)
        if sizes[mesh.seq_rank] != x_local.shape[dim]:
            raise ValueError(
                f"seq_len={seq_len} gives rank {mesh.seq_rank} {sizes[mesh.seq_rank]} tokens, "
                f"but x_local has {x_local.shape[dim]} along dim={dim}"
            )
    return all_gather_uneven(x_local, sizes, dim, mesh.seq_group)
