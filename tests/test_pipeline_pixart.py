"""PixArt adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``PixArtTransformer2DModel`` s (4 heads x 24, patch
2, learned sigma, every weight perturbed, the adaLN-single tables included; ``usp_dit.demo.tiny_pixart``)
in two variants: PixArt-Sigma (timestep only) on a 5 x 7 token grid and PixArt-Alpha 1024 (the
resolution and aspect-ratio conditions of ``added_cond_kwargs``, different per element) on 3 x 9.
Neither 35 nor 27 divides 2 or 4. Batch 2 with a different latent, prompt and timestep per element;
6 T5 tokens with prompt masks of different valid lengths per element (3 and 6; 2 and 5): the
cross-attention runs on each rank's image shard against the replicated, masked text.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's self-attention sees at most ceil(tokens / P) tokens, after ``disable`` the output
is bit-identical. Per variant, on 2 and on 4 ranks: every parameter's gradient
(tests/adapter_parity.gradient_errors, against the exact maths: below), and once with gradient
checkpointing. The transformer enabled with cfg_degree=2 on Alpha's batch of 2 (its masks and its
``added_cond_kwargs`` dict split too) equals stock. The tiny ``PixArtSigmaPipeline`` and
``PixArtAlphaPipeline`` (T5, a 4x VAE; two prompts of different lengths, batched CFG [uncond, cond]
in one call) through ``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2) (the cfg split of the
batched halves), 2 steps, equal to one process's; after ``disable_usp`` bit-identical.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and the pipelines' final latents:
sharding only reorders float32 sums (attention merged by log-sum-exp over blocks of keys; the
cross-attention is the stock arithmetic per query row). Gradients are measured against the exact
maths (the model in float64), each parameter's error allowed max(1e-5, 2 x the error of the stock
float32 model there) -- the design's rule for a reordered kernel, because stock's own float32
gradient is not within 1e-5 everywhere: the key biases of both attentions have an analytically
zero gradient (softmax is shift-invariant) whose float32 values are rounding noise. Decoded
images: 1e-4 (an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_pixart import pixart_inputs, tiny_pixart, tiny_pixart_pipeline
from usp_dit.pipelines.families.pixart import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    height: int  # token rows
    width: int  # token columns
    prompt_lengths: tuple[int, int]

    def __str__(self) -> str:
        return f"{self.variant}-{self.height}x{self.width}"


SHAPES = [Shape("sigma", 5, 7, (3, 6)), Shape("alpha", 3, 9, (2, 5))]


def _build(shape: Shape, seed: int = 0):
    model = tiny_pixart(shape.variant, seed=seed)
    return model, pixart_inputs(model, shape.height, shape.width, list(shape.prompt_lengths))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    tokens = shape.height * shape.width
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, tokens)


def _float64(value):
    if torch.is_tensor(value) and value.is_floating_point():
        return value.double()
    if isinstance(value, dict):
        return {k: _float64(v) for k, v in value.items()}
    return value


@functools.cache  # per shape: the 2- and 4-rank cases share the references
def _reference_grads(shape: Shape) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(exact gradients: the model and inputs in float64, the stock float32 model's gradients) of one process."""
    model, inputs = _build(shape)
    stock = parity._param_grads(model, inputs, 1)
    model.double()
    for name, value in inputs.__dict__.items():
        setattr(inputs, name, _float64(value))
    return parity._param_grads(model, inputs, 1), stock


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    """Every parameter's gradient, summed over the sequence group (each rank's loss L / P), against
    the exact one: its error over max(TOL, 2 x the stock float32 model's error there) (at most 1)."""
    exact, stock = _reference_grads(shape)
    model, inputs = _build(shape)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return parity.allowance_gradient_errors(model, inputs, ADAPTER, mesh, exact, stock, TOL)


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2: Alpha's batch of 2 (masks of 2 and 5 tokens, its
    per-element resolution and aspect ratio in the added_cond_kwargs dict) split over the cfg axis."""
    return parity.cfg_split_case(*_build(SHAPES[1]), mesh)


PROMPTS = (["a red fox jumps", "a cat"], ["blurry", "dark and dim"])  # of different lengths: padded, masked
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last splits [uncond, cond] over cfg


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 40 x 56 (5 x 7 = 35 tokens), batched CFG, seed 0."""
    last = {}

    def keep_latents(step, timestep, latents):  # PixArt's pipelines take the old-style callback
        last["latents"] = latents.clone()

    prompt, negative_prompt = PROMPTS
    images = pipe(
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.5, height=40, width=56,
        num_inference_steps=2, max_sequence_length=16, clean_caption=False, use_resolution_binning=False,
        generator=torch.Generator().manual_seed(0), output_type="pt", callback=keep_latents,
    ).images
    return last["latents"], images


def _pipeline_cases(variant: str) -> dict[str, dict[str, float]]:
    grids = parity.pipeline_grids(PIPELINE_GRIDS, f"pipeline-{variant}")
    return parity.pipeline_cases(tiny_pixart_pipeline(variant), _generate, grids,
                                 after_disable=f"pipeline-{variant}-after-disable")


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    # Checkpointing: block 0's recompute in backward re-shards the tokens.
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[0], init_usp(2, 2), checkpointing=True))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    for variant in ("sigma", "alpha"):
        parity.record(results, f"pipeline-{variant}", lambda v=variant: _pipeline_cases(v), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
    grad_tol=1.0,  # each parameter's error over its allowance (module docstring)
)


def test_cfg_split_of_a_masked_conditioned_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", [f"pipeline-{v}-u{u}r{r}cfg{c}" for v in ("sigma", "alpha")
                                 for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback=f"pipeline-{key.split('-')[1]}")


@pytest.mark.parametrize("variant", ["sigma", "alpha"])
def test_disable_usp_gives_back_the_bit_identical_image(grid_results, variant: str):
    parity.assert_within(grid_results, f"pipeline-{variant}-after-disable", 0.0)


# ---- single process: restore exactly, loud failures ----------------------------------------------


test_one_rank_is_bit_identical_to_stock = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[1]), ADAPTER)


def test_prompt_mask_changes_the_output():
    """The masks the grid cases use matter: padding keys unmasked gives another output."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    inputs.encoder_attention_mask = torch.ones_like(inputs.encoder_attention_mask)
    assert rel_err(parity.forward(model, inputs), ref) > 1e-2


def test_a_mask_over_the_image_tokens_is_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model(**inputs.kwargs(), attention_mask=torch.ones(2, 35))
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.foreign_processor_refused(
    tiny_pixart, ADAPTER, "transformer_blocks.1.attn1", AttnProcessor)


def test_fused_qkv_is_refused():
    model = tiny_pixart()
    model.fuse_qkv_projections()
    with pytest.raises(NotImplementedError, match="FusedAttnProcessor2_0"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")
