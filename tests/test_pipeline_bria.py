"""Bria adapters (``usp_dit.pipelines.families.bria``: Bria 3.x and FIBO): sharded transformer
outputs and gradients equal one process's, on CPU gloo grids; the stock ``BriaPipeline`` through
``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Models: a tiny ``BriaTransformer2DModel`` and ``BriaFiboTransformer2DModel`` (2 double +
2 single blocks, 4 heads x 16, every weight perturbed; ``usp_dit.demo.tiny_bria``). The text is
split with the image. Bria 3.x shapes: 6 text + 15 image = 21 tokens, and 6 + 21 = 27 with a
ControlNet residual for the double blocks (cut like the image). FIBO shapes, each with
``text_encoder_layers`` and the pipeline's bool key mask over prompts padded to different
lengths: 16 + 15 = 31 (prompts of 5 and 8 tokens: on 4 ranks rank 1's piece is all padding, a
ring block of masked keys only) and 6 + 21 = 27 (6 and 2: one element unpadded). No joint count
divides 2 or 4. Batch 2 with different prompts, latents and timesteps; ids as the pipelines make
them, so RoPE rotates real positions. Bria 3.x takes no mask (its pipeline zero-pads the prompt
embeddings and attends them all); an ``attention_mask`` is refused, as are FIBO masks other than
the pipeline's.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil((T + N) / P) tokens (text + image), after
``disable`` the output is bit-identical. Every parameter's gradient on 4 ranks for every shape, on
2 ranks for one shape of each model, and once with gradient checkpointing. The transformers
enabled through ``usp_dit.enable_usp`` with cfg_degree=2 on a batch of 2 (FIBO's mask inside
``joint_attention_kwargs`` split with it), and Bria 3.x with tensor_degree=2 (Flux.1's cuts),
equal stock and leave their weights as found. The fullgraph-compiled case (FIBO's masked shape on
(1,4)) is in tests/test_compile_grid.py (ADAPTER_CASES).

Pipeline: the tiny ``BriaPipeline`` (character T5 tokenizer, a 2-layer T5, a 2x VAE, all built
in code), two prompts of different lengths (different zero padding) and negative prompts
(batched CFG: one transformer call a step on [uncond; cond]), 11 text tokens, 12 x 20 (15 image
tokens), 2 steps, on (2,1,1), (2,2,1) and (1,2,2) (the cfg groups each take one half of the
batch), equal to one process's, and bit-identical after ``disable_usp``. The same for the tiny
``BriaFiboPipeline`` (a character tokenizer, a 3-layer SmolLM3, a Wan VAE): 80 x 112 (35 image
tokens), the two prompts padded to the longer one's 11 tokens and masked as keys (the mask in
``joint_attention_kwargs``, split over the cfg groups with the batch).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks, tensor-parallel partial products all-reduced; FIBO's padded keys get
probability exactly 0, as stock's). Decoded images: 1e-4 (an untrained random VAE's gain).
Measured (2026-12-05, 2 cores shared with other jobs): every case within the tolerances above;
this file 48 s (load average ~30-50).
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
from usp_dit.demo.tiny_bria import (
    bria_fibo_inputs,
    bria_inputs,
    tiny_bria,
    tiny_bria_fibo,
    tiny_bria_fibo_pipeline,
    tiny_bria_pipeline,
)
from usp_dit.pipelines.families.bria import ADAPTER, USPBriaAttnProcessor, USPBriaFiboAttnProcessor
from usp_dit.pipelines.families.bria import FIBO_ADAPTER as FIBO
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4
INNER = 64  # tiny_bria's width: 4 heads x 16


@dataclass(frozen=True)
class Shape:
    height: int
    width: int
    text_len: int
    controlnet: bool = False  # one ControlNet residual for the double blocks (Bria 3.x)
    fibo: tuple[int, ...] | None = None  # FIBO: each element's real text tokens (the key mask)

    @property
    def tokens(self) -> int:
        return self.text_len + self.height * self.width

    def __str__(self) -> str:
        return f"{'fibo-' if self.fibo else ''}s{self.tokens}"


SHAPES = [
    Shape(3, 5, 6),  # 6 + 15 = 21
    Shape(3, 7, 6, controlnet=True),  # 6 + 21 = 27
    # FIBO, padded prompts of different lengths. 16 + 15 = 31: on 4 ranks (8, 8, 8, 7) rank 1's
    # piece is text 8..15, all padding: a ring block of masked keys only.
    Shape(3, 5, 16, fibo=(5, 8)),
    Shape(3, 7, 6, fibo=(6, 2)),  # 6 + 21 = 27; element 0 unpadded
]


GRAD_SHAPES = {2: [SHAPES[0], SHAPES[2]], 4: SHAPES}  # the gradient cases' shapes per sequence-group size


def _build(shape: Shape, seed: int = 0):
    if shape.fibo:
        return tiny_bria_fibo(seed=seed), bria_fibo_inputs(shape.height, shape.width, shape.text_len, list(shape.fibo))
    inputs = bria_inputs(shape.height, shape.width, shape.text_len, controlnet_width=INNER if shape.controlnet else None)
    return tiny_bria(seed=seed), inputs


def _adapter(shape: Shape):
    return FIBO if shape.fibo else ADAPTER


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.joint_output_case(model, inputs, _adapter(shape), mesh, model.transformer_blocks[0].attn,
                                    shape.tokens)


def _gradient_case(shape: Shape, mesh) -> dict[str, float]:
    return parity.gradient_errors(*_build(shape), _adapter(shape), mesh)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _enabled_case(mesh, shape: Shape = SHAPES[1]) -> dict[str, float]:
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


PROMPTS = (["a red fox", "cat"], ["blurry", "dark dim"])  # of different lengths: padded differently
# BriaPipeline: 12 x 20 (3 x 5 = 15 image tokens), prompts zero-padded to 11 text tokens.
BRIA_CALL = {"max_sequence_length": 11, "height": 12, "width": 20}
# BriaFiboPipeline: 80 x 112 (5 x 7 = 35 image tokens), prompts padded to the longest (11 tokens
# with the tiny tokenizer) and masked as keys.
FIBO_CALL = {"height": 80, "width": 112}


def _generate(pipe, call: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps, batched CFG (one transformer call a step on
    [uncond; cond]), seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(
        pipe,
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.0, num_inference_steps=2,
        generator=torch.Generator().manual_seed(0), output_type="pt", **call,
    )


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])


def _pipeline_cases(name: str, pipe, call: dict) -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(pipe, lambda p: _generate(p, call), parity.pipeline_grids(PIPELINE_GRIDS, name),
                                 after_disable=f"{name}-after-disable")


def _run_all() -> dict[str, dict | str]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # the tiny pipeline's size and truncation warnings, per call
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case, grad_shapes=GRAD_SHAPES)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _enabled_case(init_usp(1, 2, 2)))
    parity.record(results, "fibo-cfg-split", lambda: _enabled_case(init_usp(1, 2, 2), SHAPES[2]))
    parity.record(results, "tensor-t2", lambda: _enabled_case(init_usp(tensor_degree=2), SHAPES[0]))
    parity.record(results, "pipeline", lambda: _pipeline_cases("pipeline", tiny_bria_pipeline(), BRIA_CALL), many=True)
    parity.record(results, "fibo-pipeline",
                  lambda: _pipeline_cases("fibo-pipeline", tiny_bria_fibo_pipeline(), FIBO_CALL),
                  many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(by_world=GRAD_SHAPES) + ["grad-ckpt-p4"], TOL,
)


@pytest.mark.parametrize("key", ["cfg-split", "fibo-cfg-split", "tensor-t2"])
def test_cfg_split_and_tensor_parallel_match_stock(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


@pytest.mark.parametrize("key", [f"{name}-u{u}r{r}cfg{c}" for name in ("pipeline", "fibo-pipeline")
                                 for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback=key.rsplit("-", 1)[0])


@pytest.mark.parametrize("name", ["pipeline", "fibo-pipeline"])
def test_disable_usp_gives_back_the_bit_identical_image(grid_results, name: str):
    parity.assert_within(grid_results, f"{name}-after-disable", 0.0)


# ---- single process: registration, restore exactly, loud failures ---------------------------------


test_find_adapter_finds_bria = family_checks.adapter_found(tiny_bria, ADAPTER)
test_disable_restores_processors_forward_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPBriaAttnProcessor)
test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_bria, ADAPTER, "transformer_blocks.1.attn")


def test_processor_swapped_after_enable_is_refused_at_the_call():
    from diffusers.models.transformers.transformer_bria import BriaAttnProcessor

    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        model.single_transformer_blocks[0].attn.set_processor(BriaAttnProcessor())
        with pytest.raises(NotImplementedError, match="became BriaAttnProcessor after enable_usp"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_an_attention_mask_is_refused():
    """The stock forward hands ``attention_kwargs`` to the blocks only under gradient checkpointing:
    there the mask reaches the processor, which refuses it."""
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    kwargs = {**inputs.kwargs(), "attention_kwargs": {"attention_mask": torch.ones(2, 21, dtype=torch.bool)}}
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="does not support attention_mask"):
            model(**kwargs)
    finally:
        ADAPTER.disable(model)


def test_single_block_controlnet_residuals_are_refused():
    model, inputs = _build(SHAPES[0])
    kwargs = {**inputs.kwargs(), "controlnet_single_block_samples": [torch.zeros(2, 15, INNER)]}
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="does not support controlnet_single_block_samples"):
            model(**kwargs)
    finally:
        ADAPTER.disable(model)


# ---- FIBO, single process ---------------------------------------------------------------------------


test_find_adapter_finds_bria_fibo = family_checks.adapter_found(tiny_bria_fibo, FIBO)


test_fibo_disable_restores_processors_forward_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[2]), FIBO, USPBriaFiboAttnProcessor)


@pytest.mark.parametrize("mask, message", [
    (torch.ones(2, 1, 31, 31, dtype=torch.bool), "runs a bool key mask"),  # varies over queries
    (torch.zeros(2, 1, 1, 31), "runs a bool key mask"),  # additive float
    (torch.ones(2, 1, 1, 31, dtype=torch.bool).index_fill(3, torch.tensor([20]), False),
     "does not run a mask over image tokens"),
], ids=["query-mask", "float-mask", "image-key-masked"])
def test_fibo_masks_other_than_the_pipelines_are_refused(mask, message):
    model, inputs = _build(SHAPES[2])
    kwargs = {**inputs.kwargs(), "joint_attention_kwargs": {"attention_mask": mask}}
    FIBO.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match=message):
            model(**kwargs)
    finally:
        FIBO.disable(model)


test_fibo_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(
    tiny_bria_fibo, FIBO, "BriaFibo")
