"""CogVideoX adapter: sharded transformer outputs equal the one-process output, on CPU gloo grids.

One spawned group per world size (2 and 4) runs every case: tiny 2B (sin-cos table), 5B (RoPE
passed in) and 1.5 image-to-video (temporal patches, ofs) transformers, 6 heads (uneven over 4
Ulysses ranks) of dim 16, on latents of 27 or 18 tokens (do not divide 2 or 4) and 24 or 12 (do),
batch 2, on grids (U, R) = (2,1), (1,2) at world 2 and (2,2), (4,1), (1,4), cfg 2 x (1,2) at world 4.
Each rank computes the stock model's output itself first (the one-process result), then enables
the adapter, runs, disables and runs again: the last run must be bit-identical to the first.
A gradient case checks fine-tuning: per-rank losses L/P, parameter gradients summed over the
sequence group equal the one-process gradients.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar). Sharding changes only the
order of float32 sums (attention split in blocks merged by log-sum-exp, projections on fewer
rows), which moves results by a few 1e-7 relative on these sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.adapter_parity import assert_within, cases, forward, run_grid
from usp_dit import single_rank_mesh
from usp_dit.pipelines.cogvideox import ADAPTER
from usp_dit.demo.tiny_video import cogvideox_inputs, tiny_cogvideox
from usp_dit.testing import run_spawned_worlds

TOL = 1e-5


@dataclass(frozen=True)
class Shape:
    variant: str
    frames: int  # latent sizes
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("2b", 3, 6, 6),  # 27 video tokens
    Shape("2b", 2, 8, 6),  # 24
    Shape("5b", 3, 6, 6),  # 27
    Shape("5b", 2, 8, 6),  # 24
    Shape("1.5-i2v", 4, 6, 6),  # 2 temporal patches x 9 = 18
    Shape("1.5-i2v", 2, 8, 6),  # 12
]
GRAD_SHAPE = Shape("5b", 3, 6, 6)


def _build(shape: Shape):
    model = tiny_cogvideox(shape.variant)
    return model, cogvideox_inputs(model, shape.frames, shape.height, shape.width)


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


# ---- single process: restore exactly, loud failures -------------------------------------------


def test_rope_table_of_wrong_length_raises():
    model, inputs = _build(Shape("5b", 3, 6, 6))
    cos, sin = inputs.image_rotary_emb
    inputs.image_rotary_emb = (cos[:-1], sin[:-1])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="image_rotary_emb has 26 rows but the transformer has 27 video tokens"):
            forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_attention_mask_is_refused():
    model, inputs = _build(Shape("2b", 3, 6, 6))
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask"):
            with torch.no_grad():
                model(**inputs.kwargs(), attention_kwargs={"attention_mask": torch.ones(2, 34)})
    finally:
        ADAPTER.disable(model)
