"""``enable_parallel_vae`` / ``disable_parallel_vae``: a VAE's decode split over a replica's ranks.

Layout: latents (batch, channels, [frames,] rows, width); decoded images / videos the same with
the decoder's channels and sizes. Rows (dim -2) are split (Note [an exact parallel VAE]).

Note [parallel VAE fallback]
    The split is exact or not used. A VAE is decoded whole on every rank (as without usp_dit;
    logged once per reason on rank 0) when: its class has no recipe, a module of its decoder is
    not known to act per row (``recipes.classify``), the latent has fewer rows than ranks, or the
    call needs a gradient (the halo transfers are not differentiable). Every rank reaches the same
    decision from the same information (same class, same latent shape: checked equal on every
    rank), so no rank waits in a collective that another skipped.
"""
from __future__ import annotations

import functools
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from usp_dit.comm import gather_uneven
from usp_dit.logs import get_logger
from usp_dit.mesh import USPMesh, resolve_mesh
from usp_dit.pipelines._routing import with_global
from usp_dit.pipelines.vae.attention import GATHERED_F
from usp_dit.pipelines.vae.halo import ROWS, RowGroup, decoding, halo_conv_forward
from usp_dit.pipelines.vae.norm import group_norm_forward
from usp_dit.pipelines.vae.recipes import Sites, classify, recipes
from usp_dit.pipelines.vae.rows import can_split, row_offsets, row_split
from usp_dit.replica import replica_group, same_on_replica

_log = get_logger("vae")


@dataclass(eq=False)
class VAEState:
    """One VAE's parallel decode: its replica group and what was replaced (to restore)."""

    mesh: USPMesh
    group: dist.ProcessGroup | None
    reason: str | None  # why this VAE is decoded whole on every rank (None: it is split)
    undo: list[tuple[object, str, object]] = field(default_factory=list)  # (object, attribute, saved)
    logged: set[str] = field(default_factory=set)

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def note(self, reason: str) -> None:
        """Log ``reason`` for whole decodes once (rank 0 prints it: ``usp_dit.logs``)."""
        if reason not in self.logged:
            self.logged.add(reason)
            _log.info("parallel VAE: every rank decodes the whole latent: %s", reason)


_STATES: weakref.WeakKeyDictionary[torch.nn.Module, VAEState] = weakref.WeakKeyDictionary()


def is_parallel_vae_enabled(vae: torch.nn.Module) -> bool:
    return vae in _STATES


def _set(state: VAEState, obj: object, name: str, value: object) -> None:
    state.undo.append((obj, name, obj.__dict__.get(name, _MISSING)))
    setattr(obj, name, value)


_MISSING = object()


def _install(vae: torch.nn.Module, sites: Sites, state: VAEState) -> None:
    """Replace, on the instances only, what ``sites`` names; ``state.undo`` records it."""
    for conv, pads_of in sites.convs:
        _set(state, conv, "_conv_forward", functools.partial(halo_conv_forward, conv, pads_of))
    for norm in sites.norms:
        _set(state, norm, "forward", functools.partial(group_norm_forward, norm))
    for attn in sites.processors:
        _set(state, attn, "processor", _GatheredAttnProcessor())
    for block in sites.forwards:
        _set(state, block, "forward", types.MethodType(with_global(type(block).forward, "F", GATHERED_F), block))
    for module, names in sites.rebound:
        forward = type(module).forward
        for name, value in names.items():
            forward = with_global(forward, name, value) or forward
        _set(state, module, "forward", types.MethodType(forward, module))
    _set(state, vae, "_decode", functools.partial(_parallel_decode, vae, type(vae)._decode))


def _gathered_processor_class() -> type:
    from diffusers.models.attention_processor import AttnProcessor2_0

    call = with_global(AttnProcessor2_0.__call__, "F", GATHERED_F)
    return type("GatheredKVAttnProcessor", (AttnProcessor2_0,), {
        "__call__": call, "__doc__": "AttnProcessor2_0's code with K/V gathered over the parallel VAE's ranks."})


class _LazyProcessor:
    cls: type | None = None


def _GatheredAttnProcessor():  # noqa: N802  (a class made on first use: Diffusers is imported late)
    if _LazyProcessor.cls is None:
        _LazyProcessor.cls = _gathered_processor_class()
    return _LazyProcessor.cls()


def enable_parallel_vae(vae: torch.nn.Module, mesh: USPMesh | None = None) -> VAEState:
    """Split ``vae``'s decode over every rank of ``mesh``'s replica (cfg x ring x ulysses ranks).

    The decoded image equals the one-process, untiled decode to float rounding; each rank holds
    about 1/P of the decoder's activations. A VAE that cannot be split is decoded whole on every
    rank, said once in the log (Note [parallel VAE fallback]). Call on every rank (the first call
    for a mesh may build its replica's process group). Idempotent; ``disable_parallel_vae`` undoes.
    """
    if vae in _STATES:
        return _STATES[vae]
    mesh = resolve_mesh(mesh)
    group = replica_group(mesh)
    recipe = recipes().get(type(vae))
    reason, sites = None, None
    if recipe is None:
        reason = f"{type(vae).__name__} has no parallel recipe (supported: {', '.join(c.__name__ for c in recipes())})"
    else:
        sites, reason = classify(getattr(vae, recipe.region), recipe)
    state = VAEState(mesh, group, reason)
    _STATES[vae] = state
    if group is None:
        return state
    if reason is not None:
        state.note(reason)
    else:
        _install(vae, sites, state)
    return state


def disable_parallel_vae(vae: torch.nn.Module) -> None:
    """Undo ``enable_parallel_vae`` (no-op when it is not enabled)."""
    state = _STATES.pop(vae, None)
    if state is None:
        return
    for obj, name, saved in reversed(state.undo):
        if saved is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, saved)


@contextmanager
def _untiled(vae: torch.nn.Module):
    """The stock decode of one row piece must not tile it (tiles are blended approximations)."""
    tiling = getattr(vae, "use_tiling", False)
    vae.use_tiling = False
    try:
        yield
    finally:
        vae.use_tiling = tiling


def _whole_reason(vae: torch.nn.Module, state: VAEState, z: torch.Tensor) -> str | None:
    """Why this call is decoded whole on every rank, or None (Note [parallel VAE fallback])."""
    if torch.is_grad_enabled() and (z.requires_grad or any(p.requires_grad for p in vae.parameters())):
        return "the decode needs a gradient (the split decode is for inference: call it under torch.no_grad())"
    if not can_split(z.shape[ROWS], state.size):
        return f"the latent's {z.shape[ROWS]} rows are fewer than the {state.size} ranks"
    return None


def _parallel_decode(vae: torch.nn.Module, stock, z: torch.Tensor, *args: Any, **kwargs: Any):
    """``vae._decode`` on this rank's rows of ``z``, the decoded rows gathered from every rank."""
    state = _STATES.get(vae)
    if state is None or state.group is None:
        return stock(vae, z, *args, **kwargs)
    if not same_on_replica(z, state.mesh):
        raise ValueError("parallel VAE: the latent passed to decode differs between the ranks of a replica; "
                         "every rank must decode the same latent")
    reason = _whole_reason(vae, state, z)
    if reason is not None:
        state.note(reason)
        return stock(vae, z, *args, **kwargs)
    rank = dist.get_rank(state.group)
    sizes = row_split(z.shape[ROWS], state.size)
    piece = z.narrow(ROWS, row_offsets(sizes)[rank], sizes[rank]).contiguous()
    with decoding(RowGroup(state.group, rank, tuple(sizes))), _untiled(vae):
        result = stock(vae, piece, *args, **kwargs)
    return _gathered(result, sizes, rank, state.group)


def _gathered(result: Any, sizes: list[int], rank: int, group: dist.ProcessGroup) -> Any:
    """The decoder output with every rank's rows (the row factor is the same on every rank)."""
    sample = result[0] if isinstance(result, tuple) else result.sample
    factor, rest = divmod(sample.shape[ROWS], sizes[rank])
    if rest:
        raise RuntimeError(f"parallel VAE: {sample.shape[ROWS]} decoded rows from {sizes[rank]} latent rows")
    full = gather_uneven(sample, [n * factor for n in sizes], ROWS, group)
    if isinstance(result, tuple):
        return (full,) + tuple(result[1:])
    result.sample = full
    return result
