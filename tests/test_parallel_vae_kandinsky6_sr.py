"""Kandinsky 6 SR's K-VAE (``Kandinsky6SRVAE``) split by rows over a replica's ranks
(``recipes._kandinsky6_sr_recipe``; Note [an exact parallel VAE], Note [chunked convolutions])
against one process.

One spawned group of 4 ranks; the tiny K-VAE of the tiny pipeline (five levels: 16x in space, 4x in
time, as released; every parameter perturbed). Decode: batch 2, 6 latent frames (two of the stock
time segments: 1 + 4 and 1 latent frames, the second reading every causal convolution's carried
cache), 9 x 5 latent rows and columns (no split is even: 5 + 4 on 2 ranks, 3 + 2 + 2 + 2 on 4).
Encode: 21 frames (segments of 17 and 4), 80 x 48 pixels (5 units of the encoder's 16 rows: 3 + 2
units on 2 ranks, 2 + 1 + 1 + 1 on 4), through ``encode`` with and without ``return_dict``.
Replicas of 2 ranks (mesh (2, 1, 1)), 4 ranks (2, 2, 1) and 4 across the cfg axis (1, 2, 2).

``Kandinsky6SRSafeConv3d`` convolves its input in time chunks once it holds more than
``CONV_CHUNK_ELEMENTS`` elements (2e9 as released). Every case runs with that bound lowered so that
the whole decode (encode) chunks, and the ranks' pieces chunk into different counts: the number of
``F.conv3d`` calls differs between ranks (checked), which without Note [chunked convolutions] would
pair the halo exchanges wrongly.

Checked, on every rank:
- the decoded video and the encoded moments equal the one-process result: max|err| / max|ref|
  <= 1e-5 (float32; no norm sums over rows here, so only the convolutions' own float order on a
  smaller input differs; measured ~1e-7);
- each rank's decoder saw at most ceil(rows / P) latent rows; the encoder fewer rows than the image;
- after ``disable_parallel_vae`` the decode is bit-identical to stock, and no convolution keeps an
  instance ``forward`` / ``_conv_forward``;
- fallbacks run whole, bit for bit: a decode needing a gradient, fewer latent rows than ranks; a
  latent differing between ranks raises ValueError on every rank;
- the tiny ``Kandinsky6SRPipeline`` through ``pipe.enable_usp(ulysses_degree=2)``: its VAE is split
  (the decoder sees half the rows) and the frames equal one process's <= 1e-4 (a random VAE's gain
  on the transformer's float rounding, as tests/test_pipeline_kandinsky6_sr.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests import adapter_parity as parity

WORLD = 4
GRIDS = [(2, 1, 1), (2, 2, 1), (1, 2, 2)]
LATENT = (2, 4, 6, 9, 5)  # batch, channels, latent frames, rows, columns
VIDEO = (1, 3, 21, 80, 48)  # batch, channels, frames, rows, columns
# Chunk bounds (elements; found by counting each Kandinsky6SRSafeConv3d input at these shapes): the
# whole decode (encode) chunks, every chunk of a time-kernel-3 convolution keeps >= 3 frames (stock's
# one-window-at-a-time branch calls a zero-argument super() inside a comprehension, a TypeError on
# Python 3.11), and a replica's pieces chunk into different counts. Decode's per replica size.
DECODE_CHUNK, ENCODE_CHUNK = {2: 1_500_000, 4: 1_100_000}, 220_000
TOL, TOL_FRAMES = 1e-5, 1e-4


def _vae():
    from usp_dit.demo.tiny_kandinsky6_sr import tiny_kandinsky6_sr_vae

    return tiny_kandinsky6_sr_vae(seed=3, std=0.05)


class _Counted:
    """Within: ``F.conv3d`` calls counted, and the K-VAE's chunk bound set to ``elements``."""

    def __init__(self, elements: int):
        self.elements, self.calls = elements, 0

    def __enter__(self):
        from diffusers.models.autoencoders import autoencoder_kandinsky6_sr as k6

        self.module, self.saved_bound = k6, k6.CONV_CHUNK_ELEMENTS
        self.saved_conv = torch.nn.functional.conv3d
        k6.CONV_CHUNK_ELEMENTS = self.elements

        def counted(*args, **kwargs):
            self.calls += 1
            return self.saved_conv(*args, **kwargs)

        torch.nn.functional.conv3d = counted
        return self

    def __exit__(self, *exc):
        torch.nn.functional.conv3d = self.saved_conv
        self.module.CONV_CHUNK_ELEMENTS = self.saved_bound


_REFS: dict[int, torch.Tensor] = {}  # chunk bound -> the one-process decode (the 4-rank grids share one)


def _decode(vae, z):
    with torch.no_grad():
        return vae.decode(z).sample


def _rows_seen(module, fn):
    """``fn()`` and the most rows ``module`` saw."""
    seen = []
    hook = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))
    try:
        return fn(), max(seen)
    finally:
        hook.remove()


def _leftovers(vae) -> bool:
    return any({"forward", "_conv_forward"} & set(vars(m)) for m in vae.modules() if isinstance(m, torch.nn.Conv3d))


def _decode_case(grid) -> dict[str, float]:
    import torch.distributed as dist

    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae = _vae()
    z = torch.randn(LATENT, generator=torch.Generator().manual_seed(0))
    bound = DECODE_CHUNK[math.prod(grid)]
    with _Counted(bound):
        if bound not in _REFS:
            _REFS[bound] = _decode(vae, z)
        ref = _REFS[bound]
        state = enable_parallel_vae(vae, init_usp(*grid))
        try:
            with _Counted(bound) as counted:
                out, seen = _rows_seen(vae.decoder.conv_in, lambda: _decode(vae, z))
        finally:
            disable_parallel_vae(vae)
        again = _decode(vae, z)
    calls = [None] * dist.get_world_size()
    dist.all_gather_object(calls, counted.calls)
    return {
        "out": parity.rel_err(out, ref),
        "not_split": float(state.reasons["decode"] is not None),
        "rows_above_share": float(seen > math.ceil(z.shape[-2] / math.prod(grid))),
        "chunks_even": float(len(set(calls)) == 1),  # the hazard of Note [chunked convolutions] is exercised
        "disable_not_bit_identical": float(not torch.equal(again, ref)),
        "instance_attributes_left": float(_leftovers(vae)),
    }


def _encode_case(grid) -> dict[str, float]:
    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae = _vae()
    x = torch.randn(VIDEO, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), _Counted(ENCODE_CHUNK):
        ref = vae.encode(x).latent_dist
        state = enable_parallel_vae(vae, init_usp(*grid))
        try:
            out, seen = _rows_seen(vae.encoder.conv_in, lambda: vae.encode(x).latent_dist)
            (posterior,) = vae.encode(x, return_dict=False)
        finally:
            disable_parallel_vae(vae)
    return {
        "moments": parity.rel_err(out.parameters, ref.parameters),
        "mode": parity.rel_err(posterior.mode(), ref.mode()),
        "not_split": float(state.reasons["encode"] is not None),
        "rows_not_split": float(seen >= x.shape[-2]),
        "not_a_posterior": float(type(out) is not type(ref) or out.deterministic != ref.deterministic),
    }


def _fallbacks() -> dict[str, float]:
    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae = _vae()
    z = torch.randn(1, 4, 2, 7, 5, generator=torch.Generator().manual_seed(2))
    few = torch.randn(1, 4, 2, 3, 5, generator=torch.Generator().manual_seed(3))  # 3 rows, 4 ranks
    ref, ref_few = _decode(vae, z), _decode(vae, few)
    out: dict[str, float] = {}
    enable_parallel_vae(vae, init_usp(2, 2))
    try:
        out["few_rows_not_bit_identical"] = float(not torch.equal(_decode(vae, few), ref_few))
        z_grad = z.clone().requires_grad_()
        out["grad_not_bit_identical"] = float(not torch.equal(vae.decode(z_grad).sample.detach(), ref))
        out.update(parity.differing_inputs_flags(vae.decode, z))
    finally:
        disable_parallel_vae(vae)
    return out


def _pipeline() -> dict[str, float]:
    """The tiny pipeline through ``pipe.enable_usp(ulysses_degree=2)`` (two replicas of 2 ranks)."""
    from usp_dit.demo.tiny_kandinsky6_sr import kandinsky6_sr_video, tiny_kandinsky6_sr_pipeline
    from usp_dit.pipelines.vae import is_parallel_vae_enabled

    pipe = tiny_kandinsky6_sr_pipeline()

    def frames():
        return _rows_seen(pipe.vae.decoder.conv_in, lambda: pipe(
            video=kandinsky6_sr_video(), resolution_scale=2, num_inference_steps=2, output_type="pt",
            generator=torch.Generator().manual_seed(0)).frames)

    ref, whole = frames()
    pipe.enable_usp(ulysses_degree=2)
    try:
        out, seen = frames()
        enabled = is_parallel_vae_enabled(pipe.vae)
    finally:
        pipe.disable_usp()
    return {"frames": parity.rel_err(out, ref), "vae_not_enabled": float(not enabled),
            "rows_not_split": float(seen > math.ceil(whole / 2))}


def _run_all() -> dict:
    results: dict = {}
    for grid in GRIDS:
        parity.record(results, f"decode-{parity.grid_id(grid)}", lambda: _decode_case(grid))
        parity.record(results, f"encode-{parity.grid_id(grid)}", lambda: _encode_case(grid))
    parity.record(results, "fallbacks", _fallbacks)
    parity.record(results, "pipeline", _pipeline)
    return results


@pytest.fixture(scope="module")
def per_rank():
    return parity.spawn_grid(_run_all, WORLD)  # a crashed rank fails here


@pytest.mark.parametrize("grid", GRIDS, ids=parity.grid_id)
def test_decode_split_by_rows_equals_one_process(per_rank, grid):
    parity.assert_within(per_rank, f"decode-{parity.grid_id(grid)}", 0.0, {"out": TOL})  # flags 0


@pytest.mark.parametrize("grid", GRIDS, ids=parity.grid_id)
def test_encode_split_by_rows_equals_one_process(per_rank, grid):
    parity.assert_within(per_rank, f"encode-{parity.grid_id(grid)}", 0.0, {"moments": TOL, "mode": TOL})


def test_fallbacks_run_whole_bit_for_bit(per_rank):
    parity.assert_within(per_rank, "fallbacks", 0.0)  # every flag 0 on every rank


def test_enable_usp_splits_the_pipelines_k_vae(per_rank):
    parity.assert_within(per_rank, "pipeline", 0.0, {"frames": TOL_FRAMES})
