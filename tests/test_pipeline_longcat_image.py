"""LongCat-Image adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo
grids; the stock ``LongCatImagePipeline`` and ``LongCatImageEditPipeline`` through ``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``LongCatImageTransformer2DModel`` (2 double + 2 single blocks, 4 heads x
16, every weight perturbed; ``usp_dit.demo.tiny_longcat_image``). The text is split with the image
(``usp_dit.pipelines.families.longcat_image``): shapes 6 text + 15 image = 21 tokens, 6 + 21 = 27,
and the edit call's 7 text + 15 target + 15 condition image tokens = 37; no joint count divides 2
or 4. Batch 2 with different prompts, latents and timesteps; ids as the pipelines make them
(modality, row, col), so RoPE rotates real positions. The model takes no mask (the pipelines pad
every prompt and attend it all), so there is no mask case.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil((T + N) / P) tokens (text + image), after
``disable`` the output is bit-identical. Per shape, on 2 and 4 ranks: every parameter's gradient,
and once with gradient checkpointing. The transformer enabled with cfg_degree=2 on a batch of 2
equals stock; tensor parallelism (T2: Flux.1's cuts) equals stock and leaves the weights as found.
The fullgraph-compiled case is in tests/test_compile_grid.py (ADAPTER_CASES).

Pipelines (tiny, built in code: character tokenizer, a 2-layer Qwen2.5-VL with a 1-layer vision
tower, a 64x VAE), 2 steps, true CFG (two transformer calls a step):
- ``LongCatImagePipeline``, two prompts and negative prompts, 384 x 640 (15 image tokens) and 12
  text tokens, on (2,1,1), (2,2,1) and (1,2,2) (step 1's two calls each split the batch over the
  cfg groups; step 2's calls paired on the two groups), and bit-identical after ``disable_usp``;
- ``LongCatImageEditPipeline``, one prompt, a 21 x 8 input image (1664 x 640: 65 target + 65
  condition tokens, split with the text), on (2,2,1) and (1,2,2) (the two calls paired).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipelines' final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks, tensor-parallel partial products all-reduced). Decoded images: 1e-3, and the
edit pipeline's latents 1e-4: the VAE (7 levels: the edit pipeline works at ~1024 x 1024 pixels)
is split over the ranks too, see TOL_IMAGES. Measured (2026-12-05): 4.5e-7 with the cfg split, 1.8e-6 on the worst parameter gradient (2 ranks),
1.4e-6 with checkpointing; every case within the tolerances above (2 cores, 4 ranks, 61 s).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

import usp_dit
from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_longcat_image import longcat_image_inputs, tiny_longcat_image, tiny_longcat_image_pipeline
from usp_dit.pipelines.families.longcat_image import ADAPTER, USPLongCatImageAttnProcessor
from usp_dit.testing import rel_err

TOL = 1e-5
# The pipelines' VAE is split too (usp_dit.pipelines.vae): 7 levels of GroupNorm statistics
# all-reduced over the ranks, at random weights, give 3.6e-5 on a decode alone (1e-6 for the
# 2-level VAEs of the other image tests). The edit pipeline also encodes its input image split,
# so its condition tokens, and with them its latents, carry that error (amplified by CFG 4).
TOL_IMAGES = 1e-3
TOL_EDIT_LATENTS = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int
    width: int
    text_len: int
    condition: bool  # the edit pipeline's condition image tokens (as many as the target's) after the target's

    @property
    def tokens(self) -> int:
        return self.text_len + self.height * self.width * (2 if self.condition else 1)

    def __str__(self) -> str:
        return f"s{self.tokens}" + ("-edit" if self.condition else "")


SHAPES = [
    Shape(3, 5, 6, False),  # 6 + 15 = 21
    Shape(3, 7, 6, False),  # 6 + 21 = 27
    Shape(3, 5, 7, True),  # 7 + 15 + 15 = 37: rank 0 of 4 holds 7 text + 3 target tokens
]


def _build(shape: Shape, seed: int = 0):
    return tiny_longcat_image(seed=seed), longcat_image_inputs(shape.height, shape.width, shape.text_len,
                                                               condition=shape.condition)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.joint_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _enabled_case(mesh, shape: Shape = SHAPES[2]) -> dict[str, float]:
    """The transformer enabled through ``usp_dit.enable_usp`` (the cfg axis splits its batch of 2;
    the tensor axis cuts its blocks): equal to stock, its weights left as found."""
    model, inputs = _build(shape)
    ref = parity.forward(model, inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    usp_dit.enable_usp(model, mesh=mesh)
    try:
        out = parity.forward(model, inputs)
    finally:
        usp_dit.disable_usp(model)
    after = model.state_dict()
    return {"out": rel_err(out, ref),
            "weights_not_restored": float(not all(torch.equal(after[k], v) for k, v in before.items()))}


def _generate(pipe, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 guided steps, seed 0. The LongCat pipelines take no step
    callback: the scheduler's last step output is recorded instead (its ``step``, wrapped on the
    instance for this call only)."""
    last = {}
    step = pipe.scheduler.step

    def recording_step(*args, **step_kwargs):
        out = step(*args, **step_kwargs)
        last["latents"] = out[0]
        return out

    pipe.scheduler.step = recording_step
    try:
        images = pipe(num_inference_steps=2, guidance_scale=4.0, generator=torch.Generator().manual_seed(0),
                      output_type="pt", **kwargs).images
    finally:
        del pipe.scheduler.step
    return last["latents"], images


T2I = dict(prompt=["a red fox", "cat"], negative_prompt=["blurry", "dark dim"], height=384, width=640,
           enable_prompt_rewrite=False)


def _edit_call() -> dict:
    pixels = np.random.RandomState(0).randint(0, 256, size=(8, 21, 3), dtype=np.uint8)  # 21 x 8: 1664 x 640
    return dict(image=Image.fromarray(pixels), prompt="make it red", negative_prompt="blurry")


def _pipeline_cases(edit: bool, grids: list) -> dict[str, dict[str, float]]:
    """The t2i pipeline (bit-identical after disable) or the edit pipeline on ``grids``."""
    call, name = (_edit_call(), "edit") if edit else (T2I, "t2i")
    return parity.pipeline_cases(tiny_longcat_image_pipeline(edit=edit), lambda p: _generate(p, **call),
                                 parity.pipeline_grids(grids, name),
                                 after_disable=None if edit else f"{name}-after-disable")


T2I_GRIDS = [(2, 1, 1), (2, 2, 1), (1, 2, 2)]
EDIT_GRIDS = [(2, 2, 1), (1, 2, 2)]


def _run_all() -> dict[str, dict | str]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _enabled_case(init_usp(1, 2, 2)))
    parity.record(results, "tensor-t2", lambda: _enabled_case(init_usp(tensor_degree=2), SHAPES[0]))
    parity.record(results, "pipeline-t2i", lambda: _pipeline_cases(False, T2I_GRIDS), many=True)
    parity.record(results, "pipeline-edit", lambda: _pipeline_cases(True, EDIT_GRIDS), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


@pytest.mark.parametrize("key", ["cfg-split", "tensor-t2"])
def test_cfg_split_and_tensor_parallel_match_stock(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


PIPELINE_KEYS = [f"t2i-u{u}r{r}cfg{c}" for u, r, c in T2I_GRIDS] + [f"edit-u{u}r{r}cfg{c}" for u, r, c in EDIT_GRIDS]


@pytest.mark.parametrize("key", PIPELINE_KEYS)
def test_pipeline_matches_one_process(grid_results, key: str):
    by_name = {"images": TOL_IMAGES, **({"latents": TOL_EDIT_LATENTS} if key.startswith("edit") else {})}
    parity.assert_within(grid_results, key, TOL, by_name, fallback=f"pipeline-{key.split('-')[0]}")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "t2i-after-disable", 0.0)


# ---- single process: registration, restore exactly, loud failures ---------------------------------


test_find_adapter_finds_longcat_image = family_checks.adapter_found(tiny_longcat_image, ADAPTER)
test_disable_restores_processors_forward_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPLongCatImageAttnProcessor)
test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_longcat_image, ADAPTER, "single_transformer_blocks.1.attn")


def test_processor_swapped_after_enable_is_refused_at_the_call():
    from diffusers.models.transformers.transformer_longcat_image import LongCatImageAttnProcessor

    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        model.transformer_blocks[1].attn.set_processor(LongCatImageAttnProcessor())
        with pytest.raises(NotImplementedError, match="became LongCatImageAttnProcessor after enable_usp"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_ids_that_do_not_match_the_tokens_are_refused():
    model, inputs = _build(SHAPES[0])
    kwargs = {**inputs.kwargs(), "img_ids": inputs.img_ids[:-1]}
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="img_ids has 14 rows but hidden_states has 15 tokens"):
            model(**kwargs)
    finally:
        ADAPTER.disable(model)
