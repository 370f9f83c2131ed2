"""Wan VACE adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids run on it as two data-parallel
replicas of 2 ranks). Model: a tiny 3-layer ``WanVACETransformer3DModel`` with control blocks at
layers 0 and 2 (4 heads x 16 head_dim, every weight perturbed, hint projections included;
``usp_dit.demo.tiny_wan_vace``). Two shapes, batch 2 with a different prompt, timestep and
control per element: 45 video tokens with as many control tokens and a random scale per hint;
27 video tokens with a control latent of 2 frames out of 3 (18 control tokens, zero-padded to 27 by
the model: the padding must land on the same tokens as on one process) and the default scales.
Neither count divides 2 or 4.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
the stock output; block 0's and control block 0's self-attention each see at most
ceil(tokens / P) tokens; after ``disable`` the output is bit-identical. On 2 and 4 ranks every
parameter's gradient (loss / P on each rank, summed over the sequence group) equals one
process's, and once with gradient checkpointing (control block 0's recompute re-cuts its saved
whole inputs). The stock ``WanVACEPipeline``, built tiny (T5, Wan VAE; a random control video,
a mask over its left half, one reference image: 5 latent frames x 3 x 5 = 75 tokens; 2 steps with
guidance, two calls a step), through ``pipe.enable_usp()`` on (2,1) and (2,2), and with
``cfg_degree=2`` (a step's two calls on the two cfg groups), equal to one process; after
``disable_usp`` the video is bit-identical.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, every parameter's gradient and the
pipeline's final latents: sharding only reorders float32 sums (attention merged by log-sum-exp,
gradients summed over ranks). Decoded frames: 1e-4 (an untrained random VAE's gain, as in
tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_wan import wan_tokens
from usp_dit.demo.tiny_wan_vace import tiny_wan_vace, tiny_wan_vace_pipeline, wan_prompt_embeds, wan_vace_inputs
from usp_dit.pipelines.families.wan_vace import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    frames: int  # latent sizes
    height: int
    width: int
    control_frames: int
    scales: bool  # a random scale per hint, else the model's default ones

    def __str__(self) -> str:
        return f"f{self.frames}c{self.control_frames}h{self.height}w{self.width}" + ("-scaled" if self.scales else "")


SHAPES = [
    Shape(3, 6, 10, 3, True),  # 45 video and control tokens
    Shape(3, 6, 6, 2, False),  # 27 video tokens, 18 control tokens padded to 27
]


def _build(shape: Shape, seed: int = 0):
    model = tiny_wan_vace(seed=seed)
    inputs = wan_vace_inputs(model, shape.frames, shape.height, shape.width, shape.control_frames, scales=shape.scales)
    return model, inputs


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock; the longest sequence block 0's and control block 0's ``attn1`` saw vs
    ceil(S / P) while enabled; bit-identity after disable."""
    model, inputs = _build(shape)
    tokens = wan_tokens(model, shape.frames, shape.height, shape.width)
    ref = parity.forward(model, inputs)
    lengths = {"blocks.0": [], "vace_blocks.0": []}
    hooks = [model.get_submodule(f"{name}.attn1").register_forward_pre_hook(
        lambda m, args, name=name: lengths[name].append(args[0].shape[1])) for name in lengths]
    ADAPTER.enable(model, mesh, "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
        for h in hooks:
            h.remove()
    again = parity.forward(model, inputs)
    bound = math.ceil(tokens / mesh.sequence_degree)
    errors = {"out": rel_err(out, ref), "disable_not_bit_identical": float(not torch.equal(again, ref))}
    for name, seen in lengths.items():
        errors[f"{name}_tokens_above_ceil"] = float(not seen or max(seen) > bound)
    return errors


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[1])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


# ---- the stock pipeline ---------------------------------------------------------------------------

PROMPT_LEN = 16


def _conditions() -> dict:
    """A random 13-frame control video at 48 x 80, a mask over its left half, one reference image."""
    g = np.random.default_rng(0)
    video = [Image.fromarray(g.integers(0, 256, (48, 80, 3), dtype=np.uint8)) for _ in range(13)]
    left = np.where(np.arange(80) < 40, 255, 0).astype(np.uint8)[None, :].repeat(48, 0)
    mask = [Image.fromarray(left, mode="L")] * 13
    reference = Image.fromarray(g.integers(0, 256, (40, 64, 3), dtype=np.uint8))
    return dict(video=video, mask=mask, reference_images=reference)


def _generate(pipe, embeds: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of 2 guided steps at 48 x 80 x 13 frames + 1 reference (75 tokens)."""
    return parity.latents_and(
        pipe, "frames",
        prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], height=48, width=80, num_frames=13,
        num_inference_steps=2, conditioning_scale=[0.7, 1.3], generator=torch.Generator().manual_seed(0),
        output_type="pt", **_conditions(),
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_wan_vace_pipeline(PROMPT_LEN)
    pipe.set_progress_bar_config(disable=True)
    embeds = (wan_prompt_embeds(pipe, "a red fox jumps over a log", PROMPT_LEN),
              wan_prompt_embeds(pipe, "blurry", PROMPT_LEN))
    grids = {"pipeline-u2r1": (2, 1, 1), "pipeline-u2r2": (2, 2, 1), "pipeline-cfg2": (1, 1, 2)}
    return parity.pipeline_cases(pipe, lambda p: _generate(p, embeds), grids, names=("latents", "frames"),
                                 check_enabled=False)


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_wan_vace(num_heads=2, head_dim=32), ADAPTER,
                                                          init_usp(4, 1)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", ["pipeline-u2r1", "pipeline-u2r2", "pipeline-cfg2"])
def test_pipeline_matches_one_process(grid_results, key: str):
    """The stock WanVACEPipeline through ``pipe.enable_usp`` on (2,1), (2,2) and with cfg_degree=2."""
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process -------------------------------------------------------------------------------


def test_control_tokens_unlike_the_video_are_refused():
    """Control block 0 called directly with fewer control tokens than the RoPE table's rows: the
    cut would misalign them, so the hook raises (the stock forward pads them, so this is a misuse)."""
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        patch = model._usp_dit_patch
        patch.state.seq_len = 45
        x = torch.randn(2, 45, 64)
        with pytest.raises(ValueError, match="control_hidden_states of 44 tokens but the RoPE table has 45 rows"):
            model.vace_blocks[0](x, inputs.encoder_hidden_states, x[:, :44], torch.zeros(2, 6, 64), None)
    finally:
        ADAPTER.disable(model)


def test_wan_prompt_embeds_are_the_vace_pipelines_own_encoding():
    """``wan_prompt_embeds`` (what the tests and the example pass, as the VACE pipeline's prompt
    cleaning needs ftfy) equals ``WanVACEPipeline.encode_prompt`` with ftfy's fix as the identity
    (what it does to plain ASCII prompts), both branches, bit for bit."""
    from types import SimpleNamespace
    from unittest import mock

    from diffusers.pipelines.wan import pipeline_wan_vace

    pipe = tiny_wan_vace_pipeline(PROMPT_LEN)
    with mock.patch.object(pipeline_wan_vace, "ftfy", SimpleNamespace(fix_text=lambda t: t), create=True):
        cond, uncond = pipe.encode_prompt("a red fox", "blurry", max_sequence_length=PROMPT_LEN)
    assert torch.equal(cond, wan_prompt_embeds(pipe, "a red fox", PROMPT_LEN))
    assert torch.equal(uncond, wan_prompt_embeds(pipe, "blurry", PROMPT_LEN))


def test_video_example_wan_vace_defaults(monkeypatch):
    from tests.test_examples_cli import _example

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    example = _example("generate_video")
    args = example.parse_args(["--model", "wan_vace"])
    assert (args.frames, args.height, args.width, args.degrees) == (9, 96, 144, (1, 1, 1))
    assert example.FAMILIES["wan_vace"].cfg == "two calls" and "wan_vace" in example.EMBEDS_FAMILIES
