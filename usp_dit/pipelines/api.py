"""``enable_usp`` / ``disable_usp``: what users call on a Diffusers pipeline or a bare transformer.

Layout: the transformer's own arguments; the batch dimension is dim 0 of every batched argument.

    enable_usp(pipe, ulysses_degree=U, ring_degree=R, cfg_degree=C)
      ├─ mesh:     usp_dit.init_usp(U, R, C) (or ``mesh=``)
      ├─ adapter:  find_adapter(transformer).enable(...)  shards tokens, swaps processors, gathers
      └─ wrapper around the adapter's forward (only when C * U * R > 1):

    transformer(args) ─► agree ─► sync inputs ─► cfg split ─► adapter forward (sequence parallel) ─► cfg gather
                         (Note    (broadcast     (batch half   on the C groups of U*R ranks           (all-gather
                          [model   from the       of this                                               over "cfg")
                          hand-    group's        rank's cfg
                          shake])  first rank)    group)

Note [model handshake]
    The input broadcast below sizes its buffers from each rank's own tensors: ranks that pass
    tensors of different shapes make gloo abort ("Received data size doesn't match") or NCCL hang,
    and bfloat16 on one rank against float16 on another (the same bytes) silently reinterprets
    them. So before anything else the wrapper agrees with the replica's other ranks on what the
    call is (``usp_dit.handshake.agree``: one fixed-size all-gather per replica group):

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
    in ``usp_dit.handshake``). Only with ``sync_inputs``: without the broadcast, values (Mochi's
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
    tensors, with dim 0 == B are split; size-1 or 0-dim ones broadcast and stay whole); otherwise
    every top-level tensor argument whose dim 0 equals the batch of the first tensor argument.

Note [a failing rank]
    When one rank raises, the others are typically blocked in a collective waiting for it. Under
    torchrun the elastic agent stops every worker as soon as one exits non-zero (it polls every
    ``--monitor-interval``, 0.1 s by default); what must not happen is that the failing process
    hangs in interpreter shutdown (process-group destructors, joined threads) instead of exiting.
    ``install_failure_handler`` (installed by ``enable_usp`` when the world size is > 1) replaces
    ``sys.excepthook``: it prints the traceback with the rank and calls ``os._exit(1)`` at once.
    Without an agent (plain processes, gloo), the peers' pending collectives then fail with a
    closed connection, their own uncaught errors go through the same hook, and the whole job ends
    within seconds (tests/test_pipelines_api.py). With NCCL and no agent, the process group's
    timeout is the backstop.
"""
from __future__ import annotations

import inspect
import os
import sys
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from diffusers import DiffusionPipeline

from usp_dit.comm import all_gather_uneven
from usp_dit.handshake import agree, verified_calls
from usp_dit.kernels import get_backend
from usp_dit.mesh import USPMesh, init_usp
from usp_dit.pipelines.base import (
    MISSING,
    MethodWrapper,
    ModelAdapter,
    check_model_device,
    comm_device,
    find_adapter,
    restore_instance_attr,
    saved_instance_attr,
)

_STATE_ATTR = "_usp_dit_state"


@dataclass(eq=False)
class USPState:
    """What ``enable_usp`` did to one transformer, kept on it until ``disable_usp``."""

    mesh: USPMesh
    adapter: ModelAdapter
    backend: str
    sync_inputs: bool
    forward_attr: Any = MISSING  # the instance attribute ``forward`` the adapter left (if any)
    wrapped: bool = False
    pipe_ref: Any = None  # weakref to the pipeline enable_usp was called on, if any
    progress_config: Any = MISSING  # that pipeline's progress-bar config before enable (ranks > 0)
    latents_attr: Any = MISSING  # its instance attribute ``prepare_latents`` before enable, if any
    latents_wrapped: bool = False


# ---------------------------------------------------------------------------------------------
# Finding the transformer and the mesh


def _transformer_of(target: Any) -> tuple[torch.nn.Module, Any]:
    """``(transformer, pipeline or None)`` for a pipeline or a bare transformer.

    Raises:
        NotImplementedError: a pipeline without a ``transformer`` component (e.g. UNet pipelines).
        ValueError: ``target`` is neither a pipeline nor a ``torch.nn.Module``.
    """
    if isinstance(target, torch.nn.Module):
        return target, None
    if isinstance(target, DiffusionPipeline):
        transformer = getattr(target, "transformer", None)
        if not isinstance(transformer, torch.nn.Module):
            raise NotImplementedError(
                f"{type(target).__name__} has no transformer component: usp_dit parallelises Diffusion "
                f"Transformer pipelines (Flux, CogVideoX, Mochi), not UNet ones"
            )
        return transformer, target
    raise ValueError(
        f"pipe_or_transformer must be a diffusers DiffusionPipeline or a torch.nn.Module transformer, "
        f"got {type(target).__name__}"
    )


def _resolve_mesh(
    mesh: USPMesh | None, ulysses_degree: int, ring_degree: int, cfg_degree: int, ring_schedule: str = "auto"
) -> USPMesh:
    """``mesh`` if given (its degrees must agree with any degree passed), else ``init_usp(...)``."""
    if mesh is None:
        return init_usp(ulysses_degree=ulysses_degree, ring_degree=ring_degree, cfg_degree=cfg_degree,
                        ring_schedule=ring_schedule)
    given = {"ulysses_degree": ulysses_degree, "ring_degree": ring_degree, "cfg_degree": cfg_degree}
    for name, value in given.items():
        if value != 1 and value != getattr(mesh, name):
            raise ValueError(f"{name}={value} disagrees with mesh={mesh}: pass the degrees or a mesh, not both")
    return mesh


def _check_backend(backend: str) -> None:
    """ValueError for a backend name that is neither "auto" nor registered (checked before patching)."""
    if backend != "auto":
        get_backend(backend)


def _check_device(transformer: torch.nn.Module) -> None:
    """ValueError for a model on another rank's GPU (``base.check_model_device``), before patching."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None or not torch.cuda.is_available():
        return
    devices = {t.device for t in (*transformer.parameters(), *transformer.buffers())}
    check_model_device(devices, int(local_rank), torch.cuda.device_count(), torch.cuda.current_device())


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---------------------------------------------------------------------------------------------
# Note [same inputs everywhere]


def _replica_groups(mesh: USPMesh) -> list[dist.ProcessGroup]:
    """The cfg group, then the sequence group: broadcasting over both covers one model replica."""
    return [g for g in (mesh.cfg_group, mesh.seq_group) if g is not None]


def _broadcast_copy(t: torch.Tensor, mesh: USPMesh) -> torch.Tensor:
    """A copy of the replica's first rank's ``t`` (no autograd), on ``t``'s device and dtype."""
    buf = t.detach().to(comm_device(mesh), copy=True).contiguous()
    as_bool = buf.dtype == torch.bool
    if as_bool:
        buf = buf.to(torch.uint8)  # not every backend reduces/broadcasts bool
    for group in _replica_groups(mesh):
        dist.broadcast(buf, group=group, group_src=0)
    if as_bool:
        buf = buf.bool()
    return buf.to(t.device)


def _check_same(t: torch.Tensor, name: str, mesh: USPMesh) -> None:
    """ValueError when ``t`` differs between ranks of the replica (checksum: sum and weighted sum)."""
    flat = t.detach().double().reshape(-1)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
    sums = torch.stack([flat.sum(), (flat * weights).sum()])
    both = torch.cat([sums, -sums]).to(comm_device(mesh))
    for group in _replica_groups(mesh):
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(both[:2], -both[2:]):
            raise ValueError(
                f"argument {name!r} (requires grad) differs between ranks of one model replica; "
                f"every rank must pass the same tensor (seed the generator or broadcast it)"
            )


def _sync_value(value: Any, name: str, mesh: USPMesh) -> Any:
    if torch.is_tensor(value):
        if value.requires_grad:
            _check_same(value, name, mesh)
            return value
        return _broadcast_copy(value, mesh)
    if isinstance(value, (list, tuple)) and any(torch.is_tensor(v) for v in value):
        return type(value)(_sync_value(v, name, mesh) for v in value)
    return value


def sync_arguments(arguments: dict[str, Any], mesh: USPMesh) -> None:
    """Note [same inputs everywhere]: make every tensor argument the replica's first rank's, in place."""
    for name, value in arguments.items():
        arguments[name] = _sync_value(value, name, mesh)


# ---------------------------------------------------------------------------------------------
# Note [cfg parallel]


def _batch_size(arguments: dict[str, Any]) -> int:
    for value in arguments.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("cfg_degree > 1 needs a tensor argument with a batch dimension; the transformer got none")


def _take_rows(value: Any, batch: int, lo: int, hi: int, name: str, strict: bool) -> Any:
    """Rows [lo, hi) of a batched tensor (or, for a declared argument, of each tensor of a list/tuple);
    broadcastable ones stay."""
    if isinstance(value, (list, tuple)):
        if not strict:  # undeclared containers (e.g. RoPE tables (seq, dim)) are not batched
            return value
        return type(value)(_take_rows(v, batch, lo, hi, name, strict) for v in value)
    if not torch.is_tensor(value) or value.dim() == 0:
        return value
    if value.shape[0] == batch:
        return value[lo:hi]
    if strict and value.shape[0] != 1:
        raise ValueError(f"argument {name!r} has {value.shape[0]} rows but the batch is {batch}")
    return value


def split_cfg_batch(arguments: dict[str, Any], mesh: USPMesh, batch_args: tuple[str, ...] | None) -> int:
    """Keep this cfg rank's rows of every batched argument, in place; returns the full batch size.

    Raises:
        NotImplementedError: the batch does not split evenly over the cfg ranks.
    """
    batch, cfg = _batch_size(arguments), mesh.cfg_degree
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
            arguments[name] = _take_rows(arguments[name], batch, lo, lo + rows, name, batch_args is not None)
    return batch


def _gather_rows(x: torch.Tensor, batch: int, mesh: USPMesh) -> torch.Tensor:
    rows = batch // mesh.cfg_degree
    return all_gather_uneven(x, [rows] * mesh.cfg_degree, 0, mesh.cfg_group)


def gather_cfg_output(out: Any, batch: int, mesh: USPMesh) -> Any:
    """The first output (the sample, batch/cfg rows here) all-gathered over "cfg": full batch, every rank."""
    if torch.is_tensor(out):
        return _gather_rows(out, batch, mesh)
    if isinstance(out, tuple):
        return (_gather_rows(out[0], batch, mesh),) + out[1:]
    key = next(iter(out.keys()))  # BaseOutput: the sample is its first field
    setattr(out, key, _gather_rows(out[key], batch, mesh))
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
    for i, group in enumerate(_replica_groups(mesh)):  # cfg, then sequence
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
        batch = split_cfg_batch(bound.arguments, mesh, getattr(self.state.adapter, "cfg_batch_args", None))
        return gather_cfg_output(self.inner(*bound.args, **bound.kwargs), batch, mesh)


# ---------------------------------------------------------------------------------------------
# Note [a failing rank]


def _exit_on_uncaught(exc_type, exc, tb) -> None:
    rank = os.environ.get("RANK", "?")
    # sys.__stderr__, not sys.stderr: a launcher may have redirected sys.stderr to a buffer that
    # os._exit would never flush, losing the traceback.
    sys.stderr = sys.__stderr__
    try:
        sys.stderr.write(f"[usp_dit] rank {rank}: uncaught {exc_type.__name__}, ending this process now "
                         f"so that no other rank waits for it in a collective\n")
        traceback.print_exception(exc_type, exc, tb)
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(1)


def install_failure_handler() -> None:
    """Note [a failing rank]: an uncaught exception prints its traceback and ends the process at once.

    Idempotent. Only the main thread's uncaught exceptions go through ``sys.excepthook``.
    """
    sys.excepthook = _exit_on_uncaught


# ---------------------------------------------------------------------------------------------
# The pipeline: progress bars on rank 0 only, initial latents synced


def _quiet_progress_bar(pipe: Any, state: USPState) -> None:
    if _global_rank() == 0:
        return
    state.progress_config = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)


def _restore_progress_bar(pipe: Any, state: USPState) -> None:
    if state.progress_config is not MISSING:
        pipe._progress_bar_config = state.progress_config


class SyncedLatents(MethodWrapper):
    """A pipeline's ``prepare_latents`` returning the replica's first rank's latents (an object:
    ``usp_dit.pipelines.base`` Note [deep copies])."""

    def __init__(self, inner, mesh: USPMesh) -> None:
        super().__init__(inner)
        self.mesh = mesh

    def __call__(self, *args, **kwargs):
        return _sync_value(self.inner(*args, **kwargs), "latents", self.mesh)


def _sync_pipeline_latents(pipe: Any, state: USPState) -> None:
    """Note [same inputs everywhere], at the source: the pipeline's ``prepare_latents`` returns the
    replica's first rank's tensors, so every rank denoises (and decodes) the same latents."""
    prepare = getattr(pipe, "prepare_latents", None)
    if prepare is None or not state.sync_inputs or state.mesh.config.model_degree == 1:
        return
    state.latents_attr = saved_instance_attr(pipe, "prepare_latents")
    pipe.prepare_latents = SyncedLatents(prepare, state.mesh)
    state.latents_wrapped = True


def _restore_pipeline_latents(pipe: Any, state: USPState) -> None:
    if not state.latents_wrapped:
        return
    restore_instance_attr(pipe, "prepare_latents", state.latents_attr)


def _patch_pipeline(pipe: Any, state: USPState) -> None:
    """Rank 0 alone shows progress; initial latents from the replica's first rank."""
    if pipe is None:
        return
    state.pipe_ref = weakref.ref(pipe)
    _quiet_progress_bar(pipe, state)
    _sync_pipeline_latents(pipe, state)


def _unpatch_pipeline(state: USPState) -> None:
    pipe = state.pipe_ref() if state.pipe_ref is not None else None
    if pipe is None:
        return
    _restore_progress_bar(pipe, state)
    _restore_pipeline_latents(pipe, state)


# ---------------------------------------------------------------------------------------------
# The API


def enable_usp(
    pipe_or_transformer: Any,
    ulysses_degree: int = 1,
    ring_degree: int = 1,
    cfg_degree: int = 1,
    backend: str = "auto",
    *,
    mesh: USPMesh | None = None,
    sync_inputs: bool = True,
    ring_schedule: str = "auto",
) -> USPMesh:
    """Run a Diffusers pipeline's transformer (or a bare transformer) on a USP grid, in place.

    Call it on every rank (under torchrun) with the same arguments. The transformer then takes and
    returns full tensors, exactly as before; inside, its tokens are split over the
    ``ulysses_degree * ring_degree`` ranks of a sequence group and its batch over ``cfg_degree``
    groups (Note [cfg parallel]). On a pipeline, only rank 0 of the job keeps the progress bar and
    ``prepare_latents`` returns the replica's first rank's latents (Note [same inputs everywhere]).

    Args:
        pipe_or_transformer: a ``DiffusionPipeline`` with a ``transformer`` component, or the
            transformer itself (e.g. for fine-tuning).
        ulysses_degree, ring_degree, cfg_degree: the grid; their product must divide the world size
            (the remaining factor is data parallel). Ignored when ``mesh`` is given.
        backend: attention kernel, "auto" or a name from ``usp_dit.kernels.list_backends()``.
        mesh: a grid from ``usp_dit.init_usp`` to use instead of building one.
        sync_inputs: broadcast the transformer's inputs from each replica's first rank
            (Note [same inputs everywhere]); turn off only if you guarantee identical inputs.
        ring_schedule: how the ring's forward moves K/V blocks: "stream" (block by block, least
            memory), "gather" (all blocks at once, the local block computed while they travel),
            "allgather" (all blocks at once, then one kernel call) or "auto" (by block length).
            Ignored when ``mesh`` is given (``init_usp`` takes it).

    Returns:
        The mesh in use.

    Raises:
        ValueError: bad degrees or backend name, a mesh that disagrees with the degrees, a
            ``ulysses_degree`` above the model's attention heads, a model on a GPU other than
            this rank's (``LOCAL_RANK``), or a transformer on which usp_dit is already enabled.
        NotImplementedError: no adapter for this transformer class (the message names the
            supported ones) or a pipeline without a transformer.
    """
    transformer, pipe = _transformer_of(pipe_or_transformer)
    if getattr(transformer, _STATE_ATTR, None) is not None:
        raise ValueError(f"usp_dit is already enabled on this {type(transformer).__name__}; call disable_usp first")
    _check_backend(backend)
    adapter = find_adapter(transformer)
    _check_device(transformer)
    mesh = _resolve_mesh(mesh, ulysses_degree, ring_degree, cfg_degree, ring_schedule)
    adapter.enable(transformer, mesh, backend)
    state = USPState(mesh, adapter, backend, sync_inputs)
    if mesh.config.model_degree > 1:  # at one rank there is nothing to sync or split: no wrapper, no tax
        state.forward_attr = saved_instance_attr(transformer, "forward")
        transformer.forward = ReplicaForward(transformer.forward, state, transformer)
        state.wrapped = True
    setattr(transformer, _STATE_ATTR, state)
    _patch_pipeline(pipe, state)
    if _world_size() > 1:
        install_failure_handler()
    return mesh


def disable_usp(pipe_or_transformer: Any) -> None:
    """Undo ``enable_usp``: the original processors and forward come back (bit-identical results).

    A transformer on which usp_dit is not enabled is left as it is.
    """
    transformer, _ = _transformer_of(pipe_or_transformer)
    state = transformer.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    if state.wrapped:
        restore_instance_attr(transformer, "forward", state.forward_attr)
    state.adapter.disable(transformer)
    _unpatch_pipeline(state)


def is_usp_enabled(pipe_or_transformer: Any) -> bool:
    """True while ``enable_usp`` is in force on this pipeline's transformer (or this transformer)."""
    transformer, _ = _transformer_of(pipe_or_transformer)
    return getattr(transformer, _STATE_ATTR, None) is not None


def _pipe_enable_usp(self, ulysses_degree: int = 1, ring_degree: int = 1, cfg_degree: int = 1,
                     backend: str = "auto", **kwargs) -> USPMesh:
    return enable_usp(self, ulysses_degree, ring_degree, cfg_degree, backend, **kwargs)


def _pipe_disable_usp(self) -> None:
    disable_usp(self)


_pipe_enable_usp.__doc__ = "``usp_dit.enable_usp(pipe, ...)`` as a pipeline method.\n\n" + (enable_usp.__doc__ or "")
_pipe_disable_usp.__doc__ = "``usp_dit.disable_usp(pipe)`` as a pipeline method."


def attach_pipeline_methods() -> None:
    """Give every ``DiffusionPipeline`` ``.enable_usp(...)`` and ``.disable_usp()`` (done at import)."""
    DiffusionPipeline.enable_usp = _pipe_enable_usp
    DiffusionPipeline.disable_usp = _pipe_disable_usp
