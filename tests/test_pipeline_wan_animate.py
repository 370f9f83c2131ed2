"""Wan Animate adapter and pipeline: sharded outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids run on it as two data-parallel
replicas of 2 ranks). Model: a tiny 2-layer ``WanAnimateTransformer3DModel`` with a face adapter
after each block, CLIP image tokens through the added K/V cross-attention (512 text tokens, as
the stock processor requires), a 16 x 16 face motion encoder (4 heads x 16 head_dim, every weight
perturbed; ``usp_dit.demo.tiny_wan_animate``). Batch 2 with a different prompt, image, pose, face
video and timestep per element. Two shapes: 3 latent frames (reference + 2) of 3 x 5 patches =
45 tokens (5 face frames), and 5 latent frames of 1 x 3 patches = 15 tokens (13 face frames), so
that on every grid some rank's tokens begin or end mid-frame (Note [face attention by frame]: 45
on 4 ranks is 12 | 11 | 11 | 11 against frames of 15; 15 on 4 ranks 4 | 4 | 4 | 3 against frames
of 3). Neither count divides 2 or 4.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
the stock output; block 0's self-attention and face adapter 0 each see at most ceil(tokens / P)
tokens; after ``disable`` the output is bit-identical. On 2 and 4 ranks every parameter's gradient
(loss / P on each rank, summed over the sequence group; the face encoders' included) equals one
process's, and once with gradient checkpointing. ``frame_runs`` is checked against a direct
per-token frame count on one process.

The stock ``WanAnimatePipeline`` (tiny T5, CLIP vision tower, Wan VAE and transformer:
``tiny_wan_animate_pipeline``) through ``pipe.enable_usp()``, batch 2 (two prompts), seeded PIL
reference image, pose and face videos at 48 x 80 in segments of 5 frames (45 tokens a call):
"animate" mode with true CFG (two transformer calls a step, the negative prompt's and a blanked
face video's) on (2,1,1), (2,2,1) and (1,2,2); on (1,2,2) the two cfg groups run a step's two
calls at once (block 0 runs steps + 1 times a rank); "replace" mode (background and mask videos) over 9
frames, two segments (the second conditioned on the first's last decoded frame), on (1,4,1). Final
latents and decoded frames vs one process's; the transformer enabled, then restored; after
``disable_usp`` the video is bit-identical. The example's tiny default (examples/generate_video.py
--model wan_animate) builds and runs on one process. Latents: 1e-5 as above.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and every parameter's gradient:
sharding only reorders float32 sums (attention merged by log-sum-exp; the face attention of a
partial frame is its own kernel call over the same keys; gradients summed over ranks). Decoded
frames: 1e-4 (the untrained random VAE's gain on the latents' float32 rounding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_wan import I2V_TEXT_LEN
from tests.test_examples_cli import one_rank  # noqa: F401  (the fixture: no RANK / WORLD_SIZE)
from usp_dit.demo.tiny_wan_animate import (
    tiny_wan_animate,
    tiny_wan_animate_pipeline,
    wan_animate_inputs,
    wan_animate_videos,
)
from usp_dit.demo.tiny_wan_vace import wan_prompt_embeds
from usp_dit.pipelines.families.wan_animate import ADAPTER, frame_runs
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4


@dataclass(frozen=True)
class Shape:
    frames: int  # latent frames, the reference frame included
    height: int  # latent sizes
    width: int

    @property
    def tokens(self) -> int:
        return self.frames * (self.height // 2) * (self.width // 2)

    def __str__(self) -> str:
        return f"f{self.frames}h{self.height}w{self.width}"


SHAPES = [Shape(3, 6, 10), Shape(5, 2, 6)]  # 45 tokens (frames of 15), 15 tokens (frames of 3)


def _build(shape: Shape, seed: int = 0):
    model = tiny_wan_animate(seed=seed)
    return model, wan_animate_inputs(model, shape.frames, shape.height, shape.width)


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock; the longest sequence block 0's ``attn1`` and face adapter 0 saw vs
    ceil(S / P) while enabled; bit-identity after disable."""
    model, inputs = _build(shape)
    ref = parity.forward(model, inputs)
    lengths = {"blocks.0.attn1": [], "face_adapter.0": []}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda m, args, name=name: lengths[name].append(args[0].shape[1])) for name in lengths]
    ADAPTER.enable(model, mesh, "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
        for h in hooks:
            h.remove()
    again = parity.forward(model, inputs)
    bound = math.ceil(shape.tokens / mesh.sequence_degree)
    errors = {"out": rel_err(out, ref), "disable_not_bit_identical": float(not torch.equal(again, ref))}
    for name, seen in lengths.items():
        errors[f"{name}_tokens_above_ceil"] = float(not seen or max(seen) > bound)
    return errors


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


STEPS = 2
TOL_FRAMES = 1e-4  # decoded frames: an untrained random VAE's gain (as tests/test_pipeline_chronoedit.py)
HEIGHT, WIDTH = 48, 80  # 3 x 5 tokens a latent frame


def _generate(pipe, frames: int = 5, mode: str = "animate", **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents of the last segment, frames) of one ``WanAnimatePipeline`` call at 48 x 80 in
    segments of 5 frames (the reference latent frame + 2: 45 tokens, 5 face frames: 3 face
    positions of 15 tokens), 2 steps, batch 2 (two prompts' T5 embeds: the pipeline's prompt
    cleaning needs ftfy, which the tests do not), seeded PIL reference image, pose and face videos."""
    prompts = wan_prompt_embeds(pipe, ["a dancer spins", "a robot waves"], I2V_TEXT_LEN)
    negative = wan_prompt_embeds(pipe, ["blurry", "dark and dim"], I2V_TEXT_LEN)
    return parity.latents_and(
        pipe, "frames", **wan_animate_videos(frames, HEIGHT, WIDTH, replace=mode == "replace"), mode=mode,
        prompt_embeds=prompts, negative_prompt_embeds=negative, height=HEIGHT, width=WIDTH, segment_frame_length=5,
        num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs)


# (pipeline arguments, grids): "animate" with true CFG (two transformer calls a step: the negative
# prompt and a blanked face video, on the cfg axis at cfg 2); "replace" over 9 frames, no CFG: two
# segments, the second conditioned on the first's last decoded frame and the background video.
PIPELINE_RUNS = {
    "pipeline": ({"guidance_scale": 2.0}, [(2, 1, 1), (2, 2, 1), (1, 2, 2)]),
    "pipeline-replace": ({"mode": "replace", "frames": 9}, [(1, 4, 1)]),
}
PIPELINE_KEYS = [key for prefix, (_, grids) in PIPELINE_RUNS.items() for key in parity.pipeline_grids(grids, prefix)]


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """``WanAnimatePipeline`` (tiny: ``tiny_wan_animate_pipeline``) through ``pipe.enable_usp()`` on
    each run's grids, against the same pipeline on one process (``adapter_parity.pipeline_cases``);
    at cfg 2, block 0 runs ``steps + 1`` times a rank (``cfg_pair``)."""
    pipe = tiny_wan_animate_pipeline()
    results = {}
    for prefix, (kwargs, grids) in PIPELINE_RUNS.items():
        probe = (lambda p, grid: parity.cfg_pair_computations(p, grid, STEPS, "blocks")) if prefix == "pipeline" \
            else None
        results.update(parity.pipeline_cases(
            pipe, lambda p, kwargs=kwargs: _generate(p, **kwargs), parity.pipeline_grids(grids, prefix),
            names=("latents", "frames"), probe=probe,
            after_disable="pipeline-after-disable" if prefix == "pipeline" else None))
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_wan_animate(num_heads=2, head_dim=32), ADAPTER,
                                                          init_usp(4, 1)))
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", PIPELINE_KEYS)
def test_pipeline_matches_one_process(grid_results, key: str):
    """Latents within TOL, decoded frames within TOL_FRAMES, on every rank; the transformer enabled,
    then restored; at cfg 2 the two calls a step run at once (steps + 1 block-0 runs a rank)."""
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_the_video_example_builds_and_runs_the_tiny_wan_animate(one_rank):
    """examples/generate_video.py --model wan_animate: its tiny default pipeline on one process (1
    step, 5 frames: one segment, 3 x 3 x 5 = 45 tokens a call with the reference frame), seeded
    reference image, pose and face videos, RGB frames in [0, 1]."""
    from tests.test_examples_cli import _example

    ex = _example("generate_video")
    args = ex.parse_args(["--model", "wan_animate", "--steps", "1", "--frames", "5", "--height", "48",
                          "--width", "80"])
    pipe = ex.load_pipeline(args, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    frames = ex.generate(pipe, args)
    assert frames.shape == (5, 48, 80, 3) and bool((frames >= 0).all() and (frames <= 1).all())
    assert ex.video_tokens(args, pipe) == 45


# ---- single process -------------------------------------------------------------------------------


@pytest.mark.parametrize("start, stop, frame_len", [(0, 45, 15), (12, 23, 15), (4, 8, 3), (0, 12, 3), (5, 5, 3),
                                                    (1, 44, 7)])
def test_frame_runs_cover_each_token_with_its_frame(start: int, stop: int, frame_len: int):
    """Runs tile [start, stop) in order; each is whole frames or one partial frame; every token's
    run says its frame ``j // frame_len``."""
    frames_of_tokens = []
    for first, frames, tokens in frame_runs(start, stop, frame_len):
        assert frames == 1 or tokens == frames * frame_len
        per_frame = tokens // frames
        frames_of_tokens += [first + i // per_frame for i in range(tokens)]
    assert frames_of_tokens == [j // frame_len for j in range(start, stop)]


def test_tokens_that_do_not_split_into_the_face_frames_raise():
    """The face features' T frames must divide the tokens (stock's unflatten fails there too)."""
    model, inputs = _build(SHAPES[0])
    inputs.face_pixel_values = inputs.face_pixel_values[:, :, :-4]  # 1 face frame too few: T = 2 for 3 frames
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="45 video tokens do not split into the 2 frames of the face features"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_face_adapter_attention_mask_is_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        x = torch.randn(1, 6, 64)
        with pytest.raises(NotImplementedError, match="face adapter attention_mask"):
            model.face_adapter[0](x, torch.randn(1, 2, 3, 64), torch.ones(1, 6))
    finally:
        ADAPTER.disable(model)
