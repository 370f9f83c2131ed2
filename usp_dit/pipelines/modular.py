"""Diffusers' modular pipelines (``ModularPipeline``) under ``enable_usp``: FLUX.3, Wan-Animate-2, MiniMax-H3, ...

Layout: no tensors of its own; the pipeline state's latents keep whatever shape their block gives them.

Note [modular pipelines]
    Several 2026 models ship in Diffusers only as modular pipelines (``Flux3ModularPipeline``,
    ``WanAnimate2ModularPipeline``, ``MiniMaxH3ModularPipeline``, ...): a ``ModularPipeline`` runs
    a tree of blocks over a ``PipelineState``; its components (``transformer``, ``vae``, text
    encoders) are attributes as on a ``DiffusionPipeline``, and its denoise loop calls
    ``components.transformer(...)`` (once per guidance branch with a ``ClassifierFreeGuidance``
    guider). So the transformer side is the same as for a ``DiffusionPipeline`` (the replica
    wrapper, ``cfg_pair``'s two calls a step, the parallel VAE, the text-encoder placements); two
    things differ, and this module does them:

      latents   there is no ``prepare_latents`` method to wrap: a block draws the noise and writes
                it to the state (``state.set("latents", ...)``). Each rank's transformer call
                already takes the replica's first rank's inputs (Note [same inputs everywhere]),
                but the scheduler steps each rank's own latents: noise drawn differently per rank
                (a rank-seeded generator) would leave every rank a different final latent and
                the parallel VAE would decode a patchwork. So while the pipeline runs, the first
                value written to each state key ending in ``latents`` (the noise, a reference
                image's encoded latents; a tensor or a list of them) is replaced by the
                replica's first rank's. Later writes (the loop's) are equal on every rank
                already: equal latents and equal transformer outputs give equal steps (a block
                that writes its own first value back, as ``set_block_state`` does with inputs it
                holds, writes the synced one). Done by
                running the pipeline's blocks as a shallow copy whose class adds that around
                ``__call__`` (same class name, same sub-blocks): ``disable_usp`` puts the
                original blocks object back.
      noise in  a block inside a loop may draw noise of its own (MiniMax Music 3's per-window noise,
      loops     a segment's): no state key shows it. So before the blocks run, each
                ``torch.Generator`` the call passes (``generator=``, or a list of them) takes the
                replica's first rank's state: every draw from it, anywhere in the blocks, is then
                the same on every rank (the user's generators on ranks > 0 are left in rank 0's
                state). A call without one (``generator=None``) draws from the global RNGs: the
                CPU's default generator and this rank's GPU's (once CUDA is in use) then take rank
                0's state the same way. Ranks that pass different kinds or counts of generators
                are refused on every rank (``ValueError``) before any broadcast.
      progress  the bars belong to the loop blocks (``LoopSequentialPipelineBlocks``), anywhere in
                the tree, and ``ModularPipeline.set_progress_bar_config`` reaches the top level
                only: ranks > 0 disable every loop block's bar and restore each config after. A
                block that opens a ``tqdm`` of its own (Wan-Animate-2's and Helios's denoise steps
                in Diffusers 0.42.1) has no config to set: on ranks > 0, while the blocks run,
                every ``tqdm`` bar starts disabled unless its caller says otherwise (tqdm's own
                ``__init__`` takes ``disable=True`` as its default for the call's duration; its
                subclasses, ``tqdm.auto``'s included, go through it). Rank 0's bars are untouched.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import broadcast_from_first_rank, same_on_replica
from usp_dit.pipelines.base import MISSING
from usp_dit.pipelines.replica_forward import sync_value

_LATENTS_SUFFIX = "latents"
_SYNCED_CLASSES: dict[type, type] = {}


def modular_pipeline_class() -> type | None:
    """Diffusers' ``ModularPipeline`` class, or None where this Diffusers has no modular pipelines."""
    try:
        from diffusers.modular_pipelines import ModularPipeline
    except ImportError:
        return None
    return ModularPipeline


def is_modular_pipeline(obj: Any) -> bool:
    cls = modular_pipeline_class()
    return cls is not None and isinstance(obj, cls)


@dataclass(eq=False)
class ModularPatch:
    """What ``patch_modular`` changed on one pipeline: its blocks object and the loop bars' configs."""

    blocks: Any = None  # the pipeline's own ``_blocks`` before the synced copy replaced it
    progress: list[tuple[Any, Any]] = field(default_factory=list)  # (loop block, its config or MISSING)


def _synced_call(self, pipeline: Any, state: Any) -> Any:
    """The blocks' ``__call__`` under Note [modular pipelines]: with ``_usp_sync`` the call's
    generators take the replica's first rank's state and the first value written to each
    ``*latents`` key in this run is the replica's first rank's; with ``_usp_quiet`` the blocks'
    own ``tqdm`` bars start disabled."""
    with contextlib.ExitStack() as stack:
        if self._usp_sync:
            _sync_generators(state.get("generator"), self._usp_mesh)
            stack.enter_context(_first_latents_synced(state, self._usp_mesh))
        if self._usp_quiet:
            stack.enter_context(_own_bars_off())
        return super(type(self), self).__call__(pipeline, state)


@contextlib.contextmanager
def _first_latents_synced(state: Any, mesh: USPMesh) -> Iterator[None]:
    """While open, the first value written to each ``*latents`` key of ``state`` (and the same
    object written back) is the replica's first rank's (Note [modular pipelines], latents)."""
    original_set = state.set
    synced: dict[str, tuple[Any, Any]] = {}  # key -> (the rank's own first value, the first rank's)

    def set_synced(key: str, value: Any, kwargs_type: str | None = None) -> None:
        if key.endswith(_LATENTS_SUFFIX) and value is not None:
            if key not in synced:
                synced[key] = (value, sync_value(value, key, mesh))
            if value is synced[key][0]:  # a block writes its inputs back too: the same object again
                value = synced[key][1]
        original_set(key, value, kwargs_type)

    state.set = set_synced  # an instance attribute: the state's blocks call ``state.set(...)``
    try:
        yield
    finally:
        del state.set  # the returned state is a plain ``PipelineState`` again


@contextlib.contextmanager
def _own_bars_off() -> Iterator[None]:
    """While open, every ``tqdm`` bar starts disabled unless its caller passes ``disable`` (Note
    [modular pipelines], progress)."""
    from tqdm import std

    original = std.tqdm.__dict__["__init__"]
    std.tqdm.__init__ = functools.partialmethod(original, disable=True)  # the caller's own keywords win
    try:
        yield
    finally:
        std.tqdm.__init__ = original


def _sync_generators(value: Any, mesh: USPMesh) -> None:
    """Note [modular pipelines], noise in loops: each ``torch.Generator`` in ``value`` (one, a list,
    or None) takes the replica's first rank's state. Collective on every rank of the replica."""
    generators = [g for g in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(g, torch.Generator)]
    if value is None:  # the blocks draw from the global RNGs: those of the CPU and this rank's GPU
        generators = [torch.default_generator] + _cuda_default_generators()
    states = [g.get_state() for g in generators]
    shape = torch.tensor([value is None, len(states), sum(s.numel() for s in states)], dtype=torch.float64)
    if not same_on_replica(shape, mesh):  # before any broadcast: mismatched ones would hang
        raise ValueError(f"generator={value!r}: the ranks of a replica pass different numbers or kinds of "
                         "torch.Generator (pass the same on every rank; their seeds may differ)")
    for generator, generator_state in zip(generators, states):
        generator.set_state(broadcast_from_first_rank(generator_state, mesh))


def _cuda_default_generators() -> list[torch.Generator]:
    """This rank's current GPU's default generator, once CUDA is in use (none before: it would
    initialise CUDA)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    return [torch.cuda.default_generators[torch.cuda.current_device()]]


def _synced_class(cls: type) -> type:
    """``cls`` with ``_synced_call`` as its ``__call__``, under ``cls``'s own name (one per class)."""
    if cls not in _SYNCED_CLASSES:
        _SYNCED_CLASSES[cls] = type(cls.__name__, (cls,), {
            "__call__": _synced_call, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _SYNCED_CLASSES[cls]


def _loop_blocks(blocks: Any) -> Iterator[Any]:
    """Every block of the tree that owns a progress bar (``set_progress_bar_config``), depth first."""
    if hasattr(blocks, "set_progress_bar_config") and hasattr(blocks, "progress_bar"):
        yield blocks
    for sub in (getattr(blocks, "sub_blocks", None) or {}).values():
        yield from _loop_blocks(sub)


def patch_modular(pipe: Any, mesh: USPMesh, sync_latents: bool, quiet: bool) -> ModularPatch:
    """Note [modular pipelines] on ``pipe``: with ``sync_latents`` each call's generators and first
    latents are the replica's first rank's; with ``quiet`` every loop block's bar is off, and so
    is every ``tqdm`` a block opens itself while the blocks run."""
    patch = ModularPatch()
    if getattr(pipe, "_blocks", None) is None:  # components alone, no blocks to run: nothing to patch
        return patch
    if quiet:
        for block in _loop_blocks(pipe._blocks):
            patch.progress.append((block, block.__dict__.get("_progress_bar_config", MISSING)))
            block.set_progress_bar_config(disable=True)
    if sync_latents or quiet:
        patch.blocks = pipe._blocks
        synced = copy.copy(pipe._blocks)  # shares the sub-blocks; only the class and the mesh differ
        synced.__class__ = _synced_class(type(pipe._blocks))
        synced._usp_mesh, synced._usp_sync, synced._usp_quiet = mesh, sync_latents, quiet
        pipe._blocks = synced
    return patch


def unpatch_modular(pipe: Any, patch: ModularPatch) -> None:
    """Undo ``patch_modular``: the original blocks object and every loop bar's config."""
    for block, config in patch.progress:
        if config is MISSING:
            block.__dict__.pop("_progress_bar_config", None)
        else:
            block._progress_bar_config = config
    patch.progress.clear()
    if patch.blocks is not None and pipe is not None:
        pipe._blocks = patch.blocks
        patch.blocks = None
