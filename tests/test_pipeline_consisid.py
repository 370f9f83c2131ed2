"""ConsisID adapter: sharded transformer outputs equal the one-process output, on CPU gloo grids.

One spawned group of 4 ranks runs every case (tests/adapter_parity.run_grid_cases). Model: a tiny
ConsisID transformer (usp_dit/demo/tiny_consisid.py), 6 heads (uneven over 4 Ulysses ranks) of dim
16, RoPE table passed in, face conditioning on: the local facial extractor and a perceiver
cross-attention after each of the 2 blocks (queries: the video shard; K/V: the 5 identity tokens),
every weight perturbed. Latents of 27 video tokens (3 x 3 x 3 patches: divides neither 2 nor 4) and
24, batch 2 with different prompts, timesteps and faces. Grids (U, R, cfg): (2,1,1), (1,2,1);
(2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with the "stream" and "gather_merge"
schedules forced. Each case: output vs stock, block 0's attention sees at most ceil(27 / P) video
tokens, bit-identical after disable. Gradients (27 tokens) on (1,2,1) and (2,2,1): per-rank
losses L/P, parameter gradients (the facial extractor's and the perceivers' included) summed over the
sequence group equal the one-process gradients. ``enable_usp`` on (1,2,2): the batch-2 identity
inputs split over "cfg" with the latents. The stock ``ConsisIDPipeline`` (two DPM steps, batched
[uncond, cond] guidance, identity inputs of batch 1 shared by both halves) through
``pipe.enable_usp()`` on (2,1), (2,2) and (2,1,cfg 2) equals one process; ``disable_usp`` gives the
bit-identical video back. ulysses_degree 4 on a 2-head model raises at enable.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, gradients and the
pipeline's final latents: sharding only reorders float32 sums (attention merged by log-sum-exp,
projections on fewer rows, gradients summed over ranks), a few 1e-7 relative at these sizes. The
decoded frames: 1e-4 (an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests import adapter_parity as parity
from usp_dit import disable_usp, enable_usp, init_usp
from usp_dit.demo.tiny_consisid import consisid_inputs, face_inputs, tiny_consisid, tiny_consisid_pipeline
from usp_dit.demo.tiny_video import TEXT_DIM, gradient_image
from usp_dit.pipelines.families.consisid import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    frames: int  # latent sizes
    height: int
    width: int

    @property
    def tokens(self) -> int:
        return self.frames * (self.height // 2) * (self.width // 2)

    def __str__(self) -> str:
        return f"f{self.frames}h{self.height}w{self.width}"


SHAPES = [Shape(3, 6, 6), Shape(2, 8, 6)]  # 27 and 24 video tokens


def _build(shape: Shape):
    model = tiny_consisid()
    return model, consisid_inputs(model, shape.frames, shape.height, shape.width)


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.tokens)


def _cfg_split_case() -> dict[str, float]:
    """``enable_usp`` on (1,2,2): each cfg group runs one batch row, its own face's identity inputs."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    enable_usp(model, mesh=init_usp(1, 2, 2))
    try:
        out = parity.forward(model, inputs)
    finally:
        disable_usp(model)
    return {"out": rel_err(out, ref)}


# ---- the stock pipeline ----------------------------------------------------------------------------

PIPELINE_GRIDS = parity.ci_grids({"pipeline-u2r1": (2, 1, 1), "pipeline-u2r2": (2, 2, 1), "pipeline-u2cfg2": (2, 1, 2)})


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of a 48 x 48 x 9-frame video (27 video tokens), 2 steps, guidance 6
    (batched [uncond, cond]); prompt embeddings seeded (no prompt cleaning dependencies)."""
    g = torch.Generator().manual_seed(1)
    id_cond, id_vit_hidden = face_inputs(1)
    return parity.latents_and(
        pipe, "frames",
        image=gradient_image(48, 48), prompt_embeds=torch.randn(1, 16, TEXT_DIM, generator=g),
        negative_prompt_embeds=torch.randn(1, 16, TEXT_DIM, generator=g), height=48, width=48, num_frames=9,
        num_inference_steps=2, id_cond=id_cond, id_vit_hidden=id_vit_hidden, max_sequence_length=16,
        generator=torch.Generator().manual_seed(0), output_type="pt",
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_consisid_pipeline(), _generate, PIPELINE_GRIDS, names=("latents", "frames"),
                                 check_enabled=False)


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh),
                          {2: [SHAPES[0]], 4: [SHAPES[0]]})
    parity.record(results, "cfg-split", _cfg_split_case)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_consisid(num_heads=2, head_dim=24), ADAPTER,
                                                          init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES[:1]), TOL,
)


def test_identity_inputs_split_over_cfg_with_the_batch(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- the video example's ConsisID option (one process, no grid) ----------------------------------


def test_video_example_consisid_defaults_and_tiny_generation(monkeypatch):
    from tests.test_examples_cli import _example
    from usp_dit.cli.launch import UsageError

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ex = _example("generate_video")
    args = ex.parse_args(["--model", "consisid"])
    assert (args.frames, args.height, args.width, args.degrees) == (9, 96, 144, (1, 1, 1))
    with pytest.raises(UsageError, match="--model-path with --model consisid"):
        ex.parse_args(["--model", "consisid", "--model-path", "."])
    args = ex.parse_args(["--model", "consisid", "--height", "48", "--width", "48", "--steps", "1"])
    frames = ex.generate(ex.load_pipeline(args, torch.device("cpu")), args)
    assert frames.shape == (9, 48, 48, 3) and np.isfinite(frames).all()
