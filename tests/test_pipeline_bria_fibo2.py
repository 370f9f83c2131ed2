"""Bria FIBO 2.0 adapter (``usp_dit.pipelines.families.bria_fibo2``): sharded transformer outputs and
gradients equal one process's, on CPU gloo grids; the stock ``BriaFibo2Pipeline`` through
``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``BriaFibo2Transformer2DModel`` (``usp_dit.demo.tiny_bria_fibo2``): 4 heads
x 16, 1 refiner and 2 main layers (the second an injection block), a 1-layer Perceiver, every
weight perturbed. Batch 2 with a different latent, prompt and timestep per element. Shapes
(S = image + edit tokens, the split sequence; G = gists, replicated):

* ``t2i``: 5 x 7 patches (S = 35), prompts of 7 tokens unpadded: G = 6, the layout [gist; piece].
* ``padded``: 3 x 5 (S = 15), prompts of 5 and 11 real tokens: 6 and 9 gists, the batch's gists
  padded and masked (the layout [piece; gist], a key mask differing per element).
* ``edit``: 3 x 5 image + a 3 x 4 edit image (S = 27), prompts of 4 and 9: on 4 ranks (7, 7, 7, 6)
  rank 2 holds 1 image token and rank 3 none (its final layer gathers nothing).

S = 35, 15, 27: none divides 2 or 4. RoPE positions are the model's own 3-D ones.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, the noise refiner's attention sees at most ceil(S / P) tokens, after ``disable`` the output
is bit-identical. Every parameter's gradient on 4 ranks for every shape, on 2 ranks for ``padded``,
and once with gradient checkpointing (the tables re-cut on recompute). The transformer enabled with
cfg_degree=2 (the batch split). The tiny ``BriaFibo2Pipeline`` (precomputed prompt embeddings of
different lengths and masks, a negative prompt: two transformer calls a step) through
``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2) (the cfg groups run the two calls at once),
and the edit call (one input image) on (2,2,1): equal to one process, bit-identical after
``disable_usp``. Fullgraph compile: tests/test_compile_grid.py (``t2i`` on (1,2)).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipelines' final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks, padded gists attended per element). Decoded images: 1e-4 (an untrained random
VAE's gain).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_bria_fibo2 import bria_fibo2_inputs, tiny_bria_fibo2, tiny_bria_fibo2_pipeline
from usp_dit.pipelines.families.bria_fibo2 import ADAPTER, USPBriaFibo2AttnProcessor

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    name: str
    patches: tuple[int, int]
    text_len: int
    prompt_lengths: tuple[int, ...] | None = None
    context: tuple[tuple[int, int], ...] = ()

    @property
    def tokens(self) -> int:
        return sum(r * c for r, c in (self.patches, *self.context))

    def __str__(self) -> str:
        return f"{self.name}-s{self.tokens}"


SHAPES = [
    Shape("t2i", (5, 7), 7),
    Shape("padded", (3, 5), 11, (5, 11)),
    Shape("edit", (3, 5), 11, (4, 9), context=((3, 4),)),
]
GRAD_SHAPES = {2: [SHAPES[1]], 4: SHAPES}


def _build(shape: Shape, seed: int = 0):
    lengths = list(shape.prompt_lengths) if shape.prompt_lengths else None
    return tiny_bria_fibo2(seed=seed), bria_fibo2_inputs(shape.patches, shape.text_len, lengths, shape.context)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.noise_refiner[0].attention, shape.tokens)


def _gradient_case(shape: Shape, mesh) -> dict[str, float]:
    return parity.gradient_errors(*_build(shape), ADAPTER, mesh)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[2])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _embeds(text_len: int, lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    inputs = bria_fibo2_inputs((1, 1), text_len, lengths, seed=seed)
    return {"embeds": inputs.encoder_hidden_states, "mask": inputs.encoder_attention_mask}


def _generate(pipe, edit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 20 x 28 (5 x 7 = 35 image tokens), two guidance calls a
    step: prompts of 5 and 11 real tokens, negative prompts of 3 and 6 (each padded to its own
    length). ``edit``: one 16 x 24 input image (4 x 6 = 24 edit tokens beside the 35)."""
    prompt, negative = _embeds(11, [5, 11], 1), _embeds(6, [3, 6], 2)
    image = None
    if edit:
        pixels = np.random.default_rng(0).integers(0, 256, (24, 16, 3), dtype=np.uint8)
        image = [Image.fromarray(pixels)]
    return parity.latents_and(
        pipe, image=image, prompt_embeds=prompt["embeds"], prompt_embeds_mask=prompt["mask"],
        negative_prompt_embeds=negative["embeds"], negative_prompt_embeds_mask=negative["mask"],
        height=20, width=28, num_inference_steps=2, guidance_scale=4.0, output_type="pt",
        generator=torch.Generator().manual_seed(0),
    )


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])
EDIT_GRIDS = [(2, 2, 1)]


def _run_all() -> dict[str, dict | str]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case, grad_shapes=GRAD_SHAPES)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[1]), init_usp(1, 2, 2)))
    pipe = tiny_bria_fibo2_pipeline()
    parity.record(results, "pipeline",
                  lambda: parity.pipeline_cases(pipe, _generate, parity.pipeline_grids(PIPELINE_GRIDS)), many=True)
    parity.record(results, "edit", lambda: parity.pipeline_cases(pipe, lambda p: _generate(p, edit=True),
                                                                 parity.pipeline_grids(EDIT_GRIDS, "edit"),
                                                                 after_disable="edit-after-disable"),
                  many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(by_world=GRAD_SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_cfg_split_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", [*parity.pipeline_grids(PIPELINE_GRIDS), *parity.pipeline_grids(EDIT_GRIDS, "edit")])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback=key.split("-")[0])


@pytest.mark.parametrize("key", ["pipeline-after-disable", "edit-after-disable"])
def test_disable_usp_gives_back_the_bit_identical_image(grid_results, key: str):
    parity.assert_within(grid_results, key, 0.0)


# ---- single process: registration, restore exactly, loud failures ---------------------------------


test_find_adapter_finds_bria_fibo2 = family_checks.adapter_found(tiny_bria_fibo2, ADAPTER)


def test_disable_restores_processors_forward_and_hooks():
    model, inputs = _build(SHAPES[2])
    parallel = [m for n, m in model.named_modules() if n.endswith(".attention") and "perceiver" not in n]
    before = [m.processor for m in parallel]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    assert all(isinstance(m.processor, USPBriaFibo2AttnProcessor) for m in parallel)
    parity.forward(model, inputs)
    ADAPTER.disable(model)
    assert [m.processor for m in parallel] == before
    assert "forward" not in model.__dict__
    assert not [type(m).__name__ for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]


test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_bria_fibo2, ADAPTER, "layers.1.attention")
test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(
    tiny_bria_fibo2, ADAPTER, "BriaFibo2")

