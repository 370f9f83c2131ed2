"""Latte adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``LatteTransformer3DModel`` s (4 heads x 16, patch 2,
Latte-1's block config, every weight perturbed, the adaLN-single tables included;
``usp_dit.demo.tiny_latte``). Shapes: 3 frames of 5 x 7 positions and 2 frames of 3 x 3; neither
35 nor 9 divides 2 or 4, so every rank's shard of every frame is uneven. Batch 2 with a different
latent, prompt and timestep per element; 6 T5 tokens with a text key bias of different valid
lengths per element (3 and 6; 2 and 5), repeated over the element's frames as Latte's forward
takes it: the spatial cross-attention runs on each rank's positions against the replicated, masked
text, the temporal attention on each rank's positions over all frames
(``usp_dit.pipelines.families.latte`` Note [Latte's two attentions]).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced (one ring grid per
shape in CI). Each case: output vs stock, block 0's spatial self-attention sees at most
ceil(positions / P) positions of each frame and block 0's temporal attention at most
batch x ceil(positions / P) rows, after ``disable`` the output is bit-identical. Per shape, on 2
and on 4 ranks: every parameter's gradient (against the exact maths: below), and once with
gradient checkpointing (block 0's recompute re-shards; the temporal blocks' timestep is cut again).
The temporal attentions switched off (``enable_temporal_attentions=False``) on (2,2). The
transformer enabled with cfg_degree=2 on a batch of 2 without a text mask (as LattePipeline calls
it) equals stock; with the (batch x frames)-row mask, the cfg split raises a ValueError naming it.
The tiny ``LattePipeline`` (T5, an 8x VAE; two prompts of different lengths, batched CFG
[uncond, cond] in one call) through ``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2) (the cfg
split of the batched halves), 2 steps, equal to one process's; after ``disable_usp`` bit-identical.
The fullgraph-compiled case is in tests/test_compile_grid.py (ADAPTER_CASES: latte on (2,1)).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and the pipeline's final latents:
sharding only reorders float32 sums (attention merged by log-sum-exp over blocks of keys; the
cross- and temporal attentions are the stock arithmetic per query row). Gradients are measured
against the exact maths (the model in float64), each parameter's error allowed max(1e-5, 2 x the
error of the stock float32 model there) -- the design's rule for a reordered kernel, because
stock's own float32 gradient is not within 1e-5 everywhere: the key biases of the attentions have
an analytically zero gradient (softmax is shift-invariant) whose float32 values are rounding
noise. Decoded frames: 1e-4 (an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import disable_usp, enable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_latte import latte_inputs, tiny_latte, tiny_latte_pipeline
from usp_dit.pipelines.families.latte import ADAPTER, USPLatteSpatialAttnProcessor
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    frames: int
    height: int  # token rows of a frame
    width: int  # token columns of a frame
    prompt_lengths: tuple[int, int]

    def __str__(self) -> str:
        return f"f{self.frames}-{self.height}x{self.width}"


SHAPES = [Shape(3, 5, 7, (3, 6)), Shape(2, 3, 3, (2, 5))]


def _build(shape: Shape, seed: int = 0):
    model = tiny_latte(shape.frames, seed=seed)
    return model, latte_inputs(model, shape.height, shape.width, list(shape.prompt_lengths))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh, inputs_override: dict | None = None) -> dict[str, float]:
    """``sharded_output_case``, plus 1.0 under "temporal_rows_above_ceil" unless block 0's temporal
    attention got at most batch x ceil(positions / P) rows (its batch: every frame of this rank's positions)."""
    model, inputs = _build(shape)
    for name, value in (inputs_override or {}).items():
        setattr(inputs, name, value)
    positions = shape.height * shape.width
    rows = []  # one call per forward: stock, sharded, after disable
    hook = model.temporal_transformer_blocks[0].attn1.register_forward_pre_hook(
        lambda m, args, kwargs: rows.append((kwargs.get("hidden_states", args[0] if args else None)).shape[0]),
        with_kwargs=True)
    try:
        res = parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, positions)
    finally:
        hook.remove()
    if getattr(inputs, "enable_temporal_attentions", True):
        limit = 2 * math.ceil(positions / mesh.sequence_degree)
        res["temporal_rows_above_ceil"] = float(len(rows) != 3 or rows[1] > limit)
    return res


class _NoTemporal:
    """Inputs whose call switches the temporal blocks off (``enable_temporal_attentions=False``)."""

    def __init__(self, inputs) -> None:
        self.inputs = inputs
        self.enable_temporal_attentions = False

    def kwargs(self) -> dict:
        return {**self.inputs.kwargs(), "enable_temporal_attentions": False}


def _no_temporal_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    return parity.sharded_output_case(model, _NoTemporal(inputs), ADAPTER, mesh, model.transformer_blocks[0].attn1,
                                      SHAPES[0].height * SHAPES[0].width)


def _float64(value):
    return value.double() if torch.is_tensor(value) and value.is_floating_point() else value


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
    """The transformer enabled with cfg_degree=2: a batch of 2 (no text mask, as LattePipeline) split over cfg."""
    model, inputs = _build(SHAPES[0])
    inputs.encoder_attention_mask = None
    return parity.cfg_split_case(model, inputs, mesh)


def _cfg_mask_case(mesh) -> dict[str, float]:
    """With cfg_degree=2, the (batch x frames)-row text mask: a ValueError naming it, on every rank."""
    model, inputs = _build(SHAPES[0])
    enable_usp(model, mesh=mesh)
    try:
        parity.forward(model, inputs)
    except ValueError as exc:
        return {"wrong_error": float("encoder_attention_mask" not in str(exc))}
    finally:
        disable_usp(model)
    return {"did_not_raise": 1.0}


PROMPTS = (["a red fox jumps", "a cat"], "")  # of different lengths: padded (Latte's negative prompt is "")
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last splits [uncond, cond] over cfg
PIPELINE_FRAMES = 3


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of 2 steps at 48 x 80 (3 x 5 = 15 positions x 3 frames), batched CFG, seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(
        pipe, "frames", prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.5, height=48, width=80,
        video_length=PIPELINE_FRAMES, num_inference_steps=2, clean_caption=False,
        generator=torch.Generator().manual_seed(0), output_type="pt",
    )


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    # Checkpointing: block 0's recompute in backward re-shards the tokens, the temporal timestep again.
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[0], init_usp(2, 2), checkpointing=True))
    parity.record(results, "no-temporal-u2r2", lambda: _no_temporal_case(init_usp(2, 2)))
    cfg_mesh = init_usp(1, 2, 2)
    parity.record(results, "cfg-split", lambda: _cfg_split_case(cfg_mesh))
    parity.record(results, "cfg-mask", lambda: _cfg_mask_case(cfg_mesh))
    grids = parity.pipeline_grids(PIPELINE_GRIDS)
    parity.record(results, "pipeline",
                  lambda: parity.pipeline_cases(tiny_latte_pipeline(PIPELINE_FRAMES), _generate, grids,
                                                        names=("latents", "frames")),
                  many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES) + ["no-temporal-u2r2"],
    [f"grad-p{p}-{s}" for p in (2, 4) for s in SHAPES] + ["grad-ckpt-p4"],
    TOL, grad_tol=1.0,  # each parameter's error over its allowance (module docstring)
)


def test_cfg_split_of_a_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_cfg_split_of_a_frame_row_mask_raises(grid_results):
    parity.assert_within(grid_results, "cfg-mask", 0.0)


@pytest.mark.parametrize("key", list(parity.pipeline_grids(PIPELINE_GRIDS)))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0, fallback="pipeline")


# ---- single process: restore exactly, loud failures ----------------------------------------------


test_one_rank_is_bit_identical_to_stock = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[1]), ADAPTER)


# the temporal and cross-attention are local: their stock processors stay
test_disable_leaves_no_hook_and_the_stock_processors = family_checks.disable_restores(
    lambda: _build(SHAPES[1]), ADAPTER, (USPLatteSpatialAttnProcessor, AttnProcessor2_0))


def test_text_mask_and_temporal_position_table_change_the_output():
    """The masks the grid cases use matter, and so does the temporal table added on the shard."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    mask = inputs.encoder_attention_mask
    inputs.encoder_attention_mask = torch.zeros_like(mask)
    assert rel_err(parity.forward(model, inputs), ref) > 1e-2
    inputs.encoder_attention_mask = mask
    model.temp_pos_embed.zero_()
    assert rel_err(parity.forward(model, inputs), ref) > 1e-2


def test_a_mask_per_video_query_is_refused():
    model, inputs = _build(SHAPES[0])
    inputs.encoder_attention_mask = inputs.encoder_attention_mask.expand(-1, 35, -1)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="encoder_attention_mask as a key bias"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.foreign_processor_refused(
    tiny_latte, ADAPTER, "transformer_blocks.1.attn1", AttnProcessor)


def test_fused_qkv_is_refused():
    from diffusers.models.attention_processor import FusedAttnProcessor2_0

    model = tiny_latte()
    model.transformer_blocks[0].attn1.fuse_projections()
    model.transformer_blocks[0].attn1.set_processor(FusedAttnProcessor2_0())
    with pytest.raises(NotImplementedError, match="FusedAttnProcessor2_0"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_blocks_other_than_latte_1s_are_refused():
    from diffusers import LatteTransformer3DModel

    model = LatteTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                                    cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=8)
    with pytest.raises(NotImplementedError, match="norm_type='layer_norm'"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")
