"""Sharded weights for inference: FSDP2 over the ranks of one model replica, undone exactly.

Layout: a sharded parameter is a DTensor ``Shard(0)`` over the replica's ranks (cfg x ring x
ulysses, in mesh order); activations are untouched (the token split is USP's, inside the model).
With tensor parallelism (Note [sharded tensor-parallel weights]) a cut parameter is a DTensor on
the 2-D mesh (sequence ranks, tensor): its tensor rank's local tensor (padded, rank-major:
``usp_dit.pipelines.tensor``) ``Shard(0)`` over the sequence ranks; an uncut one ``Shard(0)`` over
the whole replica (cfg x ring x ulysses x tensor).

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

Note [sharded tensor-parallel weights]
    With ``tensor_degree = T > 1`` the cut Linears of each block are DTensors on the tensor
    group's mesh (``usp_dit.pipelines.tensor``), and FSDP2 composes with them the way PyTorch's
    2-D parallelism does: a unit holding cut weights is sharded over the replica's *sequence*
    ranks (cfg x ring x ulysses, P of them), a DeviceMesh sliced (and flattened) from the grid's
    own DeviceMesh, so that FSDP2 can join it to the tensor mesh (``DeviceMesh._concatenate``
    needs one root). FSDP2 then shards each tensor rank's *local* tensor along dim 0 and its
    all-gather rebuilds exactly that local tensor (the padded, rank-major layout of Note [uneven
    tensor splits] included: FSDP2 moves bytes, it never reads the layout), so the block computes
    with the very DTensors tensor parallelism made and the output equals the unsharded tensor-
    parallel grid's bit for bit. A cut weight: ~1/(T x P) a rank.
    A block also holds weights tensor parallelism leaves whole on every tensor rank (Flux's and
    Qwen-Image's modulation Linears: a third of a Flux block). Sharded with the block they would
    keep 1/P, so each child of a block holding parameters, none of them cut, is a unit of its own
    over the *whole* replica (cfg x ring x ulysses x tensor: 1/(T x P)); so are the outer
    modules and the transformer's own parameters, which tensor parallelism leaves whole too. What
    stays whole inside a child that also holds cut weights (the per-head Q/K norms: a head_dim
    vector each) is sharded with its block over the sequence ranks.
    These subunits are prefetched with their block (``_RunOrder``, P > 1). With no sequence ranks (the
    replica is the tensor group alone, P = 1) the cut weights are left as tensor parallelism made
    them (FSDP2's ``ignored_params``) and the uncut ones are still sharded over the tensor ranks.
    ``unshard_weights`` gives a cut parameter back as the tensor-parallel DTensor it was (its
    shards all-gathered over the sequence ranks, FSDP2's padding dropped), so
    ``remove_tensor_parallel`` then restores the original tensor bit for bit: FSDP first, then TP.
    Inference only: a call recording gradients is refused (``_inference_only``), since the tensor
    plan's gradient hooks that sum the per-head norms' gradients over the tensor group (Note
    [per-head weights under tensor parallelism]) are on the parameters FSDP2 replaces.

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
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.groups import register_device_mesh
from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import replica_group


@dataclass
class ShardedWeights:
    """What ``shard_weights`` did to one transformer: its units, root last (their order of sharding)."""

    units: list[torch.nn.Module] = field(default_factory=list)
    classes: dict[int, type] = field(default_factory=dict)  # id(unit) -> its class before fully_shard
    run_order: _RunOrder | None = None  # records the blocks' order on the first calls
    guard: RemovableHandle | None = None  # tensor parallelism: refuses a call that could train (_inference_only)


class _RunOrder:
    """Note [sharded weights]: the order the blocks run in, recorded by forward pre-hooks until a
    call runs every block, and every unit inside a block (its subunits: Notes [one dtype a unit],
    [sharded tensor-parallel weights]), exactly once; then each block prefetches the block that
    ran after it with that block's subunits, in the order they ran.

    Every rank of the replica runs the same blocks in the same order, so every rank switches its
    prefetch (whose all-gathers are collectives) after the same call.
    """

    def __init__(self, transformer: torch.nn.Module, blocks: list[torch.nn.Module],
                 subunits: dict[int, list[torch.nn.Module]]) -> None:
        self.transformer, self.blocks, self.subunits, self.seen = transformer, blocks, subunits, []
        watched = [*blocks, *(u for units in subunits.values() for u in units)]
        self.handles = [u.register_forward_pre_hook(self._ran) for u in watched]
        self.handles.append(transformer.register_forward_hook(self._call_ended))

    def _ran(self, unit: torch.nn.Module, args) -> None:
        self.seen.append(unit)

    def _call_ended(self, module, args, output) -> None:
        seen, self.seen = self.seen, []
        expected = len(self.blocks) + sum(map(len, self.subunits.values()))
        if len(seen) != expected or len({id(u) for u in seen}) != len(seen):
            return  # a block skipped (a step cache) or run twice: no prefetch yet, look again
        order = [u for u in seen if any(u is b for b in self.blocks)]  # each watched unit ran once
        inner = {id(b): [u for u in seen if any(u is s for s in self.subunits.get(id(b), []))] for b in order}
        for current, following in zip([self.transformer, *order], order):
            current.set_modules_to_forward_prefetch([following, *inner[id(following)]])
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


def sequence_device_mesh(mesh: USPMesh) -> DeviceMesh | None:
    """Note [sharded tensor-parallel weights]: a 1-D DeviceMesh over this rank's sequence ranks of
    its replica (cfg x ring x ulysses, the same tensor rank), sliced from the grid's DeviceMesh (a
    root FSDP2 can join to the tensor mesh); ``None`` when there are none (P = 1)."""
    axes = tuple(a for a, d in (("cfg", mesh.cfg_degree), ("ring", mesh.ring_degree), ("ulysses", mesh.ulysses_degree))
                 if d > 1)
    if not axes:
        return None
    if len(axes) == 1:
        return mesh.device_mesh[axes[0]]
    # flattened once per grid: the root mesh keeps it (Note [one mesh per grid]), its groups included
    return register_device_mesh(mesh.device_mesh[axes]._flatten("_".join(axes)))


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
    replica; prefetch the next block. With tensor parallelism, Note [sharded tensor-parallel
    weights]: a block's cut weights over the sequence ranks, the rest over the whole replica.

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
    cut = mesh.tensor_degree > 1
    whole = [u for b in blocks for u in uncut_children(b)] if cut else []
    shard_units(record, [*whole, *blocks, *outer_modules(transformer, block_lists), transformer], device_mesh,
                cut_mesh=sequence_device_mesh(mesh) if cut else None)
    if cut:
        record.guard = transformer.register_forward_pre_hook(_inference_only, prepend=True)  # before FSDP2's
    if blocks and isinstance(blocks[0], FSDPModule):  # no prefetch until a call has shown the run order
        units = {id(u) for u in record.units}
        subunits = {id(b): [u for u in b.modules() if u is not b and id(u) in units] for b in blocks}
        record.run_order = _RunOrder(transformer, blocks, subunits)
    return record


def _inference_only(transformer: torch.nn.Module, args) -> None:
    """Note [sharded tensor-parallel weights]: a call that records gradients is refused (on every
    rank: each takes the same call), before FSDP2 gathers anything."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in transformer.parameters()):
        raise NotImplementedError(
            f"{type(transformer).__name__} with shard_weights=True and tensor_degree > 1 runs inference only: the "
            "per-head norms' gradients are summed over the tensor group by hooks on the parameters FSDP2 replaces, "
            "so a backward would be wrong; call it under torch.no_grad() (Diffusers pipelines do), or use "
            "shard_weights=False to train"
        )


def uncut_children(block: torch.nn.Module) -> list[torch.nn.Module]:
    """Note [sharded tensor-parallel weights]: the children of ``block`` (a container's members)
    holding parameters, none of them cut by tensor parallelism (a DTensor): units of their own
    over the whole replica."""
    return [unit for child in block.children() if _has_parameters(child) for unit in _runnable(child)
            if not any(isinstance(p, DTensor) for p in unit.parameters())]


def shard_units(record: ShardedWeights, units: list[torch.nn.Module], device_mesh: DeviceMesh,
                cut_mesh: DeviceMesh | None = None) -> None:
    """``fully_shard`` each of ``units`` (children before parents), its dtype subunits first, over
    ``device_mesh``; every check is made before the first unit is sharded.

    ``cut_mesh``: under tensor parallelism (Note [sharded tensor-parallel weights]) a unit holding
    cut weights (DTensors) is sharded over it instead, the sequence ranks; with none (P = 1) such a
    unit is not sharded and its cut weights are left out of every unit (``ignored_params``).
    """
    plan: list[torch.nn.Module] = []
    planned: set[int] = set()
    for i, unit in enumerate(units):
        plan.extend(dtype_subunits(unit, f"unit {i} ({type(unit).__name__})", planned))
        plan.append(unit)
        planned.add(id(unit))
    cut = {id(p) for unit in units for p in unit.parameters() if isinstance(p, DTensor)}
    # decided before anything is sharded (a sharded unit's parameters are DTensors too)
    targets = [cut_mesh if any(id(p) in cut for p in _own_parameters(unit, planned)) else device_mesh for unit in plan]
    for unit, target in zip(plan, targets):
        if target is None:
            continue  # cut weights and no sequence ranks: tensor parallelism already split them
        record.classes[id(unit)] = type(unit)
        # a unit over the whole replica holds no cut weight: those left in no sharded unit (P = 1) stay out
        ignored = {p for p in unit.parameters() if id(p) in cut} if target is device_mesh else set()
        fully_shard(unit, mesh=target, reshard_after_forward=True, ignored_params=ignored or None)
        record.units.append(unit)


def _full_local_parameters(module: torch.nn.Module, record: ShardedWeights) -> None:
    """Replace every parameter FSDP2 sharded in ``module``'s tree by the tensor ``fully_shard`` was
    given: a full tensor, or under tensor parallelism the cut DTensor (``_cut_parameter``). A
    collective: every rank walks the same modules in the same order. A parameter shared by several
    modules (tied embeddings, e.g. T5's ``shared`` and ``encoder.embed_tokens``) stays one
    parameter; a cut parameter FSDP2 left alone (``ignored_params``) stays as it is."""
    cut = {id(fp.sharded_param): fp for unit in record.units for group in unit._get_fsdp_state()._fsdp_param_groups
           for fp in group.fsdp_params if fp._unsharded_dtensor_spec is not None}
    full: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if not isinstance(param, DTensor) or _left_cut(param, cut):
                continue
            if id(param) not in full:
                data = _cut_parameter(cut[id(param)]) if id(param) in cut else param.full_tensor().detach()
                full[id(param)] = torch.nn.Parameter(data, requires_grad=param.requires_grad)
            sub._parameters[name] = full[id(param)]


def _left_cut(param: DTensor, cut: dict) -> bool:
    """A tensor-parallel DTensor FSDP2 did not shard (P = 1: on the tensor group's mesh, not FSDP2's)."""
    return id(param) not in cut and param.device_mesh.mesh_dim_names == ("tensor",)


def _cut_parameter(fsdp_param) -> DTensor:
    """Note [sharded tensor-parallel weights]: the tensor-parallel DTensor ``fully_shard`` was given:
    this tensor rank's local tensor, its dim-0 shards all-gathered over the sequence ranks (FSDP2's
    padded shards, in rank order, the padding dropped), on the tensor mesh with its placements."""
    spec = fsdp_param._unsharded_dtensor_spec
    shard = fsdp_param._sharded_param_data  # flat, padded to the same length on every rank
    group = fsdp_param.mesh_info.shard_process_group
    gathered = shard.new_empty(shard.numel() * group.size())
    torch.distributed.all_gather_into_tensor(gathered, shard, group=group)
    rows, *rest = fsdp_param.padded_sharded_param_size
    local = gathered.view(group.size() * rows, *rest)[: fsdp_param._orig_size[0]].clone()
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


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
    if record.guard is not None:
        record.guard.remove()
        record.guard = None
    for unit in record.units:
        unit.reshard()  # a known state: every parameter its sharded DTensor
    _full_local_parameters(transformer, record)
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
        if isinstance(tensor, DTensor):  # a gathered cut parameter (Note [sharded tensor-parallel weights])
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def is_sharded(module: torch.nn.Module) -> bool:
    """True while ``shard_weights`` holds ``module`` (FSDP2's class is on it)."""
    return isinstance(module, FSDPModule)


__all__ = ["ShardedWeights", "blocks_in_order", "is_sharded", "outer_modules", "replica_device_mesh", "resident_parameter_bytes",
           "shard_weights", "unshard_weights"]
