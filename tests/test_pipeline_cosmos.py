"""Cosmos adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (tests/adapter_parity.run_grid_cases); the 2-rank grids
run on it as two data-parallel replicas. Models (usp_dit/demo/tiny_cosmos.py): tiny 2-layer
``CosmosTransformer3DModel`` s, 4 heads x 16, every weight perturbed (the learnable positional
tables too), in three variants: Cosmos 1 (learnable positional embedding beside the RoPE,
fps-scaled RoPE), Predict2 video-to-world (a condition mask on channels and one random timestep
per latent frame: per-token modulation) and an image-context model (attn2's
``CosmosAttnProcessor2_5``, a second cross-attention to image tokens). Latents of 27 and 45 video
tokens (divide neither 2 nor 4) and 24 (do), batch 2 with different prompts, timesteps and text
mask lengths (9 and 4 valid of 9). Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1),
(1,2,2), each ring grid also with the "stream" and "gather_merge" schedules forced (Note
[schedules in CI]). Each case: output vs stock, block 0's self-attention sees at most
ceil(tokens / P) tokens, bit-identical after ``disable``. Gradients (Cosmos 1 and Predict2) on
(1,2,1) and (2,2,1), and with gradient checkpointing on (2,2,1): per-rank losses L / P, parameter
gradients summed over the sequence group equal one process's. Each rank's rotated Q/K of block 0
equal the same rows of one process's. The stock ``Cosmos2TextToImagePipeline`` (T5, Wan VAE, a
pass-through safety checker; two prompts, two calls a step, 2 steps, 80 x 48 = 15 tokens), final
latents through ``pipe.enable_usp()`` on (2,1), (2,2) and (2,1,cfg 2) equal one process, the cfg
grid computing ``steps + 1`` calls per rank (the two calls of a step paired); ``disable_usp`` gives
them back bit for bit. ulysses_degree 4 on a 2-head model, ControlNet residuals and a non-stock
processor are refused.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, gradients, rotated
Q/K and the pipeline's latents: sharding only reorders float32 sums (attention merged by
log-sum-exp, projections on fewer rows, gradients summed over ranks), a few 1e-7 relative here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers.models.transformers import transformer_cosmos

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_cosmos import cosmos_inputs, tiny_cosmos, tiny_cosmos2_text2image_pipeline
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families.cosmos import ADAPTER, USPCosmosAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4
STEPS = 2


@dataclass(frozen=True)
class Shape:
    variant: str
    frames: int  # latent sizes
    height: int
    width: int

    @property
    def tokens(self) -> int:
        return self.frames * (self.height // 2) * (self.width // 2)

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("cosmos1", 3, 6, 6),  # 27 video tokens
    Shape("predict2-v2w", 3, 6, 10),  # 45, one timestep per latent frame
    Shape("img-context", 2, 8, 6),  # 24
    Shape("cosmos1", 3, 6, 10),  # 45
]
GRAD_SHAPES = [SHAPES[0], SHAPES[1]]


def _build(shape: Shape):
    model = tiny_cosmos(shape.variant)
    return model, cosmos_inputs(model, shape.frames, shape.height, shape.width)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with ``enable_gradient_checkpointing()`` (per-frame timesteps): block 0's recompute
    re-shards its saved full input, and the pre-hooks cut the per-token arguments again."""
    model, inputs = _build(SHAPES[1])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _first_call_qk(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) of the first ``module.name`` call of a forward (block 0's attn1), each (B, S | S_local, H, D)."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Block 0's rotated Q/K on each rank equal the same rows of one process's (Cosmos 1: RoPE with fps)."""
    model, inputs = _build(SHAPES[0])
    q_ref, k_ref = _first_call_qk(model, inputs, transformer_cosmos, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_call_qk(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


# ---- the stock pipeline ----------------------------------------------------------------------------

PIPELINE_GRIDS = parity.ci_grids({"pipeline-u2r1": (2, 1, 1), "pipeline-u2r2": (2, 2, 1), "pipeline-u2cfg2": (2, 1, 2)})


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, the latent output) of two prompts at 80 x 48 (15 tokens), 2 steps, guidance 7."""
    return parity.latents_and(
        pipe, prompt=["a red fox jumps over a log", "a cat"], negative_prompt=["blurry", "dark"], height=80,
        width=48, num_inference_steps=STEPS, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
        output_type="latent",
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    probe = functools.partial(parity.cfg_pair_computations, steps=STEPS)
    return parity.pipeline_cases(tiny_cosmos2_text2image_pipeline(), _generate, PIPELINE_GRIDS,
                                 names=("latents", "images"),
                                 probe=lambda pipe, grid: probe(pipe, grid))


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh),
                          {2: GRAD_SHAPES, 4: GRAD_SHAPES})
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_cosmos(num_heads=2, head_dim=16), ADAPTER,
                                                          init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(GRAD_SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"computations_not_steps_plus_1": 0.0}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_latents(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: restore exactly, refusals ------------------------------------------------------


def test_disable_restores_and_one_rank_is_bit_identical():
    model, inputs = _build(SHAPES[1])
    before = {id(m.processor) for m in model.modules() if hasattr(m, "processor")}
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    assert all(isinstance(b.attn1.processor, USPCosmosAttnProcessor) for b in model.transformer_blocks)
    assert all(id(b.attn2.processor) in before for b in model.transformer_blocks)  # local: stock kept
    ADAPTER.disable(model)
    assert {id(m.processor) for m in model.modules() if hasattr(m, "processor")} == before
    hooked = [type(m).__name__ for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not hooked, f"hooks left on {hooked}"
    parity.assert_one_rank_bit_identical(model, inputs, ADAPTER)


def test_controlnet_residuals_are_refused_at_the_call():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="block_controlnet_hidden_states"):
            model(**inputs.kwargs(), block_controlnet_hidden_states=[torch.zeros(2, 27, 64)], return_dict=False)
    finally:
        ADAPTER.disable(model)


test_a_processor_other_than_the_stock_one_is_refused = family_checks.foreign_processor_refused(
    lambda: _build(SHAPES[0])[0], ADAPTER, "transformer_blocks.0.attn2", AttnProcessor2_0)
