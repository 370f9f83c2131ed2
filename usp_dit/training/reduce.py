"""Reductions of a sequence-parallel training step: gradients, shared noise, consistency checks.

Layout: parameters and gradients as the model holds them (any shape); noise and timesteps any shape,
identical on the ranks of one model replica.

Who is a replica and who is data parallel: Note [who is a replica, who is data parallel] in
``usp_dit.distributed.replica``, whose helpers (groups, broadcast, checksum, device) these build on.

Note [mean over the replica is the one-process gradient]
    Autograd differentiates the sum of every rank's loss (docs/DESIGN.md "Gradient convention").
    With the same loss L on all M = cfg*ring*ulysses ranks of a replica, that sum is M*L, and each
    rank holds the part of d(M*L)/dθ coming from its own tokens (``gather_sequence``'s backward
    sums the M ranks' gradients of the gathered output). Summed over the replica: M * dL/dθ.
    The **mean** over the replica is therefore dL/dθ, the one-process gradient, with no extra
    factor. Averaging over the dp ranks as well (the mean over the whole world, what DDP and FSDP2
    do) gives the mean of the replicas' gradients: ordinary data parallelism.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import broadcast_from_first_rank, comm_device, replica_groups, same_on_replica

_OVER = ("replica", "world")
_BUCKET_NUMEL = 1 << 24  # 16M elements per all-reduce: big enough to amortise latency, bounded copy


def data_parallel_group(mesh: USPMesh) -> dist.ProcessGroup | None:
    """The group of ranks with this rank's replica coordinates and every dp index (None if dp = 1)."""
    if mesh.dp_degree == 1 or mesh.device_mesh is None:
        return None
    return mesh.device_mesh.get_group("dp")


def reduction_groups(mesh: USPMesh, over: str) -> list[dist.ProcessGroup]:
    """Groups spanning ``over``: "replica" (cfg x ring x ulysses) or "world" (replica x dp).

    Raises:
        ValueError: ``over`` is not one of "replica", "world".
    """
    if over not in _OVER:
        raise ValueError(f"over must be one of {_OVER}, got {over!r}")
    groups = replica_groups(mesh)
    dp = data_parallel_group(mesh)
    if over == "world" and dp is not None:
        groups.append(dp)
    return groups


def _num_ranks(groups: list[dist.ProcessGroup]) -> int:
    n = 1
    for g in groups:
        n *= dist.get_world_size(g)
    return n


def _all_reduce(t: torch.Tensor, groups: list[dist.ProcessGroup], op=dist.ReduceOp.SUM) -> None:
    """Reduce ``t`` (contiguous) in place over the product of ``groups`` (one reduction per axis)."""
    for g in groups:
        dist.all_reduce(t, op=op, group=g)


def _fill_missing_grads(params: list[torch.nn.Parameter], groups: list[dist.ProcessGroup], mesh: USPMesh) -> list:
    """Parameters whose gradient exists on any rank, with a zero gradient put where it is ``None``.

    A parameter none of whose tokens sit on a rank (or that is unused) has ``grad is None`` there
    but not necessarily elsewhere; every rank must take part in the same reductions, so presence
    is agreed first (one small all-reduce). Parameters without a gradient anywhere stay ``None``.
    """
    if not params:
        return []
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                           device=comm_device(mesh, params[0]))
    _all_reduce(present, groups, dist.ReduceOp.MAX)
    kept = []
    for p, anywhere in zip(params, present.tolist()):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        kept.append(p)
    return kept


def _check_plain(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        if p.grad is not None and type(p.grad) is not torch.Tensor:
            raise ValueError(
                f"sync_grads got a {type(p.grad).__name__} gradient (FSDP2 / DTensor): FSDP already averages "
                f"gradients over its mesh; call sync_grads only for plain (unsharded) parameters"
            )


def _buckets(params: list[torch.nn.Parameter]) -> Iterable[list[torch.nn.Parameter]]:
    """Runs of consecutive parameters with one grad dtype and device, at most ~_BUCKET_NUMEL elements."""
    bucket: list[torch.nn.Parameter] = []
    numel = 0
    for p in params:
        same = not bucket or (p.grad.dtype == bucket[0].grad.dtype and p.grad.device == bucket[0].grad.device)
        if bucket and (not same or numel + p.grad.numel() > _BUCKET_NUMEL):
            yield bucket
            bucket, numel = [], 0
        bucket.append(p)
        numel += p.grad.numel()
    if bucket:
        yield bucket


def sync_grads(
    model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter], mesh: USPMesh, over: str = "world"
) -> None:
    """Average every gradient over the model replica (``over="replica"``) or the whole world, in place.

    Note [mean over the replica is the one-process gradient]: after ``loss.backward()`` with the same
    loss on every rank of a replica, ``sync_grads(model, mesh)`` leaves on every rank the
    data-parallel mean of the one-process gradients (or, with ``over="replica"``, this replica's
    one-process gradient). Use it instead of DDP/FSDP, not with them (they already average).
    Parameters that do not require grad are skipped; see ``_fill_missing_grads`` for ``None`` grads.

    Raises:
        ValueError: bad ``over``; a gradient is a DTensor (FSDP2 already reduced it).
    """
    params = list(model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params)
    params = [p for p in params if p.requires_grad]
    _check_plain(params)
    groups = reduction_groups(mesh, over)
    if not groups:
        return
    num_ranks = _num_ranks(groups)
    for bucket in _buckets(_fill_missing_grads(params, groups, mesh)):
        grads = [p.grad for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(comm_device(mesh, grads[0]))
        _all_reduce(flat, groups)
        flat /= num_ranks
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


def broadcast_from_group_leader(tensor: torch.Tensor, mesh: USPMesh) -> torch.Tensor:
    """``tensor`` replaced in place by the value on its replica's first rank; returns ``tensor``.

    For noise, timesteps and anything else random that every rank of a replica must share (Note
    [who is a replica, who is data parallel]). Each dp index keeps its own leader's value. Any
    shape and dtype (bool goes as uint8); the tensor must not require grad.

    Raises:
        ValueError: ``tensor`` requires grad (a broadcast would silently cut it from the graph).
    """
    if tensor.requires_grad:
        raise ValueError("tensor requires grad: broadcast_from_group_leader is for inputs such as noise and timesteps")
    if replica_groups(mesh):
        tensor.copy_(broadcast_from_first_rank(tensor, mesh))
    return tensor


def check_same_on_replica(tensor: torch.Tensor, mesh: USPMesh, name: str) -> None:
    """ValueError unless ``tensor`` is bit-identical on every rank of the replica (one small all-reduce).

    Cheap guard for the one silent failure of sequence-parallel training: ranks of a replica that
    draw different noise or timesteps compute different losses, and the mean of their gradients is
    then the gradient of nothing. Compares a float64 checksum (sum and position-weighted sum).

    Raises:
        ValueError: the checksums differ (the message names ``name``).
    """
    if not same_on_replica(tensor, mesh):
        raise ValueError(
            f"{name} differs between the ranks of one model replica; every rank of a replica must use the "
            f"same noise and timesteps (seed with replica_generator or use broadcast_from_group_leader)"
        )


def mean_over_data_parallel(value: torch.Tensor, mesh: USPMesh) -> torch.Tensor:
    """A copy of ``value`` (e.g. a loss, identical within a replica) averaged over the dp ranks, for logging."""
    out = value.detach().clone().to(comm_device(mesh, value)).contiguous()
    group = data_parallel_group(mesh)
    if group is not None:
        dist.all_reduce(out, group=group)
        out /= mesh.dp_degree
    return out
