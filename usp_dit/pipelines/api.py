"""``enable_usp`` / ``disable_usp``: what users call on a Diffusers pipeline or a bare transformer.

Layout: the transformer's own arguments; the batch dimension is dim 0 of every batched argument.

    enable_usp(pipe, ulysses_degree=U, ring_degree=R, cfg_degree=C)
      ├─ mesh:      usp_dit.init_usp(U, R, C) (or ``mesh=``)
      ├─ adapter:   find_adapter(transformer).enable(...)  shards tokens, swaps processors, gathers
      ├─ wrapper:   ``ReplicaForward`` around the adapter's forward (only when C * U * R > 1), from
      │             ``usp_dit.pipelines.replica_forward`` (Notes [model handshake], [same inputs
      │             everywhere], [cfg parallel]):
      │               transformer(args) ─► agree ─► sync inputs ─► cfg split ─► adapter forward ─► cfg gather
      ├─ pipeline:  progress bars on rank 0 only; ``prepare_latents`` synced (``SyncedLatents``); a
      │             ``ModularPipeline``'s first latents synced in its state (Note [modular pipelines])
      └─ failures:  at world size > 1, ``usp_dit.pipelines.failure.install_failure_handler``
                    (Note [a failing rank])

The replica wrapper's and the failure handler's names stay importable from here.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist
from diffusers import DiffusionPipeline

import usp_dit.pipelines.composition as composition
import usp_dit.pipelines.encoders as encoders
import usp_dit.pipelines.modular as modular
import usp_dit.pipelines.tensor as tensor
import usp_dit.pipelines.weights as weights
from usp_dit.distributed.mesh import USPMesh, init_usp
from usp_dit.kernels import get_backend
from usp_dit.pipelines.base import (
    MISSING,
    ModelAdapter,
    check_model_device,
    find_adapter,
    restore_instance_attr,
    saved_instance_attr,
)
from usp_dit.pipelines.caches import check_no_hook_over_usp
from usp_dit.pipelines.cfg_pair import cfg_pair_for
from usp_dit.pipelines.failure import install_failure_handler
from usp_dit.pipelines.replica_forward import (
    ReplicaForward,
    SyncedLatents,
    agree_on_call,
    call_fields,
    describe_value,
    gather_cfg_output,
    split_cfg_batch,
    sync_arguments,
)
from usp_dit.pipelines.state import USPState

__all__ = [
    "ReplicaForward",
    "SyncedLatents",
    "USPState",
    "agree_on_call",
    "attach_pipeline_methods",
    "call_fields",
    "describe_value",
    "disable_usp",
    "enable_usp",
    "gather_cfg_output",
    "install_failure_handler",
    "is_usp_enabled",
    "split_cfg_batch",
    "sync_arguments",
]

_STATE_ATTR = "_usp_dit_state"


# ---------------------------------------------------------------------------------------------
# Finding the transformer and the mesh


# A pipeline's transformer components, in the order they are enabled: Wan 2.2's two experts are
# ``transformer`` (high noise) and ``transformer_2`` (low noise); either may be None. Ideogram 4's
# asymmetric CFG runs a second model on the unconditional branch, ``unconditional_transformer``.
_TRANSFORMER_COMPONENTS = ("transformer", "transformer_2", "unconditional_transformer")


def _transformers_of(target: Any) -> tuple[list[torch.nn.Module], Any]:
    """``([transformers], pipeline or None)`` for a pipeline (every transformer component it has)
    or a bare transformer.

    Raises:
        NotImplementedError: a pipeline without a transformer component (e.g. UNet pipelines).
        ValueError: ``target`` is neither a pipeline nor a ``torch.nn.Module``.
    """
    if isinstance(target, torch.nn.Module):
        return [target], None
    if isinstance(target, DiffusionPipeline) or modular.is_modular_pipeline(target):
        found = [getattr(target, name, None) for name in _TRANSFORMER_COMPONENTS]
        transformers = [t for t in found if isinstance(t, torch.nn.Module)]
        if not transformers:
            raise NotImplementedError(
                f"{type(target).__name__} has no transformer component: usp_dit parallelises Diffusion "
                f"Transformer pipelines (Flux, CogVideoX, Mochi, Wan), not UNet ones"
            )
        return transformers, target
    raise ValueError(
        f"pipe_or_transformer must be a diffusers DiffusionPipeline, a ModularPipeline or a torch.nn.Module "
        f"transformer, "
        f"got {type(target).__name__}"
    )


def _resolve_mesh(
    mesh: USPMesh | None, ulysses_degree: int, ring_degree: int, cfg_degree: int, ring_schedule: str = "auto",
    tensor_degree: int = 1, comm_dtype: str = "model",
) -> USPMesh:
    """``mesh`` if given (its degrees must agree with any degree passed), else ``init_usp(...)``."""
    if mesh is None:
        return init_usp(ulysses_degree=ulysses_degree, ring_degree=ring_degree, cfg_degree=cfg_degree,
                        ring_schedule=ring_schedule, tensor_degree=tensor_degree, comm_dtype=comm_dtype)
    given = {"ulysses_degree": ulysses_degree, "ring_degree": ring_degree, "cfg_degree": cfg_degree,
             "tensor_degree": tensor_degree}
    if comm_dtype != "model" and comm_dtype != mesh.comm_dtype:
        raise ValueError(f"comm_dtype={comm_dtype!r} disagrees with mesh={mesh}: pass init_usp(comm_dtype=...) "
                         f"to build the mesh, or leave comm_dtype out")
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
# The pipeline: progress bars on rank 0 only, initial latents synced


def _quiet_progress_bar(pipe: Any, state: USPState) -> None:
    if _global_rank() == 0:
        return
    state.progress_config = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(disable=True)


def _restore_progress_bar(pipe: Any, state: USPState) -> None:
    if state.progress_config is not MISSING:
        pipe._progress_bar_config = state.progress_config


def _sync_pipeline_latents(pipe: Any, state: USPState) -> None:
    """Note [same inputs everywhere] (``replica_forward``), at the source: the pipeline's
    ``prepare_latents`` returns the replica's first rank's tensors, so every rank denoises (and
    decodes) the same latents."""
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
    if modular.is_modular_pipeline(pipe):  # Note [modular pipelines]: no prepare_latents, bars in its blocks
        sync = state.sync_inputs and state.mesh.config.model_degree > 1
        state.modular = modular.patch_modular(pipe, state.mesh, sync_latents=sync, quiet=_global_rank() != 0)
        return
    _quiet_progress_bar(pipe, state)
    _sync_pipeline_latents(pipe, state)


def _split_vae(pipe: Any, state: USPState) -> None:
    """The pipeline's VAE decodes over every rank of the replica (``enable_parallel_vae``)."""
    from usp_dit.pipelines.vae import enable_parallel_vae

    vae = getattr(pipe, "vae", None)
    if isinstance(vae, torch.nn.Module):
        enable_parallel_vae(vae, state.mesh)
        state.vae = vae


def _encoder_mode(text_encoder: str | None, shard_weights: bool, pipe: Any) -> str:
    """The text encoders' placement (Note [text encoders on a grid]), checked before any patch."""
    if text_encoder is None:
        return "shard" if shard_weights else "replicate"
    if text_encoder not in encoders.MODES:
        raise ValueError(f"text_encoder={text_encoder!r}: choose one of {encoders.MODES} (or leave it None)")
    if pipe is None and text_encoder != "replicate":
        raise ValueError(f"text_encoder={text_encoder!r} places a pipeline's text encoders: pass the pipeline, "
                         "not its transformer")
    return text_encoder


def _unpatch_pipeline(state: USPState) -> None:
    if state.encoders:
        encoders.restore_encoders(state.encoders)
    if state.vae is not None:
        from usp_dit.pipelines.vae import disable_parallel_vae

        disable_parallel_vae(state.vae)
        state.vae = None
    pipe = state.pipe_ref() if state.pipe_ref is not None else None
    if pipe is None:
        return
    if state.modular is not None:
        modular.unpatch_modular(pipe, state.modular)
        state.modular = None
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
    parallel_vae: bool = True,
    degrees: Any = None,
    shard_weights: bool = False,
    text_encoder: str | None = None,
    tensor_degree: int = 1,
    comm_dtype: str = "model",
) -> USPMesh:
    """Run a Diffusers pipeline's transformers (or a bare transformer) on a USP grid, in place.

    Call it on every rank (under torchrun) with the same arguments. The transformer then takes and
    returns full tensors, exactly as before; inside, its tokens are split over the
    ``ulysses_degree * ring_degree`` ranks of a sequence group and its batch over ``cfg_degree``
    groups (Note [cfg parallel]); where the pipeline calls it once per guidance branch (Flux true
    CFG, Qwen-Image, Wan, HunyuanVideo true CFG, Chroma, Flux.2 Klein), the two calls of a step
    run on the two cfg groups at once (Note [two calls a step] in ``usp_dit.pipelines.cfg_pair``).
    On a pipeline, only rank 0 of the job keeps the progress bar and ``prepare_latents`` returns
    the replica's first rank's latents (Note [same inputs everywhere]; it and [cfg parallel] in
    ``usp_dit.pipelines.replica_forward``).

    Args:
        pipe_or_transformer: a ``DiffusionPipeline`` with a ``transformer`` component (and Wan
            2.2's ``transformer_2``: both are enabled on one mesh), a ``ModularPipeline`` with
            one (FLUX.3's, Wan-Animate-2's: Note [modular pipelines] in
            ``usp_dit.pipelines.modular``), or the transformer itself (e.g. for fine-tuning).
        ulysses_degree, ring_degree, cfg_degree: the grid; their product must divide the world size
            (the remaining factor is data parallel). Ignored when ``mesh`` is given.
        backend: attention kernel, "auto" or a name from ``usp_dit.kernels.list_backends()``.
        mesh: a grid from ``usp_dit.init_usp`` to use instead of building one.
        sync_inputs: broadcast the transformer's inputs from each replica's first rank
            (Note [same inputs everywhere]); turn off only if you guarantee identical inputs.
        ring_schedule: how the ring's forward moves K/V blocks: "stream" (block by block, least
            memory), "gather_merge" (all blocks at once, the local block computed while they
            travel), "gather_one_call" (all blocks at once, then one kernel call) or "auto" (by
            block length). Ignored when ``mesh`` is given (``init_usp`` takes it).
        parallel_vae: on a pipeline, split its VAE's decode over every rank of the replica
            (``usp_dit.enable_parallel_vae``: equal to the one-process, untiled decode; a VAE it
            cannot split is decoded whole on every rank, said once in the log).
        degrees: ``"auto"``: the planner chooses the degrees and the ring schedule for this
            job's world size at the model's usual output size (``usp_dit.plan``, whose
            ``explain()`` rank 0 logs); or a ``usp_dit.Plan`` made for the size you
            generate. Replaces ``ulysses_degree``, ``ring_degree``, ``cfg_degree`` and
            ``ring_schedule``; the plan's placement turns ``shard_weights`` on where it needs it
            and sets ``text_encoder`` unless given (on CUDA, "auto" fits the GPU's memory).
        shard_weights: shard each transformer's weights over the ranks of its model replica
            (FSDP2, one unit per block, gathered just in time with the next block prefetched:
            Note [sharded weights] in ``usp_dit.pipelines.weights``): a rank holds about 1/P of
            the weights between blocks. The output is unchanged; ``disable_usp`` gives every
            rank its full weights back. Nothing to shard on a replica of one rank. With
            ``tensor_degree > 1`` the cut weights are sharded over the sequence ranks on top of
            the cut, the rest over the whole replica (Note [sharded tensor-parallel weights]);
            inference only there (a call recording gradients raises NotImplementedError).
        text_encoder: on a pipeline, where its text encoders live (Note [text encoders on a
            grid] in ``usp_dit.pipelines.encoders``): "replicate" (whole on every rank),
            "shard" (per layer over the replica, like ``shard_weights``) or "rank0" (run on the
            replica's first rank alone, the embeddings broadcast; the other ranks drop the
            weights). Default: "shard" with ``shard_weights=True``, else "replicate". Prompt
            embeddings equal one process's in every mode.
        tensor_degree: ranks that split each block's heads and MLP columns (tensor parallelism,
            column/row-parallel DTensor weights: Note [tensor plans] in
            ``usp_dit.pipelines.tensor``), innermost on the grid; heads are split over
            ``tensor_degree * ulysses_degree`` (any count: Note [uneven tensor splits]). The
            family must declare its cuts; a rank then holds about 1/T of each block's weights.
            Ignored when ``mesh`` is given (``init_usp(tensor_degree=...)``).
        comm_dtype: what the Ulysses all-to-alls carry: "model" (exact) or "fp8" (Q, V and the
            attention output in e4m3 with a scale per (token, head), V's rows round the ring
            likewise (Note [fp8 ring V]): lossy and opt-in, for
            inference only; Note [fp8 wire] in ``usp_dit.distributed.fp8_wire`` and docs/FP8.md
            state its error). A training step under it is refused.

    Returns:
        The mesh in use.

    Raises:
        ValueError: bad degrees or backend name, a mesh that disagrees with the degrees, a
            ``ulysses_degree`` or ``tensor_degree`` above the model's attention heads (a Ulysses
            degree above a tensor rank's heads), a model on a GPU other than
            this rank's (``LOCAL_RANK``), or a transformer on which usp_dit is already enabled.
        NotImplementedError: no adapter for this transformer class (the message names the
            supported ones) or a pipeline without a transformer; ``tensor_degree > 1`` on a family
            without a tensor plan, with LoRA layers or quantized weights.
    """
    transformers, pipe = _transformers_of(pipe_or_transformer)
    _check_backend(backend)
    if degrees is not None and mesh is None:
        chosen = _planned(pipe_or_transformer, degrees, transformers[0])
        ulysses_degree, ring_degree, cfg_degree = chosen.ulysses_degree, chosen.ring_degree, chosen.cfg_degree
        ring_schedule = chosen.ring_schedule
        tensor_degree = chosen.tensor_degree  # a plan may cut the blocks (planner Note [tensor cuts])
        shard_weights = shard_weights or chosen.shard_weights  # the placement that fits (planner Note [memory per rank])
        if text_encoder is None and pipe is not None:
            text_encoder = chosen.text_encoder  # explicit: a plan may shard weights yet replicate the encoder
    encoder_mode = _encoder_mode(text_encoder, shard_weights, pipe)
    adapters = [_checked_adapter(t) for t in transformers]  # every check before anything is patched
    mesh = _resolve_mesh(mesh, ulysses_degree, ring_degree, cfg_degree, ring_schedule, tensor_degree, comm_dtype)
    composition.check_enable(transformers, encoders.encoder_components(pipe) if pipe is not None else [],
                             shard_weights, encoder_mode, mesh.config.model_degree)  # offload, quantization
    if mesh.tensor_degree > 1:
        _check_tensor(transformers, adapters, mesh, shard_weights)
    states: list[USPState] = []
    try:
        for transformer, adapter in zip(transformers, adapters):
            states.append(_enable_one(transformer, adapter, mesh, backend, sync_inputs))
            if mesh.tensor_degree > 1:
                states[-1].tensor = tensor.apply_tensor_parallel(transformer, adapter.plan.tensor, mesh)
            if shard_weights:
                states[-1].sharded = _shard(transformer, adapter, mesh)
            if mesh.config.model_degree > 1:  # what is added later (Note [offload and quantization under USP])
                check = composition.transformer_check(states[-1].sharded is not None)
                states[-1].guards.append(composition.CallGuard(transformer, type(transformer).__name__, check))
    except BaseException:
        for transformer in transformers[:len(states)]:  # an expert that failed undoes the others
            _disable_one(transformer)
        raise
    _patch_pipeline(pipe, states[0])  # once per pipeline: its state sits on the first transformer
    if pipe is not None:
        states[0].encoders = encoders.place_encoders(pipe, mesh, encoder_mode)
        check = composition.encoder_check(encoder_mode)
        states[0].guards += [composition.CallGuard(e, type(e).__name__, check) for e, _ in states[0].encoders if check]
    if pipe is not None and parallel_vae:
        _split_vae(pipe, states[0])
    if _world_size() > 1:
        install_failure_handler()
    return mesh


def _gpu_memory_gib(transformer: torch.nn.Module) -> float | None:
    """The memory of the GPU the model sits on, for ``degrees="auto"`` to fit; None off CUDA."""
    param = next(transformer.parameters(), None)
    if param is None or param.device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(param.device).total_memory / 2**30


def _planned(pipe_or_transformer: Any, degrees: Any, transformer: torch.nn.Module) -> Any:
    """The ``Plan`` from ``degrees="auto"`` (fitted to the model's GPU) or a given one, checked."""
    from usp_dit.planner.plan import Plan, plan

    if isinstance(degrees, str) and degrees == "auto":
        degrees = plan(pipe_or_transformer, world_size=_world_size(), gpu_memory_gib=_gpu_memory_gib(transformer))
        if _global_rank() == 0:
            logging.getLogger("usp_dit").info("usp_dit: degrees='auto' chose\n%s", degrees.explain())
    if not isinstance(degrees, Plan):
        raise ValueError(f"degrees={degrees!r}: pass 'auto' or a usp_dit.Plan (or leave it None)")
    if degrees.world_size != _world_size():
        raise ValueError(f"degrees: the plan is for world_size={degrees.world_size}, this job has {_world_size()} ranks")
    return degrees


def _checked_adapter(transformer: torch.nn.Module) -> ModelAdapter:
    """The adapter of a transformer that can be enabled (not already, on this rank's device)."""
    if getattr(transformer, _STATE_ATTR, None) is not None:
        raise ValueError(f"usp_dit is already enabled on this {type(transformer).__name__}; call disable_usp first")
    adapter = find_adapter(transformer)
    _check_device(transformer)
    return adapter


def _enable_one(transformer: torch.nn.Module, adapter: ModelAdapter, mesh: USPMesh, backend: str,
                sync_inputs: bool) -> USPState:
    """The adapter's patch, then (at model degree > 1) the replica wrapper, on one transformer."""
    adapter.enable(transformer, mesh, backend)
    state = USPState(mesh, adapter, backend, sync_inputs)
    if mesh.config.model_degree > 1:  # at one rank there is nothing to sync or split: no wrapper, no tax
        state.cfg_pair = cfg_pair_for(adapter, mesh, sync_inputs)  # per transformer: Wan 2.2's experts apart
        # beneath an offload hook (Note [wrappers beneath the hooks] in usp_dit.pipelines.composition)
        state.forward_attr = composition.wrap_forward(
            transformer, lambda inner: ReplicaForward(inner, state, transformer))
        state.wrapped = True
    setattr(transformer, _STATE_ATTR, state)
    return state


def _check_tensor(transformers: list[torch.nn.Module], adapters: list[ModelAdapter], mesh: USPMesh,
                  shard_weights: bool) -> None:
    """``tensor_degree > 1``: refusals made on every rank before anything is patched."""
    for transformer, adapter in zip(transformers, adapters):
        plan = getattr(adapter, "plan", None)
        tensor.check_tensor_plan(transformer, getattr(plan, "tensor", None), adapter.name, mesh.tensor_degree)


def _shard(transformer: torch.nn.Module, adapter: ModelAdapter, mesh: USPMesh) -> Any:
    """``shard_weights=True`` on one enabled transformer: its plan's blocks, then the rest."""
    plan = getattr(adapter, "plan", None)
    if plan is None:
        raise NotImplementedError(f"shard_weights=True needs a family plan with block lists; {adapter.name} has none")
    return weights.shard_weights(transformer, mesh, plan.block_lists)


def _disable_one(transformer: torch.nn.Module) -> None:
    """Undo ``_enable_one`` and, if this transformer carries it, the pipeline's patch."""
    state = transformer.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    if state.sharded is not None:  # full local weights first, while the mesh's groups are live
        weights.unshard_weights(transformer, state.sharded)
        state.sharded = None
    if state.tensor is not None:
        tensor.remove_tensor_parallel(state.tensor)
        state.tensor = None
    for guard in state.guards:
        guard.remove()
    state.guards.clear()
    if state.wrapped:
        composition.unwrap_forward(transformer, state.forward_attr)
    if state.cfg_pair is not None:
        state.cfg_pair.clear()  # nothing learned or pending outlives disable_usp
    state.adapter.disable(transformer)
    _unpatch_pipeline(state)


def disable_usp(pipe_or_transformer: Any) -> None:
    """Undo ``enable_usp``: the original processors and forward come back (bit-identical results),
    on every transformer of a pipeline. A transformer on which usp_dit is not enabled is left as
    it is.
    """
    transformers, _ = _transformers_of(pipe_or_transformer)
    for transformer in transformers:  # before any is undone (usp_dit.pipelines.caches)
        check_no_hook_over_usp(transformer, ignore=composition.GROUP_OFFLOAD_HOOKS)
    for transformer in transformers:
        _disable_one(transformer)


def is_usp_enabled(pipe_or_transformer: Any) -> bool:
    """True while ``enable_usp`` is in force on any of this pipeline's transformers (or on this
    transformer)."""
    transformers, _ = _transformers_of(pipe_or_transformer)
    return any(getattr(t, _STATE_ATTR, None) is not None for t in transformers)


def _pipe_enable_usp(self, ulysses_degree: int = 1, ring_degree: int = 1, cfg_degree: int = 1,
                     backend: str = "auto", **kwargs) -> USPMesh:
    return enable_usp(self, ulysses_degree, ring_degree, cfg_degree, backend, **kwargs)


def _pipe_disable_usp(self) -> None:
    disable_usp(self)


_pipe_enable_usp.__doc__ = "``usp_dit.enable_usp(pipe, ...)`` as a pipeline method.\n\n" + (enable_usp.__doc__ or "")
_pipe_disable_usp.__doc__ = "``usp_dit.disable_usp(pipe)`` as a pipeline method."


def attach_pipeline_methods() -> None:
    """Give every ``DiffusionPipeline`` and ``ModularPipeline`` ``.enable_usp(...)`` and ``.disable_usp()``
    (done at import)."""
    for cls in (DiffusionPipeline, modular.modular_pipeline_class()):
        if cls is not None:
            cls.enable_usp = _pipe_enable_usp
            cls.disable_usp = _pipe_disable_usp
