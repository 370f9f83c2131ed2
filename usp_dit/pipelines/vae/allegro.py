"""Allegro's 3D VAE over a replica's ranks: its cubes dealt out.

Layout: latents and videos (batch, channels, frames, rows, width).

Note [Allegro's cubes dealt out]
    ``AutoencoderKLAllegro`` decodes (and encodes) only in overlapping 3D tiles -- cubes of
    ``kernel`` frames x rows x columns placed every ``stride`` -- one decoder (encoder) call per
    cube in frame, row, column order, then blends the cubes with linear ramps over the overlaps,
    all inside one stock method (``tiled_decode`` / ``tiled_encode``). A split by rows would change
    the cubes (Note [an exact parallel VAE] does not apply), but the cubes are independent until
    the blend. So the stock method runs unchanged on every rank and only its calls of the decoder
    (encoder) are served (``_served``): at the first call the replica's P ranks each run a
    contiguous, balanced run of the cube list (``tiles.dealt``), the results are all-gathered, and
    each call returns its cube's result, once its input is checked to be that cube (otherwise, e.g.
    after a change of the stock loop, the call runs the decoder itself: every rank sees the same
    inputs, so every rank does the same). Each cube is the same computation as on one process (the
    same contiguous input), so the video (the latent) equals stock bit for bit, and the decoder's
    time splits P ways (ceil(cubes / P) a rank). Memory: the gathered cubes sit beside the stock
    method's own array of them until it returns (one more decoded video's worth).

    A decode's cubes are cut from ``post_quant_conv``'s output (the stock method's first step),
    captured as it runs and reshaped as stock does. The stock tiled methods take one batch
    element (the pipeline's VAE slicing feeds one at a time); with more, stock's own error stands.
    A call that needs a gradient runs stock.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from usp_dit.distributed.logs import get_logger
from usp_dit.pipelines.base import restore_instance_attr, saved_instance_attr
from usp_dit.pipelines.vae.calls import needs_grad
from usp_dit.pipelines.vae.tiles import dealt

ALLEGRO_VAES = ("AutoencoderKLAllegro",)  # VAE class names split this way (by name: Diffusers is imported late)
_log = get_logger(__name__)


def cubes(x: torch.Tensor, kernel: tuple[int, int, int], stride: tuple[int, int, int]) -> list[torch.Tensor]:
    """The stock cube layout over ``x`` (batch, channels, frames, rows, width): ``kernel``-sized
    views every ``stride`` along frames, rows and columns (as many as fit whole), in frame, row,
    column order."""
    counts = [(size - k) // s + 1 for size, k, s in zip(x.shape[2:], kernel, stride)]
    return [x[:, :, i * stride[0]:i * stride[0] + kernel[0], j * stride[1]:j * stride[1] + kernel[1],
              k * stride[2]:k * stride[2] + kernel[2]]
            for i in range(counts[0]) for j in range(counts[1]) for k in range(counts[2])]


@contextlib.contextmanager
def _served(module: torch.nn.Module, group: dist.ProcessGroup,
            cut: Callable[[], list[torch.Tensor]]) -> Iterator[None]:
    """Within the block, ``module``'s calls return the results of ``cut()``'s pieces in order, all
    computed at the first call with the work dealt out over ``group`` (Note [Allegro's cubes
    dealt out]). ``module.forward`` is replaced on the instance and put back after."""
    run = module.forward
    served: dict[str, object] = {"calls": 0}

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            return run(x, *args, **kwargs)
        if "inputs" not in served:
            served["inputs"] = [piece.contiguous() for piece in cut()]  # as stock copies each into its batch
            served["outputs"] = dealt(served["inputs"], run, group) if served["inputs"] else []
        call, inputs = served["calls"], served["inputs"]
        served["calls"] = call + 1
        if call < len(inputs) and torch.equal(x, inputs[call]):
            return served["outputs"][call]
        _log.info("parallel VAE: %s call %d is not the cube expected; it runs whole", type(module).__name__, call)
        return run(x)

    saved = saved_instance_attr(module, "forward")
    module.forward = forward
    try:
        yield
    finally:
        restore_instance_attr(module, "forward", saved)


def _latent_geometry(vae) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(kernel, stride) of the decode's cubes in latent elements: the pixel ones divided by the
    temporal and spatial compression."""
    ratios = (vae.config.temporal_compression_ratio, vae.spatial_compression_ratio, vae.spatial_compression_ratio)
    return (tuple(k // r for k, r in zip(vae.kernel, ratios)), tuple(s // r for s, r in zip(vae.stride, ratios)))


def tiled_decode(vae, group: dist.ProcessGroup, z: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLAllegro.tiled_decode`` with its cubes dealt out over ``group``; z (1, latent
    channels, frames, rows, width) -> video (1, frames, channels, rows, width), stock's layout."""
    if needs_grad(vae, z):
        return type(vae).tiled_decode(vae, z)
    kernel, stride = _latent_geometry(vae)
    captured: list[torch.Tensor] = []
    capture = vae.post_quant_conv.register_forward_hook(lambda module, args, out: captured.append(out))

    def cut() -> list[torch.Tensor]:
        if not captured:  # a stock method that no longer starts with post_quant_conv: nothing served
            return []
        # post_quant_conv ran on (batch * frames, channels, rows, width): back to stock's 5-D layout
        latent = captured[0].unflatten(0, (z.shape[0], -1)).permute(0, 2, 1, 3, 4)
        return cubes(latent, kernel, stride)

    try:
        with _served(vae.decoder, group, cut):
            return type(vae).tiled_decode(vae, z)
    finally:
        capture.remove()


def tiled_encode(vae, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLAllegro.tiled_encode`` with its cubes dealt out over ``group``; x (1,
    channels, frames, rows, width) -> latent moments (1, 2 x latent channels, frames, rows, width)."""
    if needs_grad(vae, x):
        return type(vae).tiled_encode(vae, x)
    with _served(vae.encoder, group, lambda: cubes(x, tuple(vae.kernel), tuple(vae.stride))):
        return type(vae).tiled_encode(vae, x)
