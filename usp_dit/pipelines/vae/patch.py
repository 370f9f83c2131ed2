"""``enable_parallel_vae`` / ``disable_parallel_vae``: a VAE's decode and encode split over a
replica's ranks.

Layout: latents (batch, channels, [frames,] rows, width); images / videos the same with the
decoder's channels and sizes. Rows (dim -2) are split (Note [an exact parallel VAE]).

Note [parallel VAE fallback]
    The split is exact or not used. A decode (encode) runs whole on every rank (as without
    usp_dit; logged once per reason on rank 0) when: the VAE's class has no recipe (the message says
    why where it is known: ``recipes.NO_RECIPE``), a module of its decoder (encoder) is not known to
    act per row (``recipes.classify``), the input has fewer rows than ranks (than ranks x the
    encoder's downsampling) or a piece would be thinner than the widest halo at the lowest
    resolution, or the call needs a gradient (the halo transfers are not differentiable). Every
    rank reaches the same decision from the same information (same class, same input: checked
    equal on every rank), so no rank waits in a collective that another skipped.
"""
from __future__ import annotations

import functools
import math
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from usp_dit.distributed.comm import gather_uneven
from usp_dit.distributed.logs import get_logger
from usp_dit.distributed.mesh import USPMesh, resolve_mesh
from usp_dit.distributed.replica import replica_group
from usp_dit.pipelines._routing import with_global
from usp_dit.pipelines.base import restore_instance_attr, saved_instance_attr
from usp_dit.pipelines.vae.attention import GATHERED_F
from usp_dit.pipelines.vae.calls import needs_grad, require_same
from usp_dit.pipelines.vae.halo import ROWS, RowGroup, chunked_conv_forward, decoding, gathered_counts, halo_conv_forward
from usp_dit.pipelines.vae.norm import group_norm_forward
from usp_dit.pipelines.vae.recipes import NO_RECIPE, Sites, classify, recipes
from usp_dit.pipelines.vae.rows import aligned_split, can_split, row_offsets, row_split
from usp_dit.pipelines.vae.allegro import ALLEGRO_VAES, tiled_decode, tiled_encode
from usp_dit.pipelines.vae.vit import VIT_VAES, decode_clip, encode_clip, gathered_processor_class, refusal

_log = get_logger("vae")


@dataclass(eq=False)
class VAEState:
    """One VAE's parallel decode and encode: its replica group, why a direction is not split, what
    was replaced (to restore)."""

    mesh: USPMesh
    group: dist.ProcessGroup | None
    reasons: dict[str, str | None]  # "decode" / "encode" -> why it runs whole on every rank (None: split)
    row_stride: int = 1  # the encoder's downsampling of rows (encode pieces are multiples of it)
    halo: dict[str, int] = field(default_factory=lambda: {"decode": 1, "encode": 1})  # Sites.halo per direction
    undo: list[tuple[object, str, object]] = field(default_factory=list)  # (object, attribute, saved)
    logged: set[str] = field(default_factory=set)

    @property
    def reason(self) -> str | None:
        """Why the decode is not split (None: it is)."""
        return self.reasons["decode"]

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def note(self, direction: str, reason: str) -> None:
        """Log ``reason`` for a whole decode / encode once (rank 0 prints it: ``usp_dit.distributed.logs``)."""
        if (direction, reason) not in self.logged:
            self.logged.add((direction, reason))
            _log.info("parallel VAE: every rank runs the whole %s: %s", direction, reason)


_STATES: weakref.WeakKeyDictionary[torch.nn.Module, VAEState] = weakref.WeakKeyDictionary()
_REGIONS = {"decode": "decoder", "encode": "encoder"}


def is_parallel_vae_enabled(vae: torch.nn.Module) -> bool:
    return vae in _STATES


def _set(state: VAEState, obj: object, name: str, value: object) -> None:
    state.undo.append((obj, name, saved_instance_attr(obj, name)))
    setattr(obj, name, value)


def _install(sites: Sites, state: VAEState) -> None:
    """Replace, on the instances only, what ``sites`` names; ``state.undo`` records it."""
    for conv, pads_of in sites.convs:
        _set(state, conv, "_conv_forward", functools.partial(halo_conv_forward, conv, pads_of))
    for conv, pads_of in sites.chunked:
        _set(state, conv, "forward", functools.partial(chunked_conv_forward, conv, pads_of))
    for norm in sites.norms:
        _set(state, norm, "forward", functools.partial(group_norm_forward, norm))
    for attn in sites.processors:
        _set(state, attn, "processor", _gathered_processor_class()())
    for block in sites.forwards:
        _set(state, block, "forward", types.MethodType(with_global(type(block).forward, "F", GATHERED_F), block))
    for module, names in sites.rebound:
        forward = type(module).forward
        for name, value in names.items():
            forward = with_global(forward, name, value) or forward
        _set(state, module, "forward", types.MethodType(forward, module))
    for module, attributes in sites.attributes:
        for name, value in attributes.items():
            _set(state, module, name, value)
    for module, methods in sites.methods:
        for name, function in methods.items():
            _set(state, module, name, types.MethodType(function, module))


@functools.cache
def _gathered_processor_class() -> type:
    """``AttnProcessor2_0`` with K/V gathered (made on first use: Diffusers is imported late)."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    call = with_global(AttnProcessor2_0.__call__, "F", GATHERED_F)
    return type("GatheredKVAttnProcessor", (AttnProcessor2_0,), {
        "__call__": call, "__doc__": "AttnProcessor2_0's code with K/V gathered over the parallel VAE's ranks."})


def _classified(vae: torch.nn.Module, direction: str) -> tuple[Sites | None, str | None]:
    recipe = recipes().get(type(vae))
    region = getattr(vae, _REGIONS[direction], None)
    if recipe is None:
        why = NO_RECIPE.get(type(vae).__name__, f"supported: {', '.join(c.__name__ for c in recipes())}")
        return None, f"{type(vae).__name__} has no parallel recipe ({why})"
    if not isinstance(region, torch.nn.Module) or not hasattr(type(vae), recipe.calls[direction]):
        return None, f"{type(vae).__name__} has no {_REGIONS[direction]}"
    return classify(region, recipe)


def _setting(vae: torch.nn.Module, name: str) -> int:
    """A positive integer the VAE sets on itself or only in its config (HunyuanImage's
    ``spatial_compression_ratio``), else 1."""
    value = vars(vae).get(name)
    if value is None:
        config = getattr(vae, "config", None)
        value = config.get(name) if hasattr(config, "get") else None
    return value if isinstance(value, int) and value > 0 else 1


def _alignment(vae: torch.nn.Module, sites: Sites) -> int:
    """Rows per encode piece unit: the encoder's downsampling: its strided convolutions times the
    patchify (``patch_size``: rows reshaped into channels before or inside the encoder), and for a
    model that also downsamples rows by reshaping (pixel-unshuffles), its ``spatial_compression_ratio``."""
    stride = sites.row_stride * _setting(vae, "patch_size")
    return math.lcm(stride, _setting(vae, "spatial_compression_ratio"))


def enable_parallel_vae(vae: torch.nn.Module, mesh: USPMesh | None = None) -> VAEState:
    """Split ``vae``'s decode and encode over every rank of ``mesh``'s replica (cfg x ring x ulysses ranks).

    The decoded image (the encoded latent) equals the one-process, untiled result to float
    rounding; each rank holds about 1/P of the activations. What cannot be split runs whole on
    every rank, said once in the log (Note [parallel VAE fallback]). Call on every rank (the first
    call for a mesh may build its replica's process group). Idempotent; ``disable_parallel_vae``
    undoes.
    """
    if vae in _STATES:
        return _STATES[vae]
    mesh = resolve_mesh(mesh)
    state = VAEState(mesh, replica_group(mesh), {})
    _STATES[vae] = state
    if type(vae).__name__ in VIT_VAES:
        _install_vit(vae, state)
        return state
    if type(vae).__name__ in ALLEGRO_VAES:
        _install_calls(vae, state, {"tiled_decode": functools.partial(tiled_decode, vae, state.group),
                                    "tiled_encode": functools.partial(tiled_encode, vae, state.group)})
        return state
    for direction in _REGIONS:
        sites, state.reasons[direction] = _classified(vae, direction)
        if state.group is None:
            continue
        if sites is None:
            state.note(direction, state.reasons[direction])
            continue
        _install(sites, state)
        state.halo[direction] = sites.halo
        if direction == "encode":
            state.row_stride = _alignment(vae, sites)
        run = _parallel_decode if direction == "decode" else _parallel_encode
        method = recipes()[type(vae)].calls[direction]
        _set(state, vae, method, functools.partial(run, vae, getattr(type(vae), method)))
    return state


def _install_vit(vae: torch.nn.Module, state: VAEState) -> None:
    """MiniMax-H3's video VAE (Note [a parallel ViT VAE]): its clip decode and encode replaced."""
    untiled = refusal(vae)
    if state.group is not None and untiled is not None:
        state.note("decode", f"an untiled decode is not split: {untiled}")
    elif state.group is not None:
        for block in vae.decoder.transformer_blocks:
            _set(state, block.attn, "processor", gathered_processor_class()())
    _install_calls(vae, state, {"_decode_clip": functools.partial(decode_clip, vae, state.group, untiled is None),
                                "_encode_clip": functools.partial(encode_clip, vae, state.group)})


def _install_calls(vae: torch.nn.Module, state: VAEState, calls: dict[str, Any]) -> None:
    """The VAEs split per call, not per row (Note [a parallel ViT VAE], Note [Allegro's cubes dealt
    out]): each method named in ``calls`` replaced on the instance by its split version, behind the
    same-input check. Nothing runs whole for want of a recipe (``reasons`` None)."""
    state.reasons = {"decode": None, "encode": None}
    if state.group is None:
        return
    for name, run in calls.items():
        _set(state, vae, name, functools.partial(_same_input, state, name, run))


def _same_input(state: VAEState, name: str, run, x: torch.Tensor) -> torch.Tensor:
    require_same(x, state.mesh, name)
    return run(x)


def disable_parallel_vae(vae: torch.nn.Module) -> None:
    """Undo ``enable_parallel_vae`` (no-op when it is not enabled)."""
    state = _STATES.pop(vae, None)
    if state is None:
        return
    for obj, name, saved in reversed(state.undo):
        restore_instance_attr(obj, name, saved)


@contextmanager
def _untiled(vae: torch.nn.Module):
    """The stock code on one row piece must not tile it (tiles are blended approximations)."""
    if not hasattr(vae, "use_tiling"):  # a VAE that never tiles (Kandinsky 6 SR's)
        yield
        return
    tiling = vae.use_tiling
    vae.use_tiling = False
    try:
        yield
    finally:
        vae.use_tiling = tiling


def _pieces(vae: torch.nn.Module, state: VAEState, x: torch.Tensor, direction: str) -> list[int] | None:
    """Every rank's rows of ``x``, or None when this call runs whole (noted once)."""
    require_same(x, state.mesh, direction)
    rows, reason = x.shape[ROWS], None
    if needs_grad(vae, x):
        reason = f"the {direction} needs a gradient (the split one is for inference: call it under torch.no_grad())"
    else:
        sizes = _sizes(state, rows, direction)
    if reason is None and sizes is None:
        halo = state.halo[direction]
        reason = f"{rows} rows are too few for {state.size} ranks" + (
            f" in pieces of {state.row_stride} rows" if direction == "encode" else "") + (
            f" (a convolution reads {halo} rows of its neighbours: each piece needs {halo} at the lowest resolution)"
            if halo > 1 else "")
    if reason is not None:
        state.note(direction, reason)
        return None
    return sizes


def _sizes(state: VAEState, rows: int, direction: str) -> list[int] | None:
    """Every rank's rows, each piece holding at least the widest halo at the lowest resolution (the
    latent for decode, the encoder's output for encode: rows / ``row_stride``), else None. A halo
    comes from the next rank only, so a thinner piece would leave its neighbour short (on that rank
    alone: the check is here, where every rank decides the same)."""
    halo = state.halo[direction]
    if direction == "decode":
        return row_split(rows, state.size) if can_split(rows, state.size, halo) else None
    sizes = aligned_split(rows, state.size, state.row_stride)
    return sizes if sizes is not None and min(sizes) >= halo * state.row_stride else None


def _split_call(vae: torch.nn.Module, stock, x: torch.Tensor, direction: str, args, kwargs):
    """``stock(vae, x, ...)`` on this rank's rows of ``x``, the result's rows gathered from every rank."""
    state = _STATES.get(vae)
    sizes = None if state is None or state.group is None else _pieces(vae, state, x, direction)
    if sizes is None:
        return stock(vae, x, *args, **kwargs)
    rank = dist.get_rank(state.group)
    piece = x.narrow(ROWS, row_offsets(sizes)[rank], sizes[rank]).contiguous()
    rows = RowGroup(state.group, rank, tuple(sizes))
    with decoding(rows), _untiled(vae):
        result = stock(vae, piece, *args, **kwargs)
    return _gathered(result, rows)


def _parallel_decode(vae: torch.nn.Module, stock, z: torch.Tensor, *args: Any, **kwargs: Any):
    """``vae._decode`` on this rank's latent rows; the decoded rows gathered from every rank."""
    return _split_call(vae, stock, z, "decode", args, kwargs)


def _parallel_encode(vae: torch.nn.Module, stock, x: torch.Tensor, *args: Any, **kwargs: Any):
    """``vae._encode`` on this rank's image rows; the encoded rows gathered from every rank."""
    return _split_call(vae, stock, x, "encode", args, kwargs)


def _gathered(result: Any, rows: RowGroup) -> Any:
    """The output with every rank's rows: a tensor, a tuple led by one, an output with ``sample``, or
    an encode's posterior (``DiagonalGaussianDistribution``, alone or as ``latent_dist``: rebuilt
    from its gathered moments, as stock builds it from the whole moments)."""
    if torch.is_tensor(result):
        return gather_uneven(result, gathered_counts(result.shape[ROWS], rows, result.device), ROWS, rows.group)
    if isinstance(result, tuple):
        return (_gathered(result[0], rows),) + tuple(result[1:])
    if hasattr(result, "latent_dist"):
        result.latent_dist = _gathered(result.latent_dist, rows)
    elif hasattr(result, "parameters") and hasattr(result, "deterministic"):
        return type(result)(_gathered(result.parameters, rows), deterministic=result.deterministic)
    else:
        result.sample = _gathered(result.sample, rows)
    return result
