"""Flux under ``enable_usp`` against the one-process model, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Model: tiny ``FluxTransformer2DModel`` s
(4 heads x 16, 2 double + 2 single blocks, every weight perturbed; ``usp_dit.demo.tiny_flux``).
The text is split with the image (the joint [text; image] sequence): 71, 111, 15 and 69 joint
tokens (none divides 2 or 4; 15 tokens on 4 ranks, 4 + 4 + 4 + 3, leave the 6 text tokens on ranks
0 and 1), batch 1 and 2 (a different prompt, latent, timestep per element), one shape with
ControlNet residuals (sliced like the image tokens).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced; the cfg grids take the
batch-2 shapes only (the batch is split over the cfg groups). Each case, through
``enable_usp(model, mesh=mesh)``: output vs the stock output (same shape), block 0's attention sees
at most ceil((T + N) / P) tokens (text + image), after ``disable_usp`` the output is bit-identical.
Every parameter's gradient (loss / P on each rank, summed over the sequence group, equals one
process's: tests/adapter_parity.gradient_errors) on 2 ranks for the ControlNet shape and on 4 for it
and the 111-token one. Then, on (2,2): inputs that differ per rank (made equal by enable_usp),
disable_usp's bit-identical restore with the same processor objects; ulysses_degree 4 on a 2-head
model raises at enable; and the whole tiny FluxPipeline for 2 steps on (2,2) (also without a
generator: the same image on every rank) and on (1,2,2) (cfg splitting a batch of two images; a
batch of one refused). The 8-rank grids are in tests/test_world8.py.

Tolerance (max |err| / max |ref|): float32 1e-5, the issue's bar. The grid changes only the order
of float32 sums inside attention (blocks merged by log-sum-exp) and the split of matrix products,
so each op differs by a few ulps (~1e-7) and four blocks leave ~1e-6. The pipeline image passes
two steps and the VAE: the same bar holds there too. Measured (CPU, one thread per rank): 1.0e-6 at
most on outputs (all grids and schedules), 4.3e-7 with inputs synced, 1.2e-6 on the cfg-split
pipeline image (0 on (2,2)); gradients 0.8-1.3e-6 for the batch-2 shapes. The batch-1 shape is
left out of the gradient cases: there it measured 7.7e-6, too close to the bar to hold on every
CPU (its worst parameter, the last single block's ``to_k.bias``, has a small gradient, 6e-2 vs ~1
for the weights, summed from larger per-token terms, so reordering that sum shows most there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import usp_dit
from tests import adapter_parity as parity
from usp_dit import disable_usp, enable_usp, init_usp
from usp_dit.demo.tiny_flux import flux_inputs, tiny_flux_pipeline, tiny_flux_transformer
from usp_dit.pipelines.families.flux import ADAPTER
from usp_dit.testing import assert_no_crash, rel_err, run_spawned

TOL = 1e-5
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas


@dataclass(frozen=True)
class Shape:
    batch: int
    height: int  # packed latent tokens per column / row
    width: int
    text: int
    controlnet: bool = False

    @property
    def tokens(self) -> int:
        """Joint (text + image) tokens: what the grid splits."""
        return self.text + self.height * self.width

    def __str__(self) -> str:
        return f"b{self.batch}-{self.height}x{self.width}-t{self.text}" + ("-cn" if self.controlnet else "")


SHAPES = [
    Shape(1, 8, 8, 7),  # 71 joint tokens, batch 1 (grids without cfg)
    Shape(2, 10, 10, 11),  # 111 tokens, batch of two (cfg halves)
    Shape(2, 3, 3, 6),  # 15 tokens: on 4 ranks the text spans ranks 0 and 1
    Shape(2, 9, 7, 6, controlnet=True),  # 69 tokens, ControlNet residuals sliced like the image tokens
]
GRAD_SHAPES = {2: [SHAPES[3]], 4: [SHAPES[1], SHAPES[3]]}  # batch 2 (see the tolerance paragraph)


def _fits(shape: Shape, grid: tuple) -> bool:
    """The cfg axis splits the batch: only batches it divides."""
    return shape.batch % grid[2] == 0


class FluxArgs(dict):
    """Keyword arguments of one ``FluxTransformer2DModel`` call (``kwargs()`` as tests/adapter_parity expects)."""

    def kwargs(self) -> dict:
        return dict(self)


def _call_args(shape: Shape, seed: int = 0) -> FluxArgs:
    args = FluxArgs(flux_inputs(shape.batch, shape.height, shape.width, shape.text, seed=seed))
    args["guidance"] = torch.full((shape.batch,), 3.5)
    if shape.controlnet:
        g = torch.Generator().manual_seed(seed + 1)
        n, dim = shape.height * shape.width, 64
        args["controlnet_block_samples"] = [torch.randn(shape.batch, n, dim, generator=g)]
        args["controlnet_single_block_samples"] = [torch.randn(shape.batch, n, dim, generator=g) for _ in range(2)]
    return args


def _build(shape: Shape):
    """(model, inputs), the same on every rank."""
    return tiny_flux_transformer(), _call_args(shape)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """enable_usp on the mesh, one forward, disable: error vs one process, the output's shape,
    block 0's attention length (text + image) vs ceil((T + N) / P), bit-identity after disable."""
    model, args = _build(shape)
    ref = parity.forward(model, args)
    lengths = []

    def seen(m, a, kwargs):
        lengths.append(kwargs["hidden_states"].shape[1] + kwargs["encoder_hidden_states"].shape[1])

    enable_usp(model, mesh=mesh)
    hook = model.transformer_blocks[0].attn.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        out = parity.forward(model, args)
    finally:
        hook.remove()
        disable_usp(model)
    again = parity.forward(model, args)
    return {
        "out": rel_err(out, ref),
        "shape_differs": float(out.shape != ref.shape),
        "block0_tokens_above_ceil": float(not lengths or max(lengths) > math.ceil(shape.tokens / mesh.sequence_degree)),
        "disable_not_bit_identical": float(not torch.equal(again, ref)),
    }


def _check_sync(model) -> dict[str, float]:
    """Inputs that differ per rank are replaced by the first rank's (Note [same inputs everywhere])."""
    shape = Shape(2, 8, 8, 7)
    args0 = _call_args(shape, seed=100)
    mine = _call_args(shape, seed=100 + dist.get_rank())  # rank 0's equal args0
    ref = parity.forward(model, args0)
    enable_usp(model, ulysses_degree=2, ring_degree=2)
    try:
        out = parity.forward(model, mine)
    finally:
        disable_usp(model)
    return {"out": rel_err(out, ref)}


def _check_disable(model) -> dict[str, float]:
    """After enable (2x2) and disable: same processor objects, no forward attribute, equal bits."""
    args = _call_args(Shape(1, 8, 8, 7), seed=300)
    before_procs = model.attn_processors
    ref = parity.forward(model, args)
    enable_usp(model, ulysses_degree=2, ring_degree=2)
    parity.forward(model, args)
    disable_usp(model)
    after = parity.forward(model, args)
    same_procs = all(before_procs[k] is v for k, v in model.attn_processors.items())
    return {
        "bit_identical": float(torch.equal(after, ref)),
        "same_processors": float(same_procs),
        "no_forward_attr": float("forward" not in model.__dict__),
    }


def _pipeline_image(pipe, num_images: int = 1, seeded: bool = True) -> torch.Tensor:
    out = pipe(
        "a tiny red fox", height=40, width=40, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=16,
        num_images_per_prompt=num_images, generator=torch.Generator().manual_seed(0) if seeded else None,
        output_type="pt",
    )
    return out.images


def _same_on_every_rank(x: torch.Tensor) -> bool:
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return all(torch.equal(p, pieces[0]) for p in pieces)


def _check_pipelines() -> dict[str, float]:
    """Whole tiny FluxPipeline, 2 steps (100 image tokens + 16 text), vs the same pipeline on one rank."""
    results = {}
    pipe = tiny_flux_pipeline()
    ref = _pipeline_image(pipe)
    ref2 = _pipeline_image(pipe, num_images=2)
    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    results["progress_bar_quiet"] = float(pipe._progress_bar_config.get("disable", False) == (dist.get_rank() != 0))
    results["pipe_u2r2"] = rel_err(_pipeline_image(pipe), ref)
    # No generator: each rank draws its own noise; enable_usp makes rank 0's the noise of all ranks.
    results["unseeded_same_everywhere"] = float(_same_on_every_rank(_pipeline_image(pipe, seeded=False)))
    pipe.disable_usp()
    results["progress_bar_restored"] = float(not pipe._progress_bar_config.get("disable", False))
    results["prepare_latents_restored"] = float("prepare_latents" not in pipe.__dict__)
    results["pipe_disabled_bit_identical"] = float(torch.equal(_pipeline_image(pipe), ref))
    # Another pipeline in the same process, other degrees: cfg axis splitting a batch of two images.
    other = tiny_flux_pipeline()
    usp_dit.enable_usp(other, ring_degree=2, cfg_degree=2)
    results["pipe_cfg2_r2"] = rel_err(_pipeline_image(other, num_images=2), ref2)
    # One image, no true CFG: one call a step, run whole on both cfg groups (usp_dit.pipelines.cfg_pair).
    results["pipe_cfg2_r2_one_image"] = rel_err(_pipeline_image(other, num_images=1), ref)
    usp_dit.disable_usp(other)
    return results


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh),
                          GRAD_SHAPES, _fits)
    model = tiny_flux_transformer()  # the checks below build their meshes from degrees, as users do
    parity.record(results, "sync", lambda: _check_sync(model))
    parity.record(results, "disable", lambda: _check_disable(model))
    two_heads = tiny_flux_transformer(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipelines", _check_pipelines)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    per_rank = run_spawned(_run_all, WORLD)
    assert_no_crash(per_rank)
    return per_rank


def _per_rank(grid_results, key: str) -> list[dict[str, float]]:
    out = []
    for rank, res in enumerate(grid_results):
        value = res[key]
        assert not isinstance(value, str), f"rank {rank}: {value}"
        out.append(value)
    return out


@pytest.mark.parametrize("key", parity.output_keys(SHAPES, _fits))
def test_transformer_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


GRAD_KEYS = [f"grad-p{p}-{s}" for p in (2, 4) for s in GRAD_SHAPES[p]]


@pytest.mark.parametrize("key", GRAD_KEYS)
def test_parameter_gradients_match_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


def test_inputs_differing_per_rank_are_synced(grid_results):
    parity.assert_within(grid_results, "sync", TOL)


def test_disable_restores_bit_identical_model(grid_results):
    for rank, checks in enumerate(_per_rank(grid_results, "disable")):
        assert checks == {"bit_identical": 1.0, "same_processors": 1.0, "no_forward_attr": 1.0}, f"rank {rank}"


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


def test_whole_pipeline_matches_one_process(grid_results):
    for rank, res in enumerate(_per_rank(grid_results, "pipelines")):
        assert res["pipe_u2r2"] <= TOL, f"rank {rank}: {res}"
        assert res["pipe_cfg2_r2"] <= TOL, f"rank {rank}: {res}"
        assert res["pipe_disabled_bit_identical"] == 1.0, f"rank {rank}: {res}"
        assert res["unseeded_same_everywhere"] == 1.0, f"rank {rank}: {res}"
        assert res["prepare_latents_restored"] == 1.0, f"rank {rank}: {res}"
        assert res["pipe_cfg2_r2_one_image"] <= TOL, f"rank {rank}: {res}"
        assert res["progress_bar_quiet"] == 1.0 and res["progress_bar_restored"] == 1.0, f"rank {rank}: {res}"
