"""ERNIE-Image adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo
grids; the stock ``ErnieImagePipeline`` through ``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``ErnieImageTransformer2DModel`` (2 layers, 4 heads x 16, every weight
perturbed, the stock zero-initialised ones too; ``usp_dit.demo.tiny_ernie_image``). Shapes: 3 x 5
= 15 and 5 x 7 = 35 image tokens (neither divides 2 or 4), batch 2 with different latents and
timesteps and prompts of different valid lengths (2 and 5 of 5 rows: the key mask differs per
element; 4 and 4: no padding), RoPE from the model's own positions (the image's depend on each
element's text length). The text is replicated, ``[image shard; text]`` on each rank
(``usp_dit.pipelines.families.ernie_image`` Note [ERNIE-Image's sequence]).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil(N / P) image tokens beside the T text tokens, after
``disable`` the output is bit-identical. Per shape, on 2 and 4 ranks: every parameter's gradient;
once with gradient checkpointing. The transformer enabled with cfg_degree=2 on a batch of 2 equals
stock. The fullgraph-compiled case is in tests/test_compile_grid.py (ADAPTER_CASES).

Pipeline: the tiny ``ErnieImagePipeline`` (character tokenizer, a 3-layer Mistral-3 text model, a
2x Flux.2 VAE, all built in code), two prompts and two negative prompts of different lengths
(batched CFG: [uncond; cond] in one call, padded to the longest, masked), 20 x 28 (35 image
tokens), 2 steps, on (2,1,1), (2,2,1) and (1,2,2) (the batch of 4 split over the cfg groups), equal
to one process's, and bit-identical after ``disable_usp``.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks). Decoded images: 1e-4 (an untrained random VAE's gain).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch

import usp_dit
from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_ernie_image import ernie_image_inputs, tiny_ernie_image, tiny_ernie_image_pipeline
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.families.ernie_image import ADAPTER, USPErnieImageAttnProcessor
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int
    width: int
    text_lens: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.height * self.width

    def __str__(self) -> str:
        return f"{self.height}x{self.width}-t{'-'.join(map(str, self.text_lens))}"


SHAPES = [
    Shape(3, 5, (2, 5)),  # 15 image tokens, padded prompts: masks differ per element
    Shape(5, 7, (4, 4)),  # 35 image tokens, no padding
]


def _build(shape: Shape, seed: int = 0):
    return tiny_ernie_image(seed=seed), ernie_image_inputs(shape.height, shape.width, shape.text_lens)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.layers[0].self_attention, shape.tokens,
                                      replicated=max(shape.text_lens))


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2 (usp_dit.enable_usp): its batch of 2 split over the cfg groups."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    usp_dit.enable_usp(model, mesh=mesh)
    try:
        out = parity.forward(model, inputs)
    finally:
        usp_dit.disable_usp(model)
    return {"out": rel_err(out, ref)}


PROMPTS = (["a red fox", "cat"], ["blurry", "dark and dim"])  # of different lengths: padded, masked


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 20 x 28 (5 x 7 = 35 image tokens), batched CFG, seed 0."""
    last = {}

    def keep_latents(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return {}

    prompt, negative_prompt = PROMPTS
    images = pipe(
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.0, height=20, width=28,
        num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt", use_pe=False,
        callback_on_step_end=keep_latents,
    ).images
    return last["latents"], images


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_ernie_image_pipeline()
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
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL)


def test_cfg_split_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


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


test_find_adapter_finds_ernie_image = family_checks.adapter_found(tiny_ernie_image, ADAPTER)


test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPErnieImageAttnProcessor)


test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_ernie_image, ADAPTER, "layers.1.self_attention")


def test_processor_swapped_after_enable_is_refused_at_the_call():
    from diffusers.models.transformers.transformer_ernie_image import ErnieImageSingleStreamAttnProcessor

    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        model.layers[0].self_attention.set_processor(ErnieImageSingleStreamAttnProcessor())
        with pytest.raises(NotImplementedError, match="became ErnieImageSingleStreamAttnProcessor after enable_usp"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(
    tiny_ernie_image, ADAPTER, "ErnieImage")
