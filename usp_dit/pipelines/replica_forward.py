"""The replica wrapper: around an adapter's forward, the call agreed on, inputs synced, the batch split over "cfg".

Layout: the transformer's own arguments; the batch dimension is dim 0 of every batched argument.

    transformer(args) ─► agree ─► sync inputs ─► cfg split ─► adapter forward (sequence parallel) ─► cfg gather
                         (Note    (broadcast     (batch half   on the C groups of U*R ranks           (all-gather
                          [model   from the       of this                                               over "cfg")
                          hand-    group's        rank's cfg
                          shake])  first rank)    group)

``enable_usp`` (``usp_dit.pipelines.api``) installs ``ReplicaForward`` as the transformer's
``forward`` when the model degree C * U * R is > 1, and ``SyncedLatents`` as a pipeline's
``prepare_latents``. The collectives within one replica are ``usp_dit.distributed.replica``'s.

Note [model handshake]
    The input broadcast below sizes its buffers from each rank's own tensors: ranks that pass
    tensors of different shapes make gloo abort ("Received data size doesn't match") or NCCL hang,
    and bfloat16 on one rank against float16 on another (the same bytes) silently reinterprets
    them. So before anything else the wrapper agrees with the replica's other ranks on what the
    call is (``usp_dit.distributed.handshake.agree``: one fixed-size all-gather per replica group):

        every argument      tensors: shape, dtype, requires_grad; lists/tuples and dicts
                            (joint_attention_kwargs): length or keys, then each item alike;
                            None/bool/int/float/str: the value; anything else: its type name
        the mode            grad enabled, autocast on the model's device type (on, dtype),
                            the model's parameter dtypes (the first parameter of each top-level
                            submodule: all 1160 of Flux-dev cost 8 ms a call), its training flag
        the layout          degrees (cfg, ring, ulysses), ring schedule, backend, model class

    Nothing in it may legitimately differ per rank (a tensor's device index does and is left
    out; its values are what the broadcast makes equal). A disagreement raises the same
    ``ValueError`` on every rank, naming each differing field and each rank's value, and every
    rank leaves the call together, so the group stays usable. With cfg parallel the replica is two
    groups (cfg, then sequence): a failure in the first is a field of the second, so that a rank
    whose own groups agree still raises with the others (no rank goes on into a collective alone).

    Then the inner forward runs inside ``verified_calls(mesh)``: its attention calls, whose
    metadata follows from what was agreed, skip their per-call handshake (Note [verified calls]
    in ``usp_dit.distributed.handshake``). Only with ``sync_inputs``: without the broadcast, values (Mochi's
    prompt mask, which sets the joint length) are the caller's promise, and the per-call check
    stays. The wrapper exists only at model degree > 1: at one rank nothing is agreed or paid.

Note [same inputs everywhere]
    Every rank of a model replica (its cfg x ring x ulysses ranks) must feed the transformer the
    same tensors: the shards of one sequence are only consistent if they are cut from one latent.
    Initial noise drawn without a seeded generator, or a scheduler that adds fresh noise per step,
    would differ per rank. So the wrapper broadcasts every tensor argument from the replica's
    first rank (over the cfg group, then over the sequence group) at each call; for Flux at 1024^2
    that is about 5 MB per step, small beside the attention traffic. Tensors that require grad
    (fine-tuning) cannot be replaced by a broadcast copy without cutting their graph: they are
    checked instead (a two-number checksum, one all-reduce) and a mismatch raises ValueError.
    On a pipeline, ``prepare_latents`` is wrapped the same way, so that the latents the scheduler
    steps (and the VAE decodes) are also the first rank's on every rank: every rank ends with the
    same image, seeded generator or not. (Fresh noise a stochastic scheduler draws per step from
    an unseeded generator still differs per rank; the transformer input broadcast keeps the
    model's result consistent, and rank 0's latents are the ones a single process would have.)

Note [cfg parallel]
    With cfg_degree=2 the transformer's batch (the pipeline's [uncond, cond] halves, or any batch
    of even size) is split on dim 0 over the "cfg" axis: cfg rank c runs rows
    [c*B/2, (c+1)*B/2) on its U*R ranks, and the outputs are all-gathered over the cfg group, so
    every rank returns the full batch before the pipeline combines guidance. Which arguments are
    batched: the adapter's ``cfg_batch_args`` names when it has them (their tensors, or lists of
    tensors or dicts of them (a mask in ``joint_attention_kwargs``), with dim 0 == B are split; size-1 or 0-dim ones broadcast and stay whole); otherwise
    every top-level tensor argument whose dim 0 equals the batch of the first tensor argument.
    Its ``cfg_list_args`` are Python lists with one entry per row (Z-Image's latents and prompt
    embeddings, each prompt its own length): split by index; a first output that is such a list
    (of equal-shaped tensors) is gathered back into one.
    An argument batched on another dim is named in the adapter's ``cfg_batch_dims`` (HiDream's
    stacked Llama states, (layers, B, L, C)).
    A family whose pipelines call the transformer once per guidance branch (``cfg_branch_args``)
    runs a step's two calls on the two cfg groups at once instead, falling back to this split
    (Note [two calls a step] in ``usp_dit.pipelines.cfg_pair``).
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from usp_dit.distributed.comm import all_gather_uneven
from usp_dit.distributed.handshake import agree, verified_calls
from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import broadcast_from_first_rank, comm_device, replica_groups, same_on_replica
from usp_dit.pipelines.base import MethodWrapper

if TYPE_CHECKING:
    from usp_dit.pipelines.state import USPState


# ---------------------------------------------------------------------------------------------
# Note [same inputs everywhere]


def _check_same(t: torch.Tensor, name: str, mesh: USPMesh) -> None:
    """ValueError when ``t`` differs between ranks of the replica (``usp_dit.distributed.replica.same_on_replica``)."""
    if not same_on_replica(t, mesh):
        raise ValueError(
            f"argument {name!r} (requires grad) differs between ranks of one model replica; "
            f"every rank must pass the same tensor (seed the generator or broadcast it)"
        )


def sync_value(value: Any, name: str, mesh: USPMesh) -> Any:
    """Note [same inputs everywhere] for one value: a tensor (or a list/tuple of them) becomes the
    replica's first rank's; one that requires grad is checked equal instead (``name`` for the error);
    anything else is returned as is. Collective: every rank of the replica calls it."""
    if torch.is_tensor(value):
        if value.requires_grad:
            if not torch.compiler.is_compiling():  # a data-dependent check: Note [compiled calls]
                _check_same(value, name, mesh)
            return value
        return broadcast_from_first_rank(value, mesh)
    if isinstance(value, (list, tuple)) and any(torch.is_tensor(v) for v in value):
        return type(value)(sync_value(v, name, mesh) for v in value)
    return value


def sync_arguments(arguments: dict[str, Any], mesh: USPMesh) -> None:
    """Note [same inputs everywhere]: make every tensor argument the replica's first rank's, in place."""
    for name, value in arguments.items():
        arguments[name] = sync_value(value, name, mesh)


class SyncedLatents(MethodWrapper):
    """A pipeline's ``prepare_latents`` returning the replica's first rank's latents (an object:
    ``usp_dit.pipelines.base`` Note [deep copies])."""

    def __init__(self, inner, mesh: USPMesh) -> None:
        super().__init__(inner)
        self.mesh = mesh

    def __call__(self, *args, **kwargs):
        return sync_value(self.inner(*args, **kwargs), "latents", self.mesh)


# ---------------------------------------------------------------------------------------------
# Note [cfg parallel]


def batch_size(arguments: dict[str, Any], default: int | None = None) -> int:
    """Dim 0 of the first tensor argument that has one; ``default`` when none does (ValueError if None)."""
    for value in arguments.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return value.shape[0]
    if default is not None:
        return default
    raise ValueError("cfg_degree > 1 needs a tensor argument with a batch dimension; the transformer got none")


def _take_rows(value: Any, batch: int, lo: int, hi: int, name: str, strict: bool, dim: int = 0) -> Any:
    """Rows [lo, hi) on ``dim`` of a batched tensor (or, for a declared argument, of each tensor of a
    list/tuple: a stack of tensors on a leading axis, so each item's batch is on ``dim - 1`` when
    ``dim`` > 0; or of each tensor value of a dict: keyword arguments such as FIBO's
    ``joint_attention_kwargs`` mask, PixArt-Alpha's ``added_cond_kwargs``); broadcastable ones stay."""
    if isinstance(value, dict) and strict:  # only a declared argument: its values split as its own
        return {k: _take_rows(v, batch, lo, hi, f"{name}[{k!r}]", strict, dim) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if not strict:  # undeclared containers (e.g. RoPE tables (seq, dim)) are not batched
            return value
        return type(value)(_take_rows(v, batch, lo, hi, name, strict, max(dim - 1, 0)) for v in value)
    if not torch.is_tensor(value) or value.dim() <= dim:
        return value
    if value.shape[dim] == batch:
        return value.narrow(dim, lo, hi - lo)
    if strict and value.shape[dim] != 1:
        raise ValueError(f"argument {name!r} has {value.shape[dim]} rows on dim {dim} but the batch is {batch}")
    return value


def split_cfg_batch(
    arguments: dict[str, Any], mesh: USPMesh, batch_args: tuple[str, ...] | None, list_args: tuple[str, ...] = (),
    batch_dims: dict[str, int] | None = None,
) -> int:
    """Keep this cfg rank's rows of every batched argument, in place; returns the full batch size.
    ``batch_dims``: the batch dimension of arguments whose batch is not on dim 0 (the adapter's
    ``cfg_batch_dims``).

    ``list_args``: arguments that are lists (or tuples) of one entry per row: this rank's entries.

    Raises:
        NotImplementedError: the batch does not split evenly over the cfg ranks.
        ValueError: a list argument's length is not the batch.
    """
    batch, cfg = batch_size(arguments), mesh.cfg_degree
    if batch % cfg:
        raise NotImplementedError(
            f"cfg_degree={cfg} splits the transformer's batch over {cfg} groups, but the batch is {batch}: "
            f"use a pipeline that batches classifier-free guidance (e.g. CogVideoX, Mochi) or cfg_degree=1"
        )
    rows = batch // cfg
    lo = mesh.cfg_rank * rows
    names = batch_args if batch_args is not None else tuple(arguments)
    for name in names:
        if name in arguments:
            dim = (batch_dims or {}).get(name, 0)
            arguments[name] = _take_rows(arguments[name], batch, lo, lo + rows, name, batch_args is not None, dim)
    for name in list_args:
        value = arguments.get(name)
        if isinstance(value, (list, tuple)):
            if len(value) != batch:
                raise ValueError(f"argument {name!r} lists {len(value)} rows but the batch is {batch}")
            arguments[name] = type(value)(value[lo:lo + rows])
    return batch


def _gather_rows(x: torch.Tensor, batch: int, mesh: USPMesh) -> torch.Tensor:
    rows = batch // mesh.cfg_degree
    return all_gather_uneven(x, [rows] * mesh.cfg_degree, 0, mesh.cfg_group)


def gather_cfg_output(out: Any, batch: int, mesh: USPMesh) -> Any:
    """The first output (the sample, batch/cfg rows here; or a list of batch/cfg equal-shaped
    tensors, one per row) all-gathered over "cfg": full batch, every rank; so is every later output tensor with batch/cfg rows (LTX-2's audio sample beside its video).
    A ``None`` output stays ``None`` (AnyFlow FAR's cache call returns no sample)."""
    rows = batch // mesh.cfg_degree

    def gather(i: int, x: Any) -> Any:
        if x is None:  # no sample: a call that only fills a cache (AnyFlow FAR's cache call)
            return None
        if i == 0 and isinstance(x, list):  # one tensor per row (Z-Image): equal shapes, stacked
            return list(_gather_rows(torch.stack(x), batch, mesh).unbind(0))
        if i == 0 or (torch.is_tensor(x) and x.dim() > 0 and x.shape[0] == rows):
            return _gather_rows(x, batch, mesh)
        return x

    if torch.is_tensor(out):
        return gather(0, out)
    if isinstance(out, tuple):
        return tuple(gather(i, x) for i, x in enumerate(out))
    for i, key in enumerate(list(out.keys())):  # BaseOutput: the sample is its first field
        setattr(out, key, gather(i, out[key]))
    return out


# ---------------------------------------------------------------------------------------------
# Note [model handshake]


def describe_value(name: str, value: Any, fields: dict[str, Any]) -> None:
    """Add to ``fields`` what every rank must agree on about argument ``name`` (Note [model handshake]).

    A tensor gives ``name`` ("tensor") and ``name.shape``, ``name.dtype``, ``name.requires_grad``;
    a list or tuple its length, then each item as ``name[i]``; a dict its keys, then each value
    as ``name['key']``; None, bool, int, float and str their value; anything else its type name.
    """
    if torch.is_tensor(value):
        fields[name] = "tensor"
        fields[f"{name}.shape"] = tuple(value.shape)
        fields[f"{name}.dtype"] = value.dtype
        fields[f"{name}.requires_grad"] = value.requires_grad
    elif isinstance(value, (list, tuple)):
        fields[name] = f"{type(value).__name__} of {len(value)}"
        for i, item in enumerate(value):
            describe_value(f"{name}[{i}]", item, fields)
    elif isinstance(value, dict):
        fields[name] = f"dict with keys {sorted(map(str, value))}"
        for key, item in value.items():
            describe_value(f"{name}[{key!r}]", item, fields)
    elif value is None or isinstance(value, (bool, int, float, str)):
        fields[name] = value
    else:
        fields[name] = f"a {type(value).__name__}"


def _bound_values(bound: inspect.BoundArguments) -> dict[str, Any]:
    """Every parameter's value, defaults included: an argument one rank omits and another passes
    is then a difference of value ("not given" against a tensor), not of field names."""
    values = {}
    for name, param in bound.signature.parameters.items():
        if name in bound.arguments:
            values[name] = bound.arguments[name]
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            values[name] = {}
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            values[name] = ()
        else:
            values[name] = None if param.default is inspect.Parameter.empty else param.default
    return values


def _parameter_sample(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The first parameter of each top-level submodule (embedders, first block of each stack,
    output layers) and of the module itself: what the dtype check reads.

    Not every parameter: listing Flux-dev's 1160 parameters and their dtypes took 8 ms per call
    (measured on CPU), longer than the collective; the sample takes a few microseconds per child.
    """
    sample = [next(iter(module.parameters(recurse=False)), None)]
    sample += [next(child.parameters(), None) for child in module.children()]
    return [p for p in sample if p is not None]


def call_fields(bound: inspect.BoundArguments, module: torch.nn.Module, state: USPState) -> dict[str, Any]:
    """Note [model handshake]: the fields of one transformer call."""
    fields: dict[str, Any] = {}
    for name, value in _bound_values(bound).items():
        describe_value(name, value, fields)
    sample = _parameter_sample(module)
    device_type = sample[0].device.type if sample else state.mesh.device_type
    mesh = state.mesh
    if torch.amp.is_autocast_available(device_type):
        fields[f"autocast on {device_type}"] = torch.is_autocast_enabled(device_type)
        fields[f"autocast dtype on {device_type}"] = torch.get_autocast_dtype(device_type)
    fields.update({
        "grad enabled": torch.is_grad_enabled(),
        "parameter dtypes": tuple(sorted({str(p.dtype).removeprefix("torch.") for p in sample})),
        "training": module.training,
        "model": type(module).__name__,
        "degrees (cfg, ring, ulysses)": (mesh.cfg_degree, mesh.ring_degree, mesh.ulysses_degree),
        "ring_schedule": mesh.ring_schedule,
        "backend": state.backend,
    })
    return fields


def agree_on_call(fields: dict[str, Any], mesh: USPMesh) -> None:
    """Note [model handshake]: ``fields`` equal on every rank of the replica, or the same
    ValueError on all of them.

    Raises:
        ValueError: ranks disagree; names each differing field and each rank's value.
    """
    device, failure = comm_device(mesh), None
    for i, group in enumerate(replica_groups(mesh)):  # cfg, then sequence
        earlier = {} if i == 0 else {"the cfg group's check": failure or "passed"}
        try:
            agree({**fields, **earlier}, group, device, what="a transformer call")
        except ValueError as exc:
            failure = str(exc)
    if failure is not None:
        raise ValueError(failure)


class ReplicaForward(MethodWrapper):
    """``inner`` (the adapter's forward) with the call agreed on, inputs synced and the batch split over "cfg".

    An object, not a closure, so that a deep copy of the transformer runs its own weights
    (``usp_dit.pipelines.base`` Note [deep copies]).
    """

    def __init__(self, inner, state: USPState, module: torch.nn.Module) -> None:
        super().__init__(inner)
        self.state, self.module = state, module

    def __call__(self, *args, **kwargs):
        bound = self.__signature__.bind(*args, **kwargs)
        state, mesh = self.state, self.state.mesh
        if torch.compiler.is_compiling():  # Note [compiled calls] in usp_dit.attention.usp: no handshake traced
            if state.sync_inputs:
                sync_arguments(bound.arguments, mesh)
            return self._split_run_gather(bound)
        agree_on_call(call_fields(bound, self.module, state), mesh)
        if state.sync_inputs:
            sync_arguments(bound.arguments, mesh)
            with verified_calls(mesh):
                return self._split_run_gather(bound)
        return self._split_run_gather(bound)

    def _split_run_gather(self, bound: inspect.BoundArguments):
        mesh = self.state.mesh
        if mesh.cfg_degree == 1:
            return self.inner(*bound.args, **bound.kwargs)
        # A two-call family (cfg_pair Note [two calls a step]) pairs calls eagerly; a compiled call
        # takes the batch split below (Note [compiled calls] in usp_dit.attention.usp).
        if getattr(self.state, "cfg_pair", None) is not None and not torch.compiler.is_compiling():
            return self.state.cfg_pair(self.inner, self.module, bound)
        batch_args = getattr(self.state.adapter, "cfg_batch_args", None)
        if batch_args == ():  # no batched argument (one packed sequence): the whole call on both groups
            return self.inner(*bound.args, **bound.kwargs)
        list_args = getattr(self.state.adapter, "cfg_list_args", ())
        batch = split_cfg_batch(bound.arguments, mesh, batch_args, list_args,
                                getattr(self.state.adapter, "cfg_batch_dims", None))
        return gather_cfg_output(self.inner(*bound.args, **bound.kwargs), batch, mesh)
