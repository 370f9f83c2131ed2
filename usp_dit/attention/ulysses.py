"""The Ulysses side of USP: turn sequence shards into head slices of a ring block, and back.

Layout: (batch, seq, heads, head_dim).

Within one Ulysses group (ranks u = 0..U-1 of ring rank r), rank u holds sequence shard
``r*U + u`` with all heads. After ``scatter_heads`` it holds ring block r (shards r*U..r*U+U-1,
contiguous in the sequence) with its query heads ``q_ranges[u]`` and the K/V heads those queries
read (``kv_ranges[u]``, see ``partition.head_plan``). ``gather_heads`` is the inverse for outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from usp_dit.distributed import fp8_wire
from usp_dit.distributed.comm import (
    A2APlan,
    all_to_all_heads_to_seq,
    all_to_all_seq_to_heads,
    heads_to_seq,
    seq_to_heads,
)
from usp_dit.distributed.mesh import USPMesh
from usp_dit.sharding.partition import HeadPlan, head_plan


@dataclass(frozen=True)
class UlyssesLayout:
    """Head plan and the all-to-all plans of one call; ``q_plan``/``kv_plan`` are None when U == 1."""

    heads: HeadPlan
    rank: int
    q_plan: A2APlan | None
    kv_plan: A2APlan | None

    @property
    def q_range(self) -> tuple[int, int]:
        return self.heads.q_ranges[self.rank]

    @property
    def kv_range(self) -> tuple[int, int]:
        return self.heads.kv_ranges[self.rank]

    def local_kv(self, x: torch.Tensor) -> torch.Tensor:
        """K/V head slice (B, S, h_kv, D) -> what the kernel reads for the local query heads.

        When the local query heads map to local K/V heads as ``i // group`` the slice is returned as
        is (the kernel handles GQA); otherwise each query head gets its own copy of its K/V head.
        """
        if self.heads.kv_group[self.rank] is not None:
            return x
        index = torch.tensor(self.heads.kv_index[self.rank], device=x.device)
        return x.index_select(2, index)


def ulysses_layout(mesh: USPMesh, num_heads: int, num_kv_heads: int, ring_block_shards: list[int]) -> UlyssesLayout:
    """Plans for this rank. ``ring_block_shards``: shard lengths of this rank's Ulysses group."""
    heads = head_plan(num_heads, num_kv_heads, mesh.ulysses_degree)
    if mesh.ulysses_degree == 1:
        return UlyssesLayout(heads, 0, None, None)
    group, rank, sizes = mesh.ulysses_group, mesh.ulysses_rank, tuple(ring_block_shards)
    q_plan = A2APlan(group, rank, sizes, heads.q_ranges, num_heads)
    kv_plan = A2APlan(group, rank, sizes, heads.kv_ranges, num_kv_heads)
    return UlyssesLayout(heads, rank, q_plan, kv_plan)


def scatter_heads(x: torch.Tensor, plan: A2APlan | None, fp8: bool = False) -> torch.Tensor:
    """(B, S_shard, H, D) -> (B, S_block, h_local, D); identity when U == 1. ``fp8``: it travels
    in the FP8 wire format (Note [fp8 wire]; not differentiable: the caller refuses gradients)."""
    if plan is None:
        return x
    if fp8:
        return fp8_wire.decode(seq_to_heads(fp8_wire.encode(x), plan), x.dtype)
    return all_to_all_seq_to_heads(x, plan)


def scatter_heads_encoded(x: torch.Tensor, plan: A2APlan | None) -> torch.Tensor:
    """(B, S_shard, H, D) float -> (B, S_block, h_local, D + 4) uint8: the FP8 wire rows of
    ``scatter_heads(x, plan, fp8=True)`` before they are decoded (encoded here when U == 1), for a
    ring that passes them on as they are (Note [fp8 ring V])."""
    wire = fp8_wire.encode(x)
    return wire if plan is None else seq_to_heads(wire, plan)


def gather_heads(y: torch.Tensor, plan: A2APlan | None, fp8: bool = False) -> torch.Tensor:
    """(B, S_block, h_local, *rest) -> (B, S_shard, H, *rest); identity when U == 1. ``fp8``: an
    output (rest = (D,)) travels in the FP8 wire format; its query heads tile H, so no received
    piece is summed (which the wire's bytes could not be)."""
    if plan is None:
        return y
    if fp8:
        assert plan.heads_partition, "query head ranges tile the heads (partition.head_plan)"
        return fp8_wire.decode(heads_to_seq(fp8_wire.encode(y), plan), y.dtype)
    return all_to_all_heads_to_seq(y, plan)
