"""CogView4 and CogView3-Plus adapters: sharded outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids as two data-parallel replicas).
Models: tiny 2-layer ``CogView4Transformer2DModel`` and ``CogView3PlusTransformer2DModel`` (4 heads x
16, every weight perturbed; ``usp_dit.demo.tiny_cogview4``). Shapes: CogView4 at 3 x 5 = 15 patches
with a text ``attention_mask`` of 3 and 7 valid tokens out of 7 per element (Note [CogView4's mask
is a bias]: padded keys down-weighted, not removed, so every text row matters), CogView4 at 3 x 3 = 9
patches with no mask (the pipelines' call), CogView3-Plus at 3 x 5. No token count divides 2 or 4;
batch 2 with different prompts, timesteps and size conditions; the RoPE is the model's own.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with the
"stream" and "gather_merge" schedules forced. Each case: output vs stock, block 0's attention sees at
most ceil(tokens / P) image tokens, after ``disable`` the output is bit-identical. Every parameter's
gradient on 2 and 4 ranks per shape, and with gradient checkpointing (masked CogView4). The tiny
``CogView4Pipeline`` (GLM text encoder, two prompts of different lengths and negative prompts of
other lengths: left-padded to 16 tokens each, true CFG, two calls of batch 2 per step) through
``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2), 2 steps, and with one prompt and
``cfg_degree=2`` (its two calls a step on the two cfg groups); ``CogView4ControlPipeline`` on (2,2,1);
bit-identical after ``disable_usp``. Refusals: a caller's ``image_rotary_emb``, a mask that is not an
outer product, ``CogView4TrainingAttnProcessor``. The fullgraph-compiled case is in
tests/test_compile_grid.py (ADAPTER_CASES: cogview4 on (2,2), the masked shape).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipelines' latents:
sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients summed over
ranks; the mask's bias is one more product in each score's sum). Decoded images: 1e-4 (an untrained
random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from diffusers.models.transformers.transformer_cogview4 import CogView4TrainingAttnProcessor

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_cogview4 import cogview_inputs, tiny_cogview3plus, tiny_cogview4, tiny_cogview4_pipeline
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.families.cogview4 import ADAPTER, ADAPTER_3PLUS
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    model: str  # "cogview4" or "cogview3plus"
    height: int  # patches
    width: int
    valid: tuple | None  # real text tokens per element (of 7), or None: no mask

    def __str__(self) -> str:
        return f"{self.model}-s{self.height * self.width}" + ("-masked" if self.valid else "")


SHAPES = [Shape("cogview4", 3, 5, (3, 7)), Shape("cogview4", 3, 3, None), Shape("cogview3plus", 3, 5, None)]


def _build(shape: Shape, seed: int = 0):
    model = (tiny_cogview4 if shape.model == "cogview4" else tiny_cogview3plus)(seed=seed)
    return model, cogview_inputs(shape.height, shape.width, list(shape.valid) if shape.valid else None)


def _adapter(shape: Shape):
    return ADAPTER if shape.model == "cogview4" else ADAPTER_3PLUS


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    tokens = shape.height * shape.width
    return parity.sharded_output_case(model, inputs, _adapter(shape), mesh, model.transformer_blocks[0].attn1, tokens)


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    model, inputs = _build(shape)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, _adapter(shape), mesh)


PROMPTS = (["a red fox jumps over", "a cat"], ["blurry", "dark, dim, low quality, bad hands"])


def _generate(pipe, prompts: tuple = PROMPTS, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 48 x 80 (3 x 5 = 15 image tokens), true CFG, seed 0."""
    prompt, negative_prompt = prompts
    torch.manual_seed(0)  # CogView4ControlPipeline samples the control latents from the global generator
    return parity.latents_and(
        pipe,
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.0, height=48, width=80,
        num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs,
    )


def _pipeline_runs(pipe, grids: list, prompts: tuple = PROMPTS, **kwargs) -> dict[str, dict[str, float]]:
    """Each grid's final latents and images against one process's (computed once), then the run
    after ``disable_usp`` against it bit for bit."""
    ref_latents, ref_images = _generate(pipe, prompts, **kwargs)
    results = {}
    for u, r, c in grids:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe.transformer)
        try:
            latents, images = _generate(pipe, prompts, **kwargs)
        finally:
            pipe.disable_usp()
        results[(u, r, c)] = {
            "not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe.transformer)),
            "latents": rel_err(latents, ref_latents),
            "images": rel_err(images, ref_images),
        }
    again_latents, _ = _generate(pipe, prompts, **kwargs)
    results[grids[-1]]["not_bit_identical_after_disable"] = float(not torch.equal(again_latents, ref_latents))
    return results


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last: the first step's calls split over cfg


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_cogview4_pipeline()
    pipe.set_progress_bar_config(disable=True)
    runs = _pipeline_runs(pipe, PIPELINE_GRIDS)
    results = {f"pipeline-u{u}r{r}cfg{c}": runs[(u, r, c)] for u, r, c in PIPELINE_GRIDS}
    # one prompt: the two calls of a step (batch 1 each) on the two cfg groups (cfg_pair)
    results["pipeline-cfg2"] = _pipeline_runs(pipe, [(1, 1, 2)], ("a red fox", "blurry and dark"))[(1, 1, 2)]
    control = tiny_cogview4_pipeline(control=True)
    control.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, 48, 80, generator=torch.Generator().manual_seed(5))
    results["pipeline-control-u2r2cfg1"] = _pipeline_runs(control, [(2, 2, 1)], control_image=image)[(2, 2, 1)]
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[0], init_usp(2, 2), checkpointing=True))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


PIPELINE_KEYS = [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS] + [
    "pipeline-cfg2", "pipeline-control-u2r2cfg1"]


@pytest.mark.parametrize("key", PIPELINE_KEYS)
def test_pipeline_matches_one_process_and_disable_restores_it(grid_results, key: str):
    tols = {"images": TOL_IMAGES, "not_bit_identical_after_disable": 0.0, "not_enabled_then_restored": 0.0}
    for rank, res in enumerate(grid_results):
        errors = res.get(key) or res.get("pipeline", "no result")
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {name: v for name, v in errors.items() if not v <= tols.get(name, TOL)}
        assert not worst, f"rank {rank}: {key}: above {tols} (else {TOL}): {worst}"


# ---- single process: registration, loud failures ---------------------------------------------------


def test_a_caller_rope_table_is_refused():
    model, inputs = _build(SHAPES[0])
    table = model.rope(inputs.hidden_states)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="image_rotary_emb"):
            model(**inputs.kwargs(), image_rotary_emb=table)
    finally:
        ADAPTER.disable(model)


def test_a_mask_that_is_not_an_outer_product_is_refused():
    from usp_dit.pipelines.families.cogview4 import _key_weights

    mask = torch.ones(1, 1, 4, 4)
    mask[0, 0, 1, 2] = 0
    with pytest.raises(NotImplementedError, match="not one"):
        _key_weights(mask)
    with pytest.raises(NotImplementedError, match="routes the stock"):
        _key_weights(torch.ones(1, 4, 4))


test_the_training_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_cogview4, ADAPTER, "transformer_blocks.0.attn1", CogView4TrainingAttnProcessor)


def test_the_mask_bias_is_exact_on_one_rank():
    """Note [CogView4's mask is a bias] on one process: the routed masked call equals stock."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    assert rel_err(out, ref) <= TOL


def test_the_image_example_builds_and_runs_the_tiny_cogview4():
    """examples/generate_image.py --family cogview4: its tiny default pipeline on one process (1 step)."""
    from tests.test_examples_cli import _example

    ex = _example("generate_image")
    args = ex.parse_args(["--family", "cogview4", "--steps", "1", "--height", "48", "--width", "80"])
    images = ex.generate(ex.load_pipeline(args, torch.device("cpu")), args)
    assert images.shape == (1, 48, 80, 3) and bool((images >= 0).all() and (images <= 1).all())
