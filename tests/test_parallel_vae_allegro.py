"""Allegro's 3D VAE over a replica's ranks (Note [Allegro's cubes dealt out] in
``usp_dit.pipelines.vae.allegro``) against one process.

One spawned group of 4 ranks; the tiny ``AutoencoderKLAllegro`` of the tiny pipeline (8x in space,
4x in time, as released; every parameter perturbed so that no norm is the identity), with cubes of
8 frames x 32 x 32 pixels every 8 x 16 x 16 (overlaps of 16 rows and columns: the stock blend's
ramps run; 2 x 4 x 4 latent elements every 2 x 2 x 2). Latents of 4 x 8 x 10 give 2 x 3 x 4 = 24
cubes (6 a rank of 4, 12 of 2), 2 x 4 x 6 give 2 (two ranks of 4 without a cube: they learn the
shape from rank 0), batch 2 through the VAE's slicing (the stock tiled decode takes one element).
Replicas of 2 ranks (mesh (2, 1, 1)), 4 ranks (2, 2, 1) and 4 across the cfg axis (1, 2, 2).
Checked:
- the decode and the encode equal stock bit for bit (each cube is the same computation on the same
  contiguous input; the blend is stock's), and each rank's decoder (encoder) ran at most
  ceil(cubes / P) cubes an element;
- a decode that needs a gradient runs stock (every cube on every rank); a latent that differs
  between ranks raises ValueError on every rank; a decoder call that is not the cube expected
  runs whole; ``disable_parallel_vae`` restores the stock decode bit for bit and leaves no
  instance attribute on the decoder.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests import adapter_parity as parity

WORLD = 4
GRIDS = [(2, 1, 1), (2, 2, 1), (1, 2, 2)]
LATENTS = {"many": (4, 8, 10), "two": (2, 4, 6)}  # latent frames x rows x columns
DECODED = [(grid, "many") for grid in GRIDS] + [((2, 2, 1), "two")]
ENCODED = [(2, 2, 1), (1, 2, 2)]
KERNEL, STRIDE = (8, 32, 32), (8, 16, 16)  # pixels: frames, rows, columns


def _vae():
    from usp_dit.demo.tiny_allegro import tiny_allegro_vae

    vae = tiny_allegro_vae(8, 32, 32, seed=3)
    vae.kernel, vae.stride = KERNEL, STRIDE
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return vae


def _cubes(sizes, kernel, stride) -> int:
    return math.prod((n - k) // s + 1 for n, k, s in zip(sizes, kernel, stride))


def _latent_cubes(vae, latent: str) -> int:
    ratios = (vae.config.temporal_compression_ratio, vae.spatial_compression_ratio, vae.spatial_compression_ratio)
    return _cubes(LATENTS[latent], [k // r for k, r in zip(KERNEL, ratios)], [s // r for s, r in zip(STRIDE, ratios)])


def _runs(module, fn):
    """``fn()`` without gradients, and how many times ``module`` computed (a pre-hook on it)."""
    calls = []
    hook = module.register_forward_pre_hook(lambda m, args: calls.append(1))
    try:
        with torch.no_grad():
            return fn(), len(calls)
    finally:
        hook.remove()


def _decode_case(grid, latent: str) -> dict[str, float]:
    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae = _vae()
    z = torch.randn(2, vae.config.latent_channels, *LATENTS[latent], generator=torch.Generator().manual_seed(0))
    ref, stock_runs = _runs(vae.decoder.conv_in, lambda: vae.decode(z).sample)
    state = enable_parallel_vae(vae, init_usp(*grid))
    try:
        out, runs = _runs(vae.decoder.conv_in, lambda: vae.decode(z).sample)
    finally:
        disable_parallel_vae(vae)
    again, _ = _runs(vae.decoder.conv_in, lambda: vae.decode(z).sample)
    cubes = _latent_cubes(vae, latent)
    return {
        "not_bit_identical": float(not torch.equal(out, ref)),
        "not_split": float(state.reasons["decode"] is not None),
        "stock_not_every_cube": float(stock_runs != 2 * cubes),
        "cubes_above_share": float(runs > 2 * math.ceil(cubes / math.prod(grid))),
        "disable_not_bit_identical": float(not torch.equal(again, ref)),
        "decoder_forward_left": float("forward" in vae.decoder.__dict__),
    }


def _encode_case(grid) -> dict[str, float]:
    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae = _vae()
    x = torch.randn(1, 3, 16, 64, 80, generator=torch.Generator().manual_seed(2))
    ref, _ = _runs(vae.encoder.conv_in, lambda: vae._encode(x))
    enable_parallel_vae(vae, init_usp(*grid))
    try:
        out, runs = _runs(vae.encoder.conv_in, lambda: vae._encode(x))
    finally:
        disable_parallel_vae(vae)
    cubes = _cubes(x.shape[2:], KERNEL, STRIDE)
    return {"cubes": float(cubes != 24), "not_bit_identical": float(not torch.equal(out, ref)),
            "cubes_above_share": float(runs > math.ceil(cubes / math.prod(grid)))}


def _fallbacks() -> dict[str, float]:
    import torch.distributed as dist

    from usp_dit import init_usp
    from usp_dit.pipelines.vae import allegro, disable_parallel_vae, enable_parallel_vae

    mesh = init_usp(2, 2)
    vae = _vae()
    z = torch.randn(1, vae.config.latent_channels, *LATENTS["many"], generator=torch.Generator().manual_seed(4))
    ref, _ = _runs(vae.decoder.conv_in, lambda: vae.decode(z).sample)
    out: dict[str, float] = {}
    enable_parallel_vae(vae, mesh)
    try:
        z_grad = z.clone().requires_grad_()
        calls = []
        hook = vae.decoder.conv_in.register_forward_pre_hook(lambda m, args: calls.append(1))
        got = vae.decode(z_grad).sample.detach()
        hook.remove()
        out["grad_not_bit_identical"] = float(not torch.equal(got, ref))
        out["grad_not_every_cube"] = float(len(calls) != _latent_cubes(vae, "many"))
        out.update(parity.differing_inputs_flags(vae.decode, z))
    finally:
        disable_parallel_vae(vae)
    # A call that is not the cube expected (a changed stock loop) runs the decoder itself.
    a, b = (torch.randn(1, vae.config.latent_channels, 2, 4, 4, generator=torch.Generator().manual_seed(s))
            for s in (6, 7))
    with torch.no_grad(), allegro._served(vae.decoder, dist.group.WORLD, lambda: [a, a]):
        served_a, unexpected = vae.decoder(a), vae.decoder(b)
        out["served_not_equal"] = float(not torch.equal(served_a, vae.decoder.__class__.forward(vae.decoder, a)))
        out["unexpected_not_run"] = float(not torch.equal(unexpected, vae.decoder.__class__.forward(vae.decoder, b)))
    return out


def _run_all() -> dict:
    results: dict = {}
    for grid, latent in DECODED:
        parity.record(results, f"decode-{latent}-{parity.grid_id(grid)}", lambda: _decode_case(grid, latent))
    for grid in ENCODED:
        parity.record(results, f"encode-{parity.grid_id(grid)}", lambda: _encode_case(grid))
    parity.record(results, "fallbacks", _fallbacks)
    return results


@pytest.fixture(scope="module")
def per_rank():
    return parity.spawn_grid(_run_all, WORLD)  # a crashed rank fails here


@pytest.mark.parametrize("grid, latent", DECODED)
def test_decode_deals_cubes_out_and_equals_stock_bit_for_bit(per_rank, grid, latent):
    parity.assert_within(per_rank, f"decode-{latent}-{parity.grid_id(grid)}", 0.0)  # every flag 0 on every rank


@pytest.mark.parametrize("grid", ENCODED)
def test_encode_deals_cubes_out_and_equals_stock_bit_for_bit(per_rank, grid):
    parity.assert_within(per_rank, f"encode-{parity.grid_id(grid)}", 0.0)  # every flag 0 on every rank


def test_fallbacks(per_rank):
    parity.assert_within(per_rank, "fallbacks", 0.0)  # every flag 0 on every rank
