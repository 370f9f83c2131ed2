"""Communication within one model replica: its groups, a broadcast from its first rank, a checksum.

Layout: any tensor, any shape and dtype; what is communicated is the tensor as a whole.

Used by the Diffusers integration (``usp_dit.pipelines``: the transformer's inputs made the same
on every rank of a replica) and by fine-tuning (``usp_dit.training``: shared noise, consistency
checks, gradient reductions).

Note [who is a replica, who is data parallel]
    world = dp x cfg x ring x ulysses [x tensor] (``usp_dit.init_usp``). The cfg x ring x ulysses
    (x tensor) ranks of one dp index run **one model replica** on one sample: they shard its tokens (and with
    cfg > 1 its batch) and every one of them computes the same result on the gathered output. The
    dp ranks run different samples.

        dp 0: [replica: cfg x seq ranks]   dp 1: [replica: cfg x seq ranks]   ...
                 same sample, same noise              another sample, other noise

    A replica is two groups, the cfg group then the sequence group (``replica_groups``; a third,
    the tensor group, with tensor parallelism): a collective over each in turn spans the replica.
    A broadcast from group rank 0 of each takes rank (c, s) to (0, s), then to (0, 0): the
    replica's first rank (with t: (c, s, t) -> (0, s, t) -> (0, 0, t) -> (0, 0, 0)).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from usp_dit.distributed import traffic
from usp_dit.distributed.groups import on_release
from usp_dit.distributed.mesh import USPMesh, default_timeout


def replica_groups(mesh: USPMesh) -> list[dist.ProcessGroup]:
    """The cfg group, the sequence group, then the tensor group: collectives over all span one
    model replica.

    Axes of size 1 have no group; a replica of one rank gives ``[]``.
    """
    return [g for g in (mesh.cfg_group, mesh.seq_group, mesh.tensor_group) if g is not None]


# One group over all ranks of a replica, per layout of the world into replicas (built on first use,
# by every rank at once: ``dist.new_group`` is collective over the default group).
_REPLICA_GROUPS: dict[tuple, dist.ProcessGroup] = {}


@on_release
def _forget_replica_groups() -> None:
    _REPLICA_GROUPS.clear()


def replica_group(mesh: USPMesh) -> dist.ProcessGroup | None:
    """One process group over the cfg x ring x ulysses (x tensor) ranks of this rank's replica, in
    mesh order (the one axis's own group when only one axis is above 1); ``None`` for a
    replica of one rank. For work that splits over every rank of a replica at once (the VAE).

    The first call for a layout builds one group per replica and must be made by every rank of the
    world (as ``enable_usp`` / ``enable_parallel_vae`` are).
    """
    axes = replica_groups(mesh)  # the groups of the axes above 1
    if len(axes) <= 1:
        return axes[0] if axes else None
    per_replica = mesh.device_mesh.mesh.reshape(mesh.dp_degree, -1).tolist()
    key = (id(dist.distributed_c10d._get_default_group()), tuple(map(tuple, per_replica)))
    if key not in _REPLICA_GROUPS or _REPLICA_GROUPS[key] not in dist.distributed_c10d._world.pg_map:
        mine, timeout = None, default_timeout(mesh.device_type)  # (new groups otherwise wait 30 min)
        for ranks in per_replica:  # every rank builds every replica's group, in the same order
            group = dist.new_group(ranks, timeout=timeout)
            if dist.get_rank() in ranks:
                mine = group
        _REPLICA_GROUPS[key] = mine
    return _REPLICA_GROUPS[key]


def comm_device(mesh: USPMesh, like: torch.Tensor | None = None) -> torch.device:
    """Where a buffer for a collective over ``mesh``'s groups lives: under NCCL ``like``'s GPU when
    it is on one, else the current CUDA device; under gloo the CPU."""
    if mesh.device_type == "cuda":
        return like.device if like is not None and like.is_cuda else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_first_rank(t: torch.Tensor, mesh: USPMesh) -> torch.Tensor:
    """A copy (no autograd) of the replica's first rank's ``t``, on ``t``'s device and dtype.

    ``t`` must have the same shape and dtype on every rank of the replica (the broadcast sizes
    its buffer from it). Bool goes as uint8: not every backend broadcasts bool.
    """
    buf = t.detach().to(comm_device(mesh, t), copy=True).contiguous()
    as_bool = buf.dtype == torch.bool
    if as_bool:
        buf = buf.to(torch.uint8)
    for group in replica_groups(mesh):  # cfg, then sequence: Note [who is a replica, who is data parallel]
        if traffic.counting():  # the source sends to every other rank (Note [counting traffic])
            n = traffic.nbytes(buf)
            sent, received = ((group.size() - 1) * n, 0) if group.rank() == 0 else (0, n)
            traffic.record("broadcast", sent, received)
        if torch.compiler.is_compiling():  # an in-place collective cannot be traced; the functional one can
            buf = funcol.wait_tensor(funcol.broadcast(buf, 0, group))  # the source is a group rank
        else:
            dist.broadcast(buf, group=group, group_src=0)
    if as_bool:
        buf = buf.bool()
    return buf.to(t.device)


def same_on_replica(t: torch.Tensor, mesh: USPMesh) -> bool:
    """True when ``t`` is the same on every rank of the replica (one all-reduce of four numbers).

    Compares a float64 checksum: the sum and the position-weighted sum (a permutation of the same
    values changes the second). Every rank of the replica gets the same answer, so all of them
    raise, or none, when a caller raises on ``False``.
    """
    groups = replica_groups(mesh)
    if not groups:
        return True
    flat = t.detach().to(torch.float64).reshape(-1)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    sums = torch.stack([flat.sum(), (flat * weights).sum()])
    both = torch.cat([sums, -sums]).to(comm_device(mesh, t))
    for group in groups:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return torch.equal(both[:2], -both[2:])  # max(x) == -max(-x) = min(x) on every rank iff all equal


def all_true_on_replica(ok: bool, mesh: USPMesh) -> bool:
    """True only if ``ok`` on every rank of the replica (one tiny all-reduce; no-op on one rank)."""
    groups = replica_groups(mesh)
    if not groups:
        return ok
    flag = torch.tensor([1.0 if ok else 0.0], device=comm_device(mesh))
    for group in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
