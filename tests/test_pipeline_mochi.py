"""Mochi adapter: sharded transformer outputs equal the one-process output, on CPU gloo grids.

One spawned group of 4 ranks runs every case (tests/adapter_parity.run_grid_cases; process start-up
is the slow part); the 2-rank grids run on it as two data-parallel replicas of 2 ranks each. Model:
a tiny 2-layer Mochi transformer (6 heads of dim 16: uneven over 4 Ulysses ranks; the last layer
``context_pre_only`` as in the real model; random RoPE frequencies), latents of 27 video tokens
(does not divide 2 or 4) and 24 (does), batch 2 with prompt masks: none padded; padded differently
per element (6 and 2 of 9 tokens real); and a mask with the padding in front for one element and no
real token at all for the other (the stock processor's compaction and its empty case). Grids
(U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil(video tokens / P) video tokens (the prompt is
replicated), and after ``disable`` the output must be bit-identical to the stock output. Gradient
cases (27 tokens, padded prompts) on (1,2,1) and (2,2,1) check fine-tuning; ulysses_degree 4 on a
2-head model raises at enable. The 8-rank grids are in tests/test_world8.py.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar); sharding only reorders float32
sums (blockwise attention merged by log-sum-exp), a few 1e-7 relative at these sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_video import mochi_inputs, tiny_mochi
from usp_dit.pipelines.families.mochi import ADAPTER

TOL = 1e-5
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas


@dataclass(frozen=True)
class Shape:
    frames: int  # latent sizes
    height: int
    width: int
    valid: tuple[int, int]  # real prompt tokens per element (negative: the last n), of 9

    @property
    def tokens(self) -> int:
        """Video tokens (patch 2 in height and width)."""
        return self.frames * (self.height // 2) * (self.width // 2)

    def __str__(self) -> str:
        v = "_".join(str(n) for n in self.valid)
        return f"f{self.frames}h{self.height}w{self.width}-valid{v}"


SHAPES = [
    Shape(3, 6, 6, (9, 9)),  # 27 tokens, no padding
    Shape(3, 6, 6, (6, 2)),  # padded prompts, different per element
    Shape(3, 6, 6, (-4, 0)),  # padding in front; an element with no real prompt token
    Shape(2, 8, 6, (9, 9)),  # 24 tokens
    Shape(2, 8, 6, (6, 2)),
]
GRAD_SHAPE = Shape(3, 6, 6, (6, 2))


def _build(shape: Shape):
    model = tiny_mochi()
    return model, mochi_inputs(model, shape.frames, shape.height, shape.width, valid=list(shape.valid))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's video tokens vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.tokens)


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh),
                          {2: [GRAD_SHAPE], 4: [GRAD_SHAPE]})
    two_heads = tiny_mochi(num_heads=2)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys([GRAD_SHAPE]), TOL,
)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: the mask matters, restore exactly, loud failures ---------------------------


def test_prompt_mask_changes_the_output():
    """Guards the parity cases above: a padded mask must give another result than no padding."""
    model, padded = _build(Shape(3, 6, 6, (6, 2)))
    _, full = _build(Shape(3, 6, 6, (9, 9)))
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        assert not torch.allclose(parity.forward(model, padded), parity.forward(model, full), atol=1e-3)
    finally:
        ADAPTER.disable(model)


