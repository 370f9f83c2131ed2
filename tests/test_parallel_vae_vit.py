"""MiniMax-H3's video VAE over a replica's ranks (Note [a parallel ViT VAE] in
``usp_dit.pipelines.vae.vit``) against one process.

One spawned group of 4 ranks; the tiny ``AutoencoderKLMiniMaxH3`` (the release's 16x / 4x geometry
and clip arithmetic, a 1-layer ViT decoder, every parameter perturbed), batch 2, latents of 12
frames (two clips of 7: the stock clip loop's overlap and cross-fade run) and odd rows and columns.
Tiles of 64 pixels with 32-pixel overlaps (4 latent rows, 2 shared): latents of 7 x 9 make 3 x 4 =
12 tiles a clip (3 of 4 ranks' shares, 6 of 2's), 4 x 5 one row of 2 (two ranks of 4 idle), and
3 x 3 a single tile (the ranks without one learn the shape from rank 0). Replicas of 2 ranks (mesh
(2, 1, 1)), 4 ranks (2, 2, 1) and 4 across the cfg axis (1, 2, 2) (which case on which grid:
``TILED``, ``UNTILED``, ``ENCODED``). Checked:
- tiled decode and tiled encode (the release's path) equal the stock ones bit for bit (each tile
  is the same computation as on one process; the blend is stock's), and each rank's decoder
  (encoder) ran at most ceil(tiles / P) tiles a clip;
- the untiled decode (the decoder's tokens split, K/V gathered per layer) equals stock's untiled
  decode to 1e-5 of its largest value (float32: at most the softmax sums' order could differ;
  measured 0: each query's row is the same arithmetic over the same keys), and each rank's first block saw at most ceil(tokens / P) tokens (a clip's voxels, 7
  frames x 5 x 7, + 2 registers + the zero token = 248; the last piece holds the registers);
- the untiled encode runs stock (bit for bit); a decode that needs a gradient runs stock;
- a latent that differs between ranks raises ValueError on every rank; ``disable_parallel_vae``
  restores the stock decode bit for bit; a non-stock decoder attention processor leaves the
  untiled decode whole (the tiled one is still dealt out).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests import adapter_parity as parity
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4
GRIDS = [(2, 1, 1), (2, 2, 1), (1, 2, 2)]
LATENTS = {"many": (7, 9), "one_row": (4, 5), "one": (3, 3)}  # latent rows x columns
# Dealing tiles depends on the replica's size alone (2 or 4 ranks), the token split likewise: every
# grid for the many-tile latent, the others where they leave ranks idle (4 ranks).
TILED = [(grid, "many") for grid in GRIDS] + [((2, 2, 1), "one_row"), ((1, 2, 2), "one")]
UNTILED = [(2, 1, 1), (1, 2, 2)]
ENCODED = [(2, 2, 1)]


def _vae():
    from usp_dit.demo.tiny_minimax_h3 import tiny_minimax_h3_vae

    vae = tiny_minimax_h3_vae(seed=3)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                      tile_sample_min_overlap_height=32, tile_sample_min_overlap_width=32)
    return vae


def _latent(vae, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, vae.config.latent_channels, 12, rows, cols, generator=torch.Generator().manual_seed(seed))


def _counted(module, fn):
    """``fn()`` without gradients, and the shapes of ``module``'s first input at each of its calls."""
    seen = []
    hook = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    try:
        with torch.no_grad():
            return fn(), seen
    finally:
        hook.remove()


def _clips(vae, z) -> int:
    """How many clips the stock ``_decode`` cuts ``z`` into (its own arithmetic, replayed)."""
    tokens = z.shape[2] + vae.config.token_drop
    return math.ceil(tokens / vae.tokens_chunk_size) - int(vae.config.token_drop > 0)


def _tiles(vae, rows: int, cols: int) -> int:
    ratio = vae.spatial_compression_ratio
    count = lambda n, size, overlap: len(vae._split_tiles(n * ratio, size, overlap)[0])  # noqa: E731
    return (count(rows, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height)
            * count(cols, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width))


def _tiled_case(grid, latent: str) -> dict[str, float]:
    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae = _vae()
    rows, cols = LATENTS[latent]
    z = _latent(vae, rows, cols)
    with torch.no_grad():
        ref = vae.decode(z).sample
    parts = grid[0] * grid[1] * grid[2]
    state = enable_parallel_vae(vae, init_usp(*grid))
    try:
        out, seen = _counted(vae.decoder, lambda: vae.decode(z).sample)
    finally:
        disable_parallel_vae(vae)
    with torch.no_grad():
        again = vae.decode(z).sample
    tiles = _tiles(vae, rows, cols)
    return {
        "not_bit_identical": float(not torch.equal(out, ref)),
        "not_split": float(state.reason is not None),
        "tiles_above_share": float(len(seen) > _clips(vae, z) * math.ceil(tiles / parts)),
        "disable_not_bit_identical": float(not torch.equal(again, ref)),
    }


def _untiled_case(grid) -> dict[str, float]:
    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae = _vae()
    vae.use_tiling = False
    z = _latent(vae, 5, 7, seed=1)
    with torch.no_grad():
        ref = vae.decode(z).sample
    parts = grid[0] * grid[1] * grid[2]
    enable_parallel_vae(vae, init_usp(*grid))
    try:
        out, seen = _counted(vae.decoder.transformer_blocks[0], lambda: vae.decode(z).sample)
    finally:
        disable_parallel_vae(vae)
    tokens = vae.tokens_chunk_size + vae.token_overlap  # latent frames a clip
    tokens = tokens * 5 * 7 + vae.decoder.num_register_tokens + 1
    return {"out": rel_err(out, ref), "tokens_above_share": float(max(s[1] for s in seen) > math.ceil(tokens / parts))}


def _encode_case(grid) -> dict[str, float]:
    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae = _vae()
    x = torch.randn(2, 3, 34, 112, 144, generator=torch.Generator().manual_seed(2))  # 2 clips of 3 x 4 tiles
    with torch.no_grad():
        ref = vae._encode(x)
        vae.use_tiling = False
        ref_untiled = vae._encode(x)
        vae.use_tiling = True
    parts = grid[0] * grid[1] * grid[2]
    enable_parallel_vae(vae, init_usp(*grid))
    try:
        out, seen = _counted(vae.encoder, lambda: vae._encode(x))
        vae.use_tiling = False
        untiled = _counted(vae.encoder, lambda: vae._encode(x))[0]
    finally:
        disable_parallel_vae(vae)
    return {
        "not_bit_identical": float(not torch.equal(out, ref)),
        "tiles_above_share": float(len(seen) > 2 * math.ceil(_tiles(vae, 7, 9) / parts)),
        "untiled_not_bit_identical": float(not torch.equal(untiled, ref_untiled)),
    }


def _fallbacks() -> dict[str, float]:
    from diffusers.models.attention_processor import AttnProcessor

    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    mesh = init_usp(2, 2)
    vae = _vae()
    z = _latent(vae, 7, 9, seed=4)
    with torch.no_grad():
        ref = vae.decode(z).sample
    out: dict[str, float] = {}
    enable_parallel_vae(vae, mesh)
    try:
        z_grad = z.clone().requires_grad_()
        out["grad_not_bit_identical"] = float(not torch.equal(vae.decode(z_grad).sample.detach(), ref))
        out.update(parity.differing_inputs_flags(vae.decode, z))
    finally:
        disable_parallel_vae(vae)
    vae.decoder.transformer_blocks[0].attn.set_processor(AttnProcessor())  # not the stock ViT processor
    state = enable_parallel_vae(vae, mesh)
    out["foreign_processor_no_reason"] = float(not any("not split" in why for _, why in state.logged))
    disable_parallel_vae(vae)
    return out


def _run_all() -> dict:
    results: dict = {}
    for grid, latent in TILED:
        parity.record(results, f"tiled-{latent}-{parity.grid_id(grid)}", lambda: _tiled_case(grid, latent))
    for grid in UNTILED:
        parity.record(results, f"untiled-{parity.grid_id(grid)}", lambda: _untiled_case(grid))
    for grid in ENCODED:
        parity.record(results, f"encode-{parity.grid_id(grid)}", lambda: _encode_case(grid))
    parity.record(results, "fallbacks", _fallbacks)
    return results


@pytest.fixture(scope="module")
def per_rank():
    return parity.spawn_grid(_run_all, WORLD)  # a crashed rank fails here


@pytest.mark.parametrize("grid, latent", TILED)
def test_tiled_decode_equals_stock_bit_for_bit(per_rank, grid, latent):
    parity.assert_within(per_rank, f"tiled-{latent}-{parity.grid_id(grid)}", 0.0)  # every flag 0 on every rank


@pytest.mark.parametrize("grid", UNTILED)
def test_untiled_decode_splits_the_tokens(per_rank, grid):
    key = f"untiled-{parity.grid_id(grid)}"
    assert all("out" in res[key] for res in per_rank), [res[key] for res in per_rank]
    parity.assert_within(per_rank, key, 0.0, {"out": TOL})  # the output's error, and every flag 0


@pytest.mark.parametrize("grid", ENCODED)
def test_encode_deals_tiles_out(per_rank, grid):
    parity.assert_within(per_rank, f"encode-{parity.grid_id(grid)}", 0.0)  # every flag 0 on every rank


def test_fallbacks(per_rank):
    parity.assert_within(per_rank, "fallbacks", 0.0)  # every flag 0 on every rank
