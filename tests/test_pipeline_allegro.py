"""Allegro adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``AllegroTransformer3DModel`` s (4 heads x 24, patch
1 x 2 x 2, the release's block config, every weight perturbed, the adaLN-single tables included;
``usp_dit.demo.tiny_allegro``). Shapes: 3 frames of 5 x 7 and 3 frames of 3 x 3 tokens (105 and
27: neither divides 2 or 4), with the pipeline's 3D RoPE positions, so every rank rotates its own,
uneven, rows (``usp_dit.pipelines.families.allegro`` Note [Allegro's RoPE positions]). Batch 2 with a
different latent, prompt and timestep per element; 6 T5 tokens with prompt masks of different valid
lengths per element (3 and 6; 2 and 5): the cross-attention runs on each rank's video shard against
the replicated, masked text.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced (one ring grid per
shape in CI). Each case: output vs stock, block 0's self-attention sees at most ceil(tokens / P)
tokens, after ``disable`` the output is bit-identical. Per shape, on 2 and on 4 ranks: every
parameter's gradient (against the exact maths: below), and once with gradient checkpointing (block
0's recompute re-shards, every block's positions are cut again). The transformer enabled with
cfg_degree=2 on the masked batch of 2 equals stock. The tiny ``AllegroPipeline`` (T5, the 3D VAE;
two prompts of different lengths, batched CFG [uncond, cond] with their masks in one call) through
``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2) (the cfg split of the batched halves), 2 steps,
equal to one process's; after ``disable_usp`` bit-identical. 5 tokens on 4 ranks (a rank with one
token, which the stock block would squeeze) raise NotImplementedError on every rank. The fullgraph-compiled case is in
tests/test_compile_grid.py (ADAPTER_CASES: allegro on (1,2)).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and the pipeline's final latents:
sharding only reorders float32 sums (attention merged by log-sum-exp over blocks of keys; RoPE and
the cross-attention are the stock arithmetic per row). Gradients are measured against the exact
maths (the model in float64), each parameter's error allowed max(1e-5, 2 x the error of the stock
float32 model there) -- the design's rule for a reordered kernel, because stock's own float32
gradient is not within 1e-5 everywhere: the key biases of both attentions have an analytically
zero gradient (softmax is shift-invariant) whose float32 values are rounding noise. Decoded frames:
1e-4 (an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.attention_processor import AllegroAttnProcessor2_0, AttnProcessor2_0

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_allegro import allegro_inputs, tiny_allegro, tiny_allegro_pipeline
from usp_dit.pipelines.families.allegro import ADAPTER, USPAllegroSelfAttnProcessor
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    frames: int  # latent frames
    height: int  # token rows
    width: int  # token columns
    prompt_lengths: tuple[int, int]

    def __str__(self) -> str:
        return f"f{self.frames}-{self.height}x{self.width}"


SHAPES = [Shape(3, 5, 7, (3, 6)), Shape(3, 3, 3, (2, 5))]


def _build(shape: Shape, seed: int = 0):
    model = tiny_allegro(seed=seed)
    return model, allegro_inputs(model, shape.frames, shape.height, shape.width, list(shape.prompt_lengths))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    tokens = shape.frames * shape.height * shape.width
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, tokens)


def _float64(value):
    if torch.is_tensor(value) and value.is_floating_point():
        return value.double()
    if isinstance(value, (tuple, list)):
        return type(value)(_float64(v) for v in value)
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


def _one_token_shard_case(mesh) -> dict[str, float]:
    """5 tokens on 4 ranks (2, 1, 1, 1): a NotImplementedError on every rank, none left in a collective."""
    model = tiny_allegro()
    inputs = allegro_inputs(model, 1, 1, 5, [2, 5])
    ADAPTER.enable(model, mesh, "auto")
    try:
        parity.forward(model, inputs)
    except NotImplementedError as exc:
        return {"wrong_error": float("one token" not in str(exc))}
    finally:
        ADAPTER.disable(model)
    return {"did_not_raise": 1.0}


PROMPTS = (["a red fox jumps", "a cat"], "")  # of different lengths: padded, masked
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last splits [uncond, cond] over cfg


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of 2 steps, 9 frames at 48 x 80 (3 x 3 x 5 = 45 tokens), batched CFG, seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(
        pipe, "frames", prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.5, height=48, width=80,
        num_frames=9, num_inference_steps=2, max_sequence_length=16, clean_caption=False,
        generator=torch.Generator().manual_seed(0), output_type="pt",
    )


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    # Checkpointing: block 0's recompute in backward re-shards the tokens, every block's positions again.
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[0], init_usp(2, 2), checkpointing=True))
    parity.record(results, "one-token-shard", lambda: _one_token_shard_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    grids = parity.pipeline_grids(PIPELINE_GRIDS)
    parity.record(results, "pipeline", lambda: parity.pipeline_cases(tiny_allegro_pipeline(), _generate, grids,
                                                        names=("latents", "frames")), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
    grad_tol=1.0,  # each parameter's error over its allowance (module docstring)
)


def test_a_split_leaving_a_rank_one_token_is_refused_on_every_rank(grid_results):
    parity.assert_within(grid_results, "one-token-shard", 0.0)


def test_cfg_split_of_a_masked_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", list(parity.pipeline_grids(PIPELINE_GRIDS)))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0, fallback="pipeline")


# ---- single process: restore exactly, loud failures ----------------------------------------------


test_one_rank_is_bit_identical_to_stock = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[1]), ADAPTER)


# the cross-attention is local: its stock processor stays
test_disable_leaves_no_hook_and_the_stock_processors = family_checks.disable_restores(
    lambda: _build(SHAPES[1]), ADAPTER, (USPAllegroSelfAttnProcessor, AllegroAttnProcessor2_0))


def test_prompt_mask_and_rope_positions_change_the_output():
    """The masks and positions the grid cases use matter (a misplaced row would show)."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    mask = inputs.encoder_attention_mask
    inputs.encoder_attention_mask = torch.ones_like(mask)
    assert rel_err(parity.forward(model, inputs), ref) > 1e-2
    inputs.encoder_attention_mask = mask
    tables, positions = inputs.image_rotary_emb
    inputs.image_rotary_emb = (tables, tuple(p.flip(-1) for p in positions))
    assert rel_err(parity.forward(model, inputs), ref) > 1e-2


def test_a_mask_over_the_video_tokens_is_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model(**inputs.kwargs(), attention_mask=torch.ones(2, 3, 10, 14))
    finally:
        ADAPTER.disable(model)


def test_rope_positions_of_another_length_are_refused():
    model, inputs = _build(SHAPES[0])
    tables, positions = inputs.image_rotary_emb
    inputs.image_rotary_emb = (tables, tuple(p[..., :-1] for p in positions))
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="positions have 104 entries but the transformer has 105"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.foreign_processor_refused(
    tiny_allegro, ADAPTER, "transformer_blocks.1.attn1", AttnProcessor2_0)
