"""Whole tiny CogVideoX and Mochi pipelines through ``usp_dit.enable_usp``: the grid's video equals one process's.

One spawned group of 4 ranks. Each rank first runs the stock pipeline itself (the one-process
result: same seeded models, prompt and generator everywhere), then, for grids (U, R, cfg) =
(2, 2, 1) (27 video tokens over 4 ranks: uneven) and (1, 2, 2) (the [uncond, cond] batch split
over two cfg groups of a 2-rank ring), ``enable_usp(pipe, ...)``, runs the pipeline's real
``__call__`` (T5 text encoder, 2 denoising steps with classifier-free guidance, VAE decode),
``disable_usp`` and runs again: that last video must be bit-identical to the first. CogVideoX
runs as text-to-video and as image-to-video (the image's latents concatenated on channels). The bare
transformers also go through ``enable_usp`` with cfg 2 (Mochi with a prompt mask that differs
between the two batch elements, so each cfg group gets its own).

Tolerances (max|err| / max|ref|, float32): 1e-5 on the transformer outputs and the final latents,
1e-4 on the decoded frames. Each transformer call differs from one process's by float32 summation
order only (a few 1e-7, tests/test_pipeline_*.py); guidance (CogVideoX: 7 * cond - 6 * uncond)
multiplies that to ~1.5e-6 in the latents. The decode is the same function on every rank, but an
untrained random VAE has a large gain: it turns CogVideoX's 1.5e-6 into ~1.4e-5 in the frames
(measured), hence 1e-4 there.
"""
from __future__ import annotations

import functools
import inspect

import pytest
import torch

import usp_dit
from usp_dit.demo.tiny_video import (
    cogvideox_inputs, mochi_inputs, gradient_image, tiny_cogvideox, tiny_cogvideox_pipeline, tiny_mochi,
    tiny_mochi_pipeline,
)
from usp_dit.testing import assert_no_crash, rel_err, run_spawned

TOL = {"out": 1e-5, "latents": 1e-5, "frames": 1e-4}
WORLD = 4
GRIDS = [(2, 2, 1), (1, 2, 2)]  # (ulysses, ring, cfg)
PROMPT, NEGATIVE = "a red fox jumps over a log", "blurry"
PIPELINES = {  # name -> (builder, frames): all give 3 latent frames x 3 x 3 patches = 27 tokens at 48 x 48
    "cogvideox": (tiny_cogvideox_pipeline, 9),
    "cogvideox-i2v": (functools.partial(tiny_cogvideox_pipeline, image_to_video=True), 9),
    "mochi": (tiny_mochi_pipeline, 13),
}


def generate(pipe, num_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(final latents, frames (B, F, 3, H, W) in [0, 1])`` of 2 steps at 48 x 48, seed 0."""
    last = {}

    def keep_latents(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return {}

    extra = {"image": gradient_image(48, 48)} if "image" in inspect.signature(pipe.__call__).parameters else {}
    frames = pipe(
        prompt=PROMPT, negative_prompt=NEGATIVE, **extra, height=48, width=48, num_frames=num_frames, num_inference_steps=2,
        max_sequence_length=32, generator=torch.Generator().manual_seed(0), output_type="pt",
        callback_on_step_end=keep_latents,
    ).frames
    return last["latents"], frames


def pipeline_errors(name: str) -> dict[str, dict[str, float]]:
    build, frames = PIPELINES[name]
    pipe = build(max_text_len=32)
    pipe.set_progress_bar_config(disable=True)
    ref_latents, ref_frames = generate(pipe, frames)
    results = {}
    for u, r, c in GRIDS:
        usp_dit.enable_usp(pipe, ulysses_degree=u, ring_degree=r, cfg_degree=c)
        try:
            latents, out = generate(pipe, frames)
        finally:
            usp_dit.disable_usp(pipe)
        results[f"{name}-u{u}r{r}cfg{c}"] = {"latents": rel_err(latents, ref_latents), "frames": rel_err(out, ref_frames)}
    latents, out = generate(pipe, frames)
    results[f"{name}-after-disable"] = {
        "not_bit_identical": float(not (torch.equal(latents, ref_latents) and torch.equal(out, ref_frames)))
    }
    return results


def _transformer_case(model, inputs) -> dict[str, float]:
    with torch.no_grad():
        ref = model(**inputs.kwargs(), return_dict=False)[0]
        usp_dit.enable_usp(model, ulysses_degree=1, ring_degree=2, cfg_degree=2)
        try:
            out = model(**inputs.kwargs(), return_dict=False)[0]
        finally:
            usp_dit.disable_usp(model)
    return {"out": rel_err(out, ref)}


def transformer_errors() -> dict[str, dict[str, float]]:
    cog = tiny_cogvideox("5b")
    mochi = tiny_mochi()
    return {
        "cogvideox-transformer-cfg2": _transformer_case(cog, cogvideox_inputs(cog, 3, 6, 6)),
        "mochi-transformer-cfg2": _transformer_case(mochi, mochi_inputs(mochi, 3, 6, 6, valid=[6, 2])),
    }


def _run_all() -> dict[str, dict | str]:
    results = {}
    for fn, arg in [(transformer_errors, None)] + [(pipeline_errors, name) for name in PIPELINES]:
        try:
            results.update(fn() if arg is None else fn(arg))
        except Exception as exc:  # recorded, asserted by the parent
            results[f"{fn.__name__}({arg})"] = f"{type(exc).__name__}: {exc}"
    return results


@pytest.fixture(scope="module")
def results():
    per_rank = run_spawned(_run_all, WORLD)
    assert_no_crash(per_rank)
    for rank, res in enumerate(per_rank):
        failed = {k: v for k, v in res.items() if isinstance(v, str)}
        assert not failed, f"rank {rank}: {failed}"
    return per_rank


KEYS = ["cogvideox-transformer-cfg2", "mochi-transformer-cfg2"] + [
    f"{name}-u{u}r{r}cfg{c}" for name in PIPELINES for u, r, c in GRIDS
]


@pytest.mark.parametrize("key", KEYS)
def test_grid_matches_one_process(results, key: str):
    for rank, res in enumerate(results):
        worst = {k: v for k, v in res[key].items() if not v <= TOL[k]}
        assert not worst, f"rank {rank}: above {TOL}: {worst}"


@pytest.mark.parametrize("name", list(PIPELINES))
def test_disable_usp_gives_back_bit_identical_video(results, name: str):
    for rank, res in enumerate(results):
        assert res[f"{name}-after-disable"]["not_bit_identical"] == 0.0, f"rank {rank}"
