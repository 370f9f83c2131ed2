"""CogVideoX adapter: sharded transformer outputs equal the one-process output, on CPU gloo grids.

One spawned group of 4 ranks runs every case (tests/adapter_parity.run_grid_cases; process start-up
is the slow part); the 2-rank grids run on it as two data-parallel replicas of 2 ranks each. Models:
tiny 2B (sin-cos table), 5B (RoPE passed in) and 1.5 image-to-video (temporal patches, ofs)
transformers, 6 heads (uneven over 4 Ulysses ranks) of dim 16, on latents of 27 or 18 video tokens
(do not divide 2 or 4) and 24 or 12 (do), batch 2. Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1),
(4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS); each ring grid also with the "stream" and
"gather_merge" schedules forced. Each case: each rank computes the stock model's output itself
first (the one-process result), then enables the adapter, runs, disables and runs again: output vs
stock, block 0's attention sees at most ceil(video tokens / P) video tokens (the text is
replicated), and the last run must be bit-identical to the first. Gradient cases (5B, 27 tokens)
on (1,2,1) and (2,2,1) check fine-tuning: per-rank losses L/P, parameter gradients summed over the
sequence group equal the one-process gradients. ulysses_degree 4 on a 2-head model raises at
enable. The 8-rank grids are in tests/test_world8.py.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar). Sharding changes only the
order of float32 sums (attention split in blocks merged by log-sum-exp, projections on fewer
rows), which moves results by a few 1e-7 relative on these sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_video import cogvideox_inputs, tiny_cogvideox
from usp_dit.pipelines.families.cogvideox import ADAPTER

TOL = 1e-5
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas


@dataclass(frozen=True)
class Shape:
    variant: str
    frames: int  # latent sizes
    height: int
    width: int

    @property
    def tokens(self) -> int:
        """Video tokens (patch 2, the 1.5 variant's temporal patch 2)."""
        p_t = 2 if self.variant == "1.5-i2v" else 1
        return (self.frames // p_t) * (self.height // 2) * (self.width // 2)

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
    two_heads = tiny_cogvideox(num_heads=2)
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


# ---- single process: restore exactly, loud failures -------------------------------------------


def test_rope_table_of_wrong_length_raises():
    model, inputs = _build(Shape("5b", 3, 6, 6))
    cos, sin = inputs.image_rotary_emb
    inputs.image_rotary_emb = (cos[:-1], sin[:-1])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="image_rotary_emb has 26 rows but the transformer has 27 video tokens"):
            parity.forward(model, inputs)
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
