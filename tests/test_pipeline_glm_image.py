"""GLM-Image adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo
grids; the stock ``GlmImagePipeline`` through ``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``GlmImageTransformer2DModel`` (2 layers, 4 heads x 16, every weight
perturbed; ``usp_dit.demo.tiny_glm_image``). Shapes: 3 x 5 = 15 and 5 x 7 = 35 image tokens
(neither divides 2 or 4), batch 2 with different latents, glyph texts, priors (the second
element's partly dropped), timesteps and crops; the first shape with a text mask of different
valid lengths per element (2 and 5 of 5: GLM-Image's mask is a bias, cogview4 Note [CogView4's
mask is a bias]), the second without (the pipeline's call). The text is replicated, the RoPE table
cut like the image tokens (``usp_dit.pipelines.families.glm_image``).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil(N / P) image tokens (the text is a separate
argument), after ``disable`` the output is bit-identical. Per shape, on 2 and 4 ranks: every
parameter's gradient; once with gradient checkpointing. The fullgraph-compiled case is in
tests/test_compile_grid.py (ADAPTER_CASES).

Pipeline: the tiny ``GlmImagePipeline`` (a 2x VAE and the transformer built in code; no AR model
or glyph encoder: the pipeline's own precomputed path, ``prior_token_ids``, ``prompt_embeds`` and
``negative_prompt_embeds``), batch 2, 24 x 28 (6 x 7 = 42 image tokens: the pipeline takes
heights in multiples of 8 here), true CFG (two calls a step: glyph text and priors, then the
negative text with every prior dropped), 2 steps, on (2,1,1), (2,2,1) and (1,2,2) (a step's two
calls on the two cfg groups at once), equal to one process's, and bit-identical after
``disable_usp``. Image-to-image (``kv_caches`` in write / read mode) is refused.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks). Decoded images: 1e-4 (an untrained random VAE's gain).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_glm_image import CODEBOOK, TEXT_DIM, glm_image_inputs, tiny_glm_image, tiny_glm_image_pipeline
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.families.glm_image import ADAPTER, USPGlmImageAttnProcessor
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int
    width: int
    text_lens: tuple[int, ...]
    masked: bool

    @property
    def tokens(self) -> int:
        return self.height * self.width

    def __str__(self) -> str:
        return f"{self.height}x{self.width}-t{'-'.join(map(str, self.text_lens))}"


SHAPES = [
    Shape(3, 5, (2, 5), True),  # 15 image tokens, a text mask (a bias) differing per element
    Shape(5, 7, (4, 4), False),  # 35 image tokens, no mask (the pipeline's call)
]


def _build(shape: Shape, seed: int = 0):
    return tiny_glm_image(seed=seed), glm_image_inputs(shape.height, shape.width, shape.text_lens, shape.masked)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 24 x 28 (6 x 7 = 42 image tokens), true CFG, seed 0."""
    last = {}

    def keep_latents(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return {}

    g = torch.Generator().manual_seed(1)
    prompt_embeds, negative_embeds = torch.randn(2, 2, 6, TEXT_DIM, generator=g)
    images = pipe(
        prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_embeds,
        prior_token_ids=torch.randint(0, CODEBOOK, (2, 42), generator=g), guidance_scale=1.5, height=24, width=28,
        num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt",
        callback_on_step_end=keep_latents,
    ).images
    return last["latents"], images


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_glm_image_pipeline()
    pipe.set_progress_bar_config(disable=True)
    ref_latents, ref_images = _generate(pipe)
    results = {}
    for u, r, c in PIPELINE_GRIDS:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe.transformer)
        try:
            latents, images = _generate(pipe)
        finally:
            pipe.disable_usp()
        results[f"pipeline-u{u}r{r}cfg{c}"] = {
            "not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe.transformer)),
            "latents": rel_err(latents, ref_latents),
            "images": rel_err(images, ref_images),
        }
    again_latents, again_images = _generate(pipe)
    same = torch.equal(again_latents, ref_latents) and torch.equal(again_images, ref_images)
    results["pipeline-after-disable"] = {"not_bit_identical": float(not same)}
    return results


def _run_all() -> dict[str, dict | str]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    for rank, res in enumerate(grid_results):
        errors = res.get(key) or res.get("pipeline", "no result")
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        tols = {name: TOL_IMAGES if name == "images" else TOL for name in errors}
        worst = {name: v for name, v in errors.items() if not v <= tols[name]}
        assert not worst, f"rank {rank}: above {tols}: {worst}"


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: registration, restore exactly, loud failures ---------------------------------


test_find_adapter_finds_glm_image = family_checks.adapter_found(tiny_glm_image, ADAPTER)


test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPGlmImageAttnProcessor)


test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_glm_image, ADAPTER, "transformer_blocks.1.attn1")


@pytest.mark.parametrize("mode", ["write", "read"])
def test_image_to_image_kv_caches_are_refused_at_the_call(mode: str):
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    model, inputs = _build(SHAPES[0])
    caches = GlmImageKVCache(num_layers=2)
    caches.set_mode(mode)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match=f"does not shard kv_caches in mode \\['{mode}'\\]"):
            model(**inputs.kwargs(), kv_caches=caches)
    finally:
        ADAPTER.disable(model)


def test_a_callers_rope_table_is_refused():
    model, inputs = _build(SHAPES[0])
    table = model.rope(inputs.hidden_states)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="does not shard image_rotary_emb"):
            model(**inputs.kwargs(), image_rotary_emb=table)
    finally:
        ADAPTER.disable(model)


test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(
    tiny_glm_image, ADAPTER, "GlmImage")
