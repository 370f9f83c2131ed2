"""Lumina-Next adapter: sharded outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids as two data-parallel replicas).
Model: a tiny ``LuminaNextDiT2DModel`` (2 layers; 6 query heads and 2 kv heads of 16: GQA 3:1,
which Ulysses 4 splits unevenly and with fewer kv heads than ranks; every weight perturbed, the
zero-initialised cross-attention gates included; ``usp_dit.demo.tiny_lumina_next``). Shapes:
5 x 7 = 35 patches with captions of 3 and 7 valid tokens out of 9, proportional attention on
(``base_sequence_length`` 16: the softmax scale depends on the whole image's token count, Note
[Lumina-Next's attention]) and a linearly scaled RoPE table; 3 x 3 = 9 patches with captions of 9
and 4, no proportional attention and an NTK-scaled table. No token count divides 2 or 4; batch 2
with different prompts, caption masks and timesteps; the 2-D RoPE is the pipeline's own function.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with the
"stream" and "gather_merge" schedules forced (tests/adapter_parity.kept_in_ci). Each case: output vs
stock, block 0's self-attention sees at most ceil(tokens / P) image tokens, after ``disable`` the
output is bit-identical. Every parameter's gradient on 2 and 4 ranks per shape; the transformer
through ``enable_usp`` with cfg_degree=2 (its batch split). The tiny ``LuminaPipeline`` (Gemma 2
text encoder, two prompts of different lengths, batched CFG [cond, uncond] in one call, its default
proportional attention and RoPE scaling at 48 x 80 = 15 image tokens) through ``pipe.enable_usp()``
on (2,1,1), (2,2,1) and (1,2,2) (the cfg split of the batched halves), 2 steps; bit-identical after
``disable_usp``. The fullgraph-compiled case is in tests/test_compile_grid.py (ADAPTER_CASES).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's latents:
sharding only reorders float32 sums (attention merged by log-sum-exp over blocks of keys; the
cross-attention is the stock arithmetic per query row; gradients summed over ranks). Gradients are
measured against the exact maths (the model in float64), each parameter's error allowed max(1e-5,
2 x the stock float32 model's error there), as tests/test_pipeline_pixart.py does: the bias of the
cross-attention's key norm has an analytically zero gradient (softmax is shift-invariant over the
unrotated caption keys) whose float32 values are rounding noise. Decoded images: 1e-4 (an untrained
random VAE's gain).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_lumina_next import lumina_next_inputs, tiny_lumina_next, tiny_lumina_next_pipeline
from usp_dit.pipelines.families.lumina_next import ADAPTER

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int  # patches
    width: int
    valid: tuple  # real caption tokens per element (of 9)
    base_sequence_length: int | None  # proportional attention's base (None: off)
    linear_factor: float = 1.0
    ntk_factor: float = 1.0

    def __str__(self) -> str:
        return f"s{self.height * self.width}-cap{'-'.join(map(str, self.valid))}"


SHAPES = [Shape(5, 7, (3, 7), 16, linear_factor=0.5), Shape(3, 3, (9, 4), None, ntk_factor=2.0)]


def _build(shape: Shape, seed: int = 0):
    inputs = lumina_next_inputs(shape.height, shape.width, list(shape.valid),
                                base_sequence_length=shape.base_sequence_length,
                                linear_factor=shape.linear_factor, ntk_factor=shape.ntk_factor)
    return tiny_lumina_next(seed=seed), inputs


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.layers[0].attn1, shape.height * shape.width)


@functools.cache
def _exact_and_stock(shape: Shape) -> tuple[dict, dict]:
    """One process's parameter gradients in float64 (the exact maths) and in float32 (stock)."""
    model, inputs = _build(shape)
    stock = parity._param_grads(model, inputs, 1)
    double = {k: v.double() if torch.is_tensor(v) and torch.is_floating_point(v) else v
              for k, v in inputs.kwargs().items()}
    double["image_rotary_emb"] = inputs.image_rotary_emb.to(torch.complex128)
    exact = parity._param_grads(model.double(), type(inputs)(**double), 1)
    return exact, stock


def _gradient_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    exact, stock = _exact_and_stock(shape)
    return parity.allowance_gradient_errors(model, inputs, ADAPTER, mesh, exact, stock, TOL)


PROMPTS = (["a red fox jumps over", "a cat"], ["blurry", "dark, dim, low quality"])


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 48 x 80 (3 x 5 = 15 image tokens), batched CFG, seed 0;
    the pipeline's default proportional attention (base 64 tokens) and RoPE scaling (factor 0.48)."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(
        pipe, prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.0, height=48, width=80,
        num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt", clean_caption=False,
    )


# the last: [cond, uncond] split over cfg
PIPELINE_GRIDS = parity.ci_grids(parity.pipeline_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)]))


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_lumina_next_pipeline(), _generate, PIPELINE_GRIDS)


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES) + ["cfg-split"], parity.grad_keys(SHAPES), TOL, grad_tol=1.0,
)


@pytest.mark.parametrize("key", [*PIPELINE_GRIDS, "pipeline-after-disable"])
def test_pipeline_matches_one_process_and_disable_restores_it(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES, "not_bit_identical": 0.0,
                                                  "not_enabled_then_restored": 0.0}, fallback="pipeline")


# ---- single process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_one_rank_is_bit_identical_to_stock(shape: Shape):
    """Sequence degree 1: the routed self-attention (mask dropped, scale from the global count) gives
    stock's output bit for bit."""
    parity.assert_one_rank_bit_identical(*_build(shape), ADAPTER)


def test_self_attention_called_with_other_keys_is_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        x = torch.randn(1, 4, model.config.hidden_size)
        with pytest.raises(NotImplementedError, match="self-attention"):
            model.layers[0].attn1(x, encoder_hidden_states=x.clone(), attention_mask=torch.ones(1, 4))
    finally:
        ADAPTER.disable(model)


test_a_replaced_cross_attention_processor_is_refused = family_checks.foreign_processor_refused(
    lambda: _build(SHAPES[0])[0], ADAPTER, "layers.1.attn2", AttnProcessor2_0)


def test_the_image_example_builds_and_runs_the_tiny_lumina_next():
    """examples/generate_image.py --family lumina_next: its tiny default pipeline on one process (1 step)."""
    from tests.test_examples_cli import _example

    ex = _example("generate_image")
    args = ex.parse_args(["--family", "lumina_next", "--steps", "1"])
    images = ex.generate(ex.load_pipeline(args, torch.device("cpu")), args)
    assert images.shape == (1, *ex.FAMILIES["lumina_next"].tiny_size, 3)
    assert bool((images >= 0).all() and (images <= 1).all())
