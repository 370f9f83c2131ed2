"""Ovis-Image adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo
grids; the stock ``OvisImagePipeline`` through ``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``OvisImageTransformer2DModel`` (2 double + 2 single blocks, 4 heads x 16,
SwiGLU MLPs, every weight perturbed; ``usp_dit.demo.tiny_ovis_image``). The text is split with the
image (``usp_dit.pipelines.families.ovis_image``): shapes 6 text + 15 image = 21 tokens, 6 + 21 =
27 and 8 + 25 = 33; no joint count divides 2 or 4; on 4 ranks rank 0 of the first holds the 6 text
tokens beside none or few image tokens. Batch 2 with different prompts, latents and timesteps;
ids as the pipeline makes them, so RoPE rotates real positions. The model takes no mask (the
pipeline zeroes its padding rows and attends them all), so there is no mask case; an
``attention_mask`` through ``joint_attention_kwargs`` is refused.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil((T + N) / P) tokens (text + image), after
``disable`` the output is bit-identical. Per shape, on 2 and 4 ranks: every parameter's gradient,
and once with gradient checkpointing. The transformer enabled with cfg_degree=2 on a batch of 2
equals stock. The fullgraph-compiled case is in tests/test_compile_grid.py (ADAPTER_CASES).

Pipeline: the tiny ``OvisImagePipeline`` (character tokenizer with a chat template, a 2-layer
Qwen3, a 2x VAE, all built in code), two prompts of different lengths and negative prompts (true
CFG: two transformer calls a step), 11 text tokens, 12 x 20 (15 image tokens), 2 steps, on
(2,1,1), (2,2,1) and (1,2,2) (step 1's calls split the batch over the cfg groups; step 2's calls
paired on the two groups), equal to one process's, and bit-identical after ``disable_usp``.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks). Decoded images: 1e-4 (an untrained random VAE's gain). Measured (2026-12-05): every case within
the tolerances above (2 cores, 4 ranks, 40 s).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_ovis_image import ovis_image_inputs, tiny_ovis_image, tiny_ovis_image_pipeline
from usp_dit.pipelines.families.ovis_image import ADAPTER, USPOvisImageAttnProcessor

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int
    width: int
    text_len: int

    @property
    def tokens(self) -> int:
        return self.text_len + self.height * self.width

    def __str__(self) -> str:
        return f"s{self.tokens}"


SHAPES = [
    Shape(3, 5, 6),  # 6 + 15 = 21
    Shape(3, 7, 6),  # 6 + 21 = 27
    Shape(5, 5, 8),  # 8 + 25 = 33
]


def _build(shape: Shape, seed: int = 0):
    return tiny_ovis_image(seed=seed), ovis_image_inputs(shape.height, shape.width, shape.text_len)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.joint_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2 (usp_dit.enable_usp): its batch of 2 split over the cfg groups."""
    return parity.cfg_split_case(*_build(SHAPES[1]), mesh)


PROMPTS = (["a red fox", "cat"], ["blurry", "dark dim"])  # of different lengths: padded (rows zeroed)


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 12 x 20 (3 x 5 = 15 image tokens), 11 text tokens,
    true CFG (two transformer calls a step), seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(
        pipe,
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.0, max_sequence_length=11, height=12,
        width=20, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt",
    )


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_ovis_image_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS))


def _run_all() -> dict[str, dict | str]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_cfg_split_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: registration, restore exactly, loud failures ---------------------------------


test_find_adapter_finds_ovis_image = family_checks.adapter_found(tiny_ovis_image, ADAPTER)
test_disable_restores_processors_forward_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPOvisImageAttnProcessor)
test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_ovis_image, ADAPTER, "transformer_blocks.1.attn")


def test_processor_swapped_after_enable_is_refused_at_the_call():
    from diffusers.models.transformers.transformer_ovis_image import OvisImageAttnProcessor

    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        model.single_transformer_blocks[0].attn.set_processor(OvisImageAttnProcessor())
        with pytest.raises(NotImplementedError, match="became OvisImageAttnProcessor after enable_usp"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_an_attention_mask_is_refused():
    model, inputs = _build(SHAPES[0])
    kwargs = {**inputs.kwargs(), "joint_attention_kwargs": {"attention_mask": torch.ones(2, 21, dtype=torch.bool)}}
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="does not support attention_mask"):
            model(**kwargs)
    finally:
        ADAPTER.disable(model)


# No TensorPlan (the single blocks split their fused projection by the whole mlp_hidden_dim):
# the check enable_usp makes before anything changes refuses tensor_degree > 1, naming the family.
test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(
    tiny_ovis_image, ADAPTER, "OvisImage")
