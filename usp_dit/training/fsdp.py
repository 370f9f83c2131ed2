"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over the ranks of a USP mesh.

Layout: parameters become DTensors sharded on dim 0 over the FSDP mesh; activations are untouched
(the sequence split is USP's, inside the model).

Note [FSDP2 over a USP mesh]
    FSDP2 reduce-scatters each gradient and divides it by the number of ranks it reduces over:
    the mean. By Note [mean over the replica is the one-process gradient] (``reduce``), the mean
    over the cfg x ring x ulysses ranks of a replica is the one-process gradient and the mean over
    the whole world is the data-parallel mean of those. So FSDP2 needs no extra scaling, over
    either mesh:
      * "full":   one axis, every rank of the world (shards are 1/world of each parameter);
      * "hybrid": 2-D (dp, replica): parameters sharded inside a replica and replicated across dp
                  (HSDP); gradients reduce-scattered over the replica, then all-reduced over dp.
    Both reuse the mesh's process groups ("full" the default group, "hybrid" the mesh's
    ("dp", "seq") view), so no group is created. On CPU, gloo runs FSDP2 (tested on torch 2.13).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from usp_dit.distributed.groups import register_device_mesh
from usp_dit.distributed.mesh import USPMesh

_KINDS = ("full", "hybrid")


def fsdp_device_mesh(mesh: USPMesh, kind: str = "full") -> DeviceMesh:
    """The DeviceMesh to give ``fully_shard`` for ``mesh`` (Note [FSDP2 over a USP mesh]).

    Raises:
        ValueError: ``kind`` is not "full" or "hybrid"; no process group (a single-rank mesh);
            the mesh does not span the world; "hybrid" with cfg_degree > 1.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if mesh.device_mesh is None or not dist.is_initialized():
        raise ValueError("FSDP2 needs a process group: build the mesh with usp_dit.init_usp under torchrun")
    if mesh.device_mesh.size() != dist.get_world_size():
        raise ValueError(f"mesh has {mesh.device_mesh.size()} ranks but the world has {dist.get_world_size()}")
    if kind == "full":
        # Registered (both kinds): DTensor's caches keep these meshes, and so their groups, until exit.
        return register_device_mesh(DeviceMesh.from_group(dist.group.WORLD, mesh.device_type, mesh_dim_names=("fsdp",)))
    if mesh.cfg_degree != 1:
        raise ValueError(f"kind='hybrid' needs cfg_degree=1 (training has no cfg batch split), got {mesh.cfg_degree}")
    return register_device_mesh(mesh.seq_mesh["dp", "seq"])


def block_lists(transformer: torch.nn.Module) -> tuple[str, ...]:
    """The names of ``transformer``'s lists of blocks, FSDP2's units: its model plan's
    (``usp_dit.pipelines.plan.ModelPlan.block_lists``, e.g. Wan's ``blocks``, HunyuanVideo's dual-
    and single-stream lists), or for a model without a plan every ``ModuleList`` child whose name
    ends in "blocks" (Flux's ``transformer_blocks`` and ``single_transformer_blocks``)."""
    try:
        from usp_dit.pipelines import find_adapter  # the Diffusers integration: loaded on use

        plan = getattr(find_adapter(transformer), "plan", None)
    except (ImportError, NotImplementedError):
        plan = None
    if plan is not None:
        return plan.block_lists
    return tuple(name for name, child in transformer.named_children()
                 if isinstance(child, torch.nn.ModuleList) and name.endswith("blocks"))


def shard_transformer(transformer: torch.nn.Module, mesh: USPMesh, kind: str = "full", **fsdp_kwargs: Any) -> torch.nn.Module:
    """``fully_shard`` every transformer block, then the whole transformer, over ``fsdp_device_mesh``.

    One FSDP unit per block: a block's parameters are gathered just before it runs and freed after
    (also around a gradient-checkpointing recompute). ``fsdp_kwargs`` go to ``fully_shard``
    (e.g. ``mp_policy``, ``reshard_after_forward``). Works before or after ``enable_usp``.
    Returns ``transformer`` (its class becomes FSDP's subclass of it, in place).

    Raises:
        ValueError: see ``fsdp_device_mesh``.
    """
    device_mesh = fsdp_device_mesh(mesh, kind)
    for name in block_lists(transformer):
        for block in getattr(transformer, name):
            fully_shard(block, mesh=device_mesh, **fsdp_kwargs)
    fully_shard(transformer, mesh=device_mesh, **fsdp_kwargs)
    return transformer


def full_grads(transformer: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``{name: full gradient}`` of every parameter, DTensor gradients gathered (collective: call on every rank)."""
    out = {}
    for name, p in transformer.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if g is not None and hasattr(g, "full_tensor") else g
    return out
