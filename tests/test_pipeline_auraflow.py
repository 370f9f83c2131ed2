"""AuraFlow adapter: sharded transformer outputs equal the one-process output, on CPU gloo grids.

One spawned group of 4 ranks runs every case (tests/adapter_parity.run_grid_cases). Model: a tiny
AuraFlow transformer (usp_dit/demo/tiny_auraflow.py), 2 MMDiT (joint) + 2 single-stream blocks, 6
heads (uneven over 4 Ulysses ranks) of dim 16, 8 register tokens, every weight perturbed (position
table and register tokens included). Latents of 5 x 7 = 35 image tokens (divides neither 2 nor 4;
the position table's centred crop is odd too) and 4 x 6 = 24, batch 2 with different prompts,
timesteps and prompt lengths (9 and 4 real tokens of 9, the padding zeroed as AuraFlowPipeline
zeroes it: the model takes no mask and attends to it, in stock too). Grids (U, R, cfg): (2,1,1),
(1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with the "stream" and
"gather_merge" schedules forced. Each case: output vs stock, block 0's attention sees at most
ceil(35 / P) image tokens (the text is replicated), bit-identical after disable. Gradients (35
tokens) on (1,2,1) and (2,2,1): per-rank losses L/P, parameter gradients (register tokens and
position table included) summed over the sequence group equal the one-process gradients. The
stock ``AuraFlowPipeline`` (two Euler steps, batched [uncond, cond] guidance, two prompts of
different lengths, 20 x 28 pixels = 35 tokens) through ``pipe.enable_usp()`` on (2,1), (2,2) and
(2,1,cfg 2) equals one process; ``disable_usp`` gives the bit-identical images back. ulysses_degree
4 on a 2-head model raises at enable; fused QKV projections are refused. Tensor parallelism (issue
28) on a 5-head model (uneven over 2 tensor ranks): T=2 alone, with U=2, with R=2 (gather_merge),
outputs and the restored parameters; gradients on (R=2, T=2), each cut parameter's gathered back
(tests/test_tensor_parallel.py's cases, reused).

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, gradients and the
pipeline's final latents: sharding only reorders float32 sums (attention merged by log-sum-exp,
projections on fewer rows, gradients summed over ranks), a few 1e-7 relative at these sizes. The
decoded images: 1e-4 (an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_auraflow import auraflow_inputs, tiny_auraflow, tiny_auraflow_pipeline
from usp_dit.pipelines.families.auraflow import ADAPTER

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int  # latent pixels
    width: int

    @property
    def tokens(self) -> int:
        return (self.height // 2) * (self.width // 2)

    def __str__(self) -> str:
        return f"h{self.height}w{self.width}"


SHAPES = [Shape(10, 14), Shape(8, 12)]  # 35 and 24 image tokens


def _build(shape: Shape):
    model = tiny_auraflow()
    return model, auraflow_inputs(model, shape.height, shape.width, valid=[9, 4])


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.joint_transformer_blocks[0].attn,
                                      shape.tokens)


# ---- the stock pipeline ----------------------------------------------------------------------------

PIPELINE_GRIDS = parity.ci_grids({"pipeline-u2r1": (2, 1, 1), "pipeline-u2r2": (2, 2, 1), "pipeline-u2cfg2": (2, 1, 2)})


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of two prompts of different lengths at 20 x 28 pixels (35 tokens),
    2 steps, guidance 3.5 (batched [uncond, cond])."""
    return parity.latents_and(
        pipe,
        prompt=["a red cat on a mat", "a dog"], negative_prompt=["blurry", ""], height=20, width=28,
        num_inference_steps=2, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_auraflow_pipeline(), _generate, PIPELINE_GRIDS, names=("latents", "images"),
                                 check_enabled=False)


# Tensor parallelism (issue 28), 5 heads (uneven over 2 tensor ranks): (U, R, cfg, T, schedule).
TENSOR_GRIDS = [(1, 1, 1, 2, "auto"), (2, 1, 1, 2, "auto"), (1, 2, 1, 2, "gather_merge")]


def _tensor_cases() -> dict[str, dict[str, float]]:
    from tests import test_tensor_parallel as tp

    model = tiny_auraflow(num_heads=5)
    args = tp.Args(auraflow_inputs(model, 10, 14, valid=[9, 4]).kwargs())
    results = {f"tensor-{g}": tp._output_case(model, args, g) for g in TENSOR_GRIDS}
    results["grad-tensor-(1,2,1,2)"] = tp._grad_case(model, args, (1, 2, 1, 2, "stream"))
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.record(results, "tensor", _tensor_cases, many=True)
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh),
                          {2: [SHAPES[0]], 4: [SHAPES[0]]})
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_auraflow(num_heads=2, head_dim=16), ADAPTER,
                                                          init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES[:1]), TOL,
)


@pytest.mark.parametrize("key", [f"tensor-{g}" for g in TENSOR_GRIDS] + ["grad-tensor-(1,2,1,2)"])
def test_tensor_parallel_matches_one_process(grid_results, key: str):
    for rank, res in enumerate(grid_results):
        errors = res.get(key) or res.get("tensor", "no result")
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {k: v for k, v in errors.items() if k not in ("local_heads", "single_widths") and not k.startswith("worst_is_") and not v <= TOL}
        assert not worst, f"rank {rank}: above {TOL}: {worst}"


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_images(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process ------------------------------------------------------------------------------


def test_fused_qkv_projections_are_refused():
    model = tiny_auraflow()
    model.fuse_qkv_projections()
    with pytest.raises(NotImplementedError, match="FusedAuraFlowAttnProcessor2_0"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_image_example_auraflow_defaults_and_tiny_generation(monkeypatch):
    from tests.test_examples_cli import _example

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ex = _example("generate_image")
    args = ex.parse_args(["--family", "auraflow", "--steps", "1"])
    assert (args.height, args.width) == (20, 28)
    images = ex.generate(ex.load_pipeline(args, torch.device("cpu")), args)
    assert images.shape == (1, 20, 28, 3) and np.isfinite(images).all()
