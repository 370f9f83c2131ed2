"""Mochi adapter: sharded transformer outputs equal the one-process output, on CPU gloo grids.

One spawned group per world size (2 and 4) runs every case (tests/adapter_parity.py): a tiny
2-layer Mochi transformer (6 heads of dim 16: uneven over 4 Ulysses ranks; the last layer
``context_pre_only`` as in the real model; random RoPE frequencies), latents of 27 tokens (does not
divide 2 or 4) and 24 (does), batch 2 with prompt masks: none padded; padded differently per
element (6 and 2 of 9 tokens real); and a mask with the padding in front for one element and no
real token at all for the other (the stock processor's compaction and its empty case). Grids
(U, R) = (2,1), (1,2) at world 2; (2,2), (4,1), (1,4), cfg 2 x (1,2) at world 4. After ``disable``
the output must be bit-identical to the stock output; a gradient case checks fine-tuning.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar); sharding only reorders float32
sums (blockwise attention merged by log-sum-exp), a few 1e-7 relative at these sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.adapter_parity import assert_within, cases, forward, run_grid
from usp_dit import single_rank_mesh
from usp_dit.pipelines.mochi import ADAPTER
from usp_dit.demo.tiny_video import mochi_inputs, tiny_mochi
from usp_dit.testing import run_spawned_worlds

TOL = 1e-5


@dataclass(frozen=True)
class Shape:
    frames: int  # latent sizes
    height: int
    width: int
    valid: tuple[int, int]  # real prompt tokens per element (negative: the last n), of 9

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


def _grid(world: int):
    return run_grid(world, SHAPES, _build, ADAPTER, GRAD_SHAPE)


@pytest.fixture(scope="module")
def grid_results():
    return run_spawned_worlds(_grid, (2, 4, 8))


ALL_CASES = cases(2, SHAPES) + cases(4, SHAPES) + cases(8, SHAPES)


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_sharded_output_matches_one_process(grid_results, case):
    assert_within(grid_results[case.world], case.id, TOL)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_parameter_gradients_match_one_process(grid_results, world: int):
    assert_within(grid_results[world], f"grad-w{world}", TOL)


# ---- single process: the mask matters, restore exactly, loud failures ---------------------------


def test_prompt_mask_changes_the_output():
    """Guards the parity cases above: a padded mask must give another result than no padding."""
    model, padded = _build(Shape(3, 6, 6, (6, 2)))
    _, full = _build(Shape(3, 6, 6, (9, 9)))
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        assert not torch.allclose(forward(model, padded), forward(model, full), atol=1e-3)
    finally:
        ADAPTER.disable(model)


