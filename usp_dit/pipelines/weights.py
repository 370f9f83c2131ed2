"""Sharded weights for inference: FSDP2 over the ranks of one model replica, undone exactly.

Layout: a sharded parameter is a DTensor ``Shard(0)`` over the replica's ranks (cfg x ring x
ulysses, in mesh order); activations are untouched (the token split is USP's, inside the model).

Note [sharded weights]
    Sequence parallelism splits activations; every rank still holds every weight. With
    ``enable_usp(..., shard_weights=True)`` each block of the family's plan (``block_lists``),
    each child of the transformer outside those lists that holds parameters (embedders, final
    norm and projection; the members of a ModuleList or ModuleDict, which has no forward of its
    own to hook), and the transformer itself (its own few direct parameters, e.g. Wan's
    ``scale_shift_table``) become ``fully_shard`` units over the ranks of the model replica, so
    that between blocks a rank holds its shards, the block running, the next one, and those
    direct parameters:
      * a rank keeps 1/P of each unit (P = cfg x ring x ulysses); a unit's parameters are
        all-gathered just before it runs and freed after (``reshard_after_forward=True``, the root
        included: between two calls a rank holds only its shards);
      * while block i runs, the all-gather of the block that runs next is already issued
        (``set_modules_to_forward_prefetch``), so on a GPU it overlaps block i's compute; the
        transformer prefetches the first block likewise. "Next" is the order blocks run in, which
        is not always the order of the plan's lists: Wan Animate runs a face-adapter block after
        every few transformer blocks. The first call gathers each block when it starts (no
        prefetch) and records the order the blocks run in; from the second call each block
        prefetches the one that ran after it (``_RunOrder``). A block prefetched out of order
        would be gathered after it ran and stay gathered between calls;
      * every rank of the replica runs every block in the same order, as the sequence split
        already requires (the cfg groups too: Note [two calls a step] makes every rank take the
        same decisions, and a step cache's skip is agreed over the replica), so the all-gathers
        pair up. Data-parallel replicas shard apart.
    The maths is unchanged: a block computes with its full weights, bit for bit the tensors it
    was given, so the output equals the unsharded grid's (exact in float32; tests/
    test_shard_weights.py).

    ``unshard_weights`` (run by ``disable_usp``) gives every parameter back as a full local
    tensor (an all-gather per parameter, in module order on every rank) and removes FSDP2's
    hooks, state and generated class, so the transformer is the module it was (and can be
    sharded again). FSDP2 has no public "undo": the state it keeps (``contract``'s per-module
    dicts, ``_module_state_mapping``) is removed here by name; tests check that nothing of it is
    left.

Note [one dtype a unit]
    FSDP2 all-gathers a unit's parameters in one buffer, so they must share a dtype. Models keep
    some modules in float32 beside bfloat16 weights (Diffusers' ``_keep_in_fp32_modules``: Wan's
    norms and ``scale_shift_table``, T5's ``wo``). ``dtype_subunits`` makes each child subtree of
    another dtype a unit of its own (sharded first, gathered when it runs), so a block of mixed
    dtypes still shards, exactly. Only a module whose own direct parameters mix dtypes is refused.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from usp_dit.distributed.groups import register_device_mesh
from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import replica_group


@dataclass
class ShardedWeights:
    """What ``shard_weights`` did to one transformer: its units, root last (their order of sharding)."""

    units: list[torch.nn.Module] = field(default_factory=list)
    classes: dict[int, type] = field(default_factory=dict)  # id(unit) -> its class before fully_shard
    run_order: _RunOrder | None = None  # records the blocks' order on the first calls


class _RunOrder:
    """Note [sharded weights]: the order the blocks run in, recorded by forward pre-hooks until a
    call runs every block exactly once; then each block prefetches the one that ran after it.

    Every rank of the replica runs the same blocks in the same order, so every rank switches its
    prefetch (whose all-gathers are collectives) after the same call.
    """

    def __init__(self, transformer: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
        self.transformer, self.blocks, self.seen = transformer, blocks, []
        self.handles = [b.register_forward_pre_hook(self._ran) for b in blocks]
        self.handles.append(transformer.register_forward_hook(self._call_ended))

    def _ran(self, block: torch.nn.Module, args) -> None:
        self.seen.append(block)

    def _call_ended(self, module, args, output) -> None:
        order, self.seen = self.seen, []
        if len(order) != len(self.blocks) or len({id(b) for b in order}) != len(order):
            return  # a block skipped (a step cache) or run twice: no prefetch yet, look again
        for current, following in zip([self.transformer, *order], order):
            current.set_modules_to_forward_prefetch([following])
        order[-1].set_modules_to_forward_prefetch([])
        self.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def replica_device_mesh(mesh: USPMesh) -> DeviceMesh | None:
    """A 1-D DeviceMesh over this rank's model replica (cfg x ring x ulysses); ``None`` for one rank."""
    group = replica_group(mesh)
    if group is None:
        return None
    return register_device_mesh(DeviceMesh.from_group(group, mesh.device_type, mesh_dim_names=("replica",)))


def blocks_in_order(transformer: torch.nn.Module, block_lists: Iterable[str]) -> list[torch.nn.Module]:
    """Every block of ``block_lists``, in the order the lists are named (the order they run)."""
    return [block for name in block_lists for block in getattr(transformer, name)]


def _dtypes(module: torch.nn.Module, units: set[int] | None = None, recurse: bool = True) -> set[torch.dtype]:
    """The dtypes of ``module``'s parameters, not counting those of modules in ``units`` (by id)."""
    if not recurse:
        return {p.dtype for p in module.parameters(recurse=False)}
    out = {p.dtype for p in module.parameters(recurse=False)}
    for child in module.children():
        if units is None or id(child) not in units:
            out |= _dtypes(child, units)
    return out


def _own_parameters(module: torch.nn.Module, units: set[int]) -> list[torch.nn.Parameter]:
    """``module``'s parameters outside the subtrees of ``units`` (by id)."""
    out = list(module.parameters(recurse=False))
    for child in module.children():
        if id(child) not in units:
            out.extend(_own_parameters(child, units))
    return out


def _unit_dtype(unit: torch.nn.Module, name: str, units: set[int]) -> torch.dtype | None:
    """The dtype a unit keeps: its own direct parameters', else the one holding most elements
    (outside the units already planned)."""
    own = _dtypes(unit, recurse=False)
    if len(own) > 1:
        raise ValueError(f"shard_weights=True: {name} holds parameters of dtypes {sorted(map(str, own))} itself; "
                         "FSDP2 gathers a unit in one dtype: cast the model to one dtype")
    if own:
        return next(iter(own))
    sizes: dict[torch.dtype, int] = {}
    for p in _own_parameters(unit, units):
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=sizes.__getitem__) if sizes else None


def dtype_subunits(unit: torch.nn.Module, name: str, units: set[int], keep: torch.dtype | None = None,
                   ) -> list[torch.nn.Module]:
    """Note [one dtype a unit]: the submodules of ``unit`` to shard as units of their own, children
    first, so that what each unit keeps has one dtype (``keep``: the unit's, ``_unit_dtype``).
    Modules in ``units`` (by id: units already planned, with their subtrees) are left to themselves;
    the new subunits are added to it.

    Raises:
        ValueError: a module whose own direct parameters mix dtypes (no split can separate them).
    """
    keep = _unit_dtype(unit, name, units) if keep is None else keep
    subunits: list[torch.nn.Module] = []
    for child_name, child in unit.named_children():
        if id(child) in units:
            continue
        kinds, label = _dtypes(child, units), f"{name}.{child_name}"
        if not kinds or kinds == {keep}:
            continue
        if _is_container(child):  # no forward to hook: its members are the units
            subunits.extend(dtype_subunits(child, label, units, keep))
        elif _dtypes(child, units, recurse=False) - {keep} or len(kinds) == 1:
            subunits.extend(dtype_subunits(child, label, units))  # a unit of its own dtype
            subunits.append(child)
            units.add(id(child))
        else:  # mixed below, nothing of its own to move: split its children against ``keep``
            subunits.extend(dtype_subunits(child, label, units, keep))
    return subunits


def _is_container(module: torch.nn.Module) -> bool:
    """A ModuleList or ModuleDict (no ``forward`` of its own): FSDP2 cannot hook it, so its members
    are the units."""
    return type(module).forward is torch.nn.Module.forward


def _has_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _runnable(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` itself, or for a container its members with parameters (containers unrolled)."""
    if not _is_container(module):
        return [module]
    return [unit for child in module.children() if _has_parameters(child) for unit in _runnable(child)]


def outer_modules(transformer: torch.nn.Module, block_lists: Iterable[str]) -> list[torch.nn.Module]:
    """The transformer's children outside its block lists that hold parameters (embedders, final
    norm and projection; a container's members): units of their own, gathered only while they run."""
    lists = set(block_lists)
    return [unit for name, child in transformer.named_children()
            if name not in lists and _has_parameters(child) for unit in _runnable(child)]


def shard_weights(transformer: torch.nn.Module, mesh: USPMesh, block_lists: Iterable[str]) -> ShardedWeights | None:
    """Note [sharded weights]: shard every block, each outer module, then the rest, over the
    replica; prefetch the next block.

    Returns the record ``unshard_weights`` needs, or ``None`` when the replica is one rank
    (nothing to shard: the model is left untouched).

    Raises:
        ValueError: a module whose own parameters mix dtypes (``dtype_subunits``).
    """
    device_mesh = replica_device_mesh(mesh)
    if device_mesh is None:
        return None
    block_lists = tuple(block_lists)
    blocks = blocks_in_order(transformer, block_lists)
    record = ShardedWeights()
    shard_units(record, [*blocks, *outer_modules(transformer, block_lists), transformer], device_mesh)
    if blocks:  # no prefetch until a call has shown the order the blocks run in (_RunOrder)
        record.run_order = _RunOrder(transformer, blocks)
    return record


def shard_units(record: ShardedWeights, units: list[torch.nn.Module], device_mesh: DeviceMesh) -> None:
    """``fully_shard`` each of ``units`` (children before parents), its dtype subunits first;
    every check is made before the first unit is sharded."""
    plan: list[torch.nn.Module] = []
    planned: set[int] = set()
    for i, unit in enumerate(units):
        plan.extend(dtype_subunits(unit, f"unit {i} ({type(unit).__name__})", planned))
        plan.append(unit)
        planned.add(id(unit))
    for unit in plan:
        record.classes[id(unit)] = type(unit)
        fully_shard(unit, mesh=device_mesh, reshard_after_forward=True)
        record.units.append(unit)


def _full_local_parameters(module: torch.nn.Module) -> None:
    """Replace every DTensor parameter of ``module``'s tree by its full tensor (a collective: every
    rank walks the same modules in the same order). A parameter shared by several modules (tied
    embeddings, e.g. T5's ``shared`` and ``encoder.embed_tokens``) stays one parameter."""
    full: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in full:
                    full[id(param)] = torch.nn.Parameter(param.full_tensor().detach(), requires_grad=param.requires_grad)
                sub._parameters[name] = full[id(param)]


def _forget_fsdp(unit: torch.nn.Module, cls: type) -> None:
    """Remove FSDP2's hooks, per-module state and generated class from one unit."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping

    state = unit._get_fsdp_state()
    for handle in {id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)}.values():
        handle.remove()
    # The param group and each FSDPParam register state-dict hooks on modules (save, load, post-load)
    # whose closures hold the group and the sharded parameters: left in place, every shard/unshard
    # cycle would keep that cycle's shards alive (found on the H100: a 22 GiB model out of memory
    # after two cycles). Their handles are removed with the forward hooks.
    for group in state._fsdp_param_groups:
        handles = [*group._module_to_pre_save_state_dict_hook_handle.values(),
                   *group._module_to_pre_load_state_dict_hook_handle.values()]
        handles += [getattr(p, "_post_load_hook_handle", None) for p in group.fsdp_params]
        for handle in handles:
            if handle is not None:
                handle.remove()
    states = unit.__dict__.get(STATE_KEY, {})
    for key in [k for k, v in states.items() if v is state]:
        del states[key]
    unit.__dict__.get(REGISTRY_KEY, {}).pop("fully_shard", None)
    _module_state_mapping.pop(unit, None)
    unit.__class__ = cls


def unshard_weights(transformer: torch.nn.Module, record: ShardedWeights) -> None:
    """Undo ``shard_weights``: full local parameters, no FSDP2 hook, state or class left."""
    if record.run_order is not None:
        record.run_order.remove()
    for unit in record.units:
        unit.reshard()  # a known state: every parameter its sharded DTensor
    _full_local_parameters(transformer)
    for unit in reversed(record.units):
        _forget_fsdp(unit, record.classes[id(unit)])
    for sub in transformer.modules():  # markers fully_shard leaves for Dynamo
        for attr in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            sub.__dict__.pop(attr, None)
    record.units.clear()


def _fsdp_tensors(unit: torch.nn.Module) -> Iterable[torch.Tensor]:
    """Every tensor FSDP2 keeps for ``unit``'s parameters: shards, gathered parameters, all-gather
    buffers (a prefetched unit's, not yet swapped in). Freed ones have storages of 0 bytes (FSDP2
    frees by resizing). FSDP2 internals, read for this count only."""
    for group in unit._get_fsdp_state()._fsdp_param_groups:
        pending = getattr(group, "_all_gather_result", None)
        if pending is not None:
            yield pending.all_gather_output
        for fsdp_param in group.fsdp_params:
            yield fsdp_param._sharded_param_data
            yield from fsdp_param.all_gather_outputs
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                yield unsharded


def resident_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds for ``module``'s tree now, each storage once:
    plain parameters, and for sharded units their shards plus whatever is gathered or being
    gathered (Note [sharded weights]; a diagnostic, for tests and the planner's checks)."""
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            tensors.extend(_fsdp_tensors(sub))
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def is_sharded(module: torch.nn.Module) -> bool:
    """True while ``shard_weights`` holds ``module`` (FSDP2's class is on it)."""
    return isinstance(module, FSDPModule)


__all__ = ["ShardedWeights", "blocks_in_order", "is_sharded", "outer_modules", "replica_device_mesh", "resident_parameter_bytes",
           "shard_weights", "unshard_weights"]
