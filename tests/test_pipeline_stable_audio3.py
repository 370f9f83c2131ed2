"""Stable Audio 3 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Model: a tiny 2-layer ``StableAudio3DiTModel`` (4 heads x 16,
differential self- and cross-attention, RMS QK-norms, partial RoPE, 7 memory tokens, every weight
perturbed, the zero-initialised convolutions and inpainting projections included;
``usp_dit.demo.tiny_stable_audio3``) on 16 and 26 latent frames: with the memory tokens 23 and 33
tokens, dividing neither 2 nor 4. The memory boundary falls inside shards differently per grid
(Note [Stable Audio 3's memory boundary on a shard]): 23 tokens on 4 ranks leave rank 0 six memory
tokens and no frame, rank 1 one memory token and five frames; 33 on 4 leave rank 0 all seven and
two frames. The 16-frame shape carries an inpainting condition (a keep-mask that differs per
element, the masked latent), which the blocks add to the frames only. Batch 2 with a different
latent, prompt, timestep and duration per element, text masks of different valid lengths (2 and 6
of 6).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
the forced ring schedules "stream" and "gather_merge" on one ring grid per shape (Note [schedules in
CI]). Each case: output vs stock, block 0's self-attention sees at most ceil(tokens / P) tokens,
after ``disable`` the output is bit-identical. On 2 and on 4 ranks: every parameter's gradient, and
on 4 ranks with gradient checkpointing (the blocks' arguments passed positionally). The transformer
enabled with cfg_degree=2 equals stock. Each rank's RoPE rows in block 0's self-attention are the
same rows of the whole table. The tiny ``StableAudio3Pipeline`` (T5Gemma encoder, duration
embedder, SAME autoencoder, flow-matching Euler; batched CFG [uncond, cond] in one call, prompts of
different lengths) through ``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2), and the tiny
``StableAudio3InpaintPipeline`` (no CFG; its inpainting condition through the blocks) on (2,1,1) and
(2,2,1), 2 steps each, equal to one process's (final latents 1e-5, decoded audio 1e-4: an untrained
random autoencoder's gain, as in tests/test_pipeline_wan.py); after ``disable_usp`` bit-identical.
(``StableAudio3AudioToAudioPipeline`` calls the transformer as the text-to-audio one does, without
CFG: not run here.) The compiled case is in tests/test_compile_grid.py (ADAPTER_CASES).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and gradients: sharding only reorders
float32 sums (both attention calls of a differential attention merged by log-sum-exp over blocks of
keys; everything else is the stock arithmetic per token).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from diffusers.models.transformers.transformer_stable_audio3 import StableAudio3SelfAttnProcessor

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_stable_audio3 import (
    NUM_MEMORY,
    SAMPLING_RATE,
    stable_audio3_inputs,
    tiny_stable_audio3,
    tiny_stable_audio3_pipeline,
)
from usp_dit.pipelines.families.stable_audio3 import ADAPTER, memory_split
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_AUDIO = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    frames: int  # latent frames; the model attends over NUM_MEMORY + frames tokens
    inpaint: bool  # an inpainting condition (local_add_cond)

    def __str__(self) -> str:
        return f"{self.frames}f" + ("-inpaint" if self.inpaint else "")


SHAPES = [Shape(16, True), Shape(26, False)]


def _build(shape: Shape, seed: int = 0):
    return tiny_stable_audio3(seed=seed), stable_audio3_inputs(shape.frames, [2, 6], inpaint=shape.inpaint)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].self_attn,
                                      NUM_MEMORY + shape.frames)


def _gradient_case(shape: Shape, mesh) -> dict[str, float]:
    return parity.gradient_errors(*_build(shape), ADAPTER, mesh)


def _rope_rows_case(mesh) -> dict[str, float]:
    """Each rank's RoPE rows in block 0's self-attention equal the same rows of the whole table."""
    model, inputs = _build(SHAPES[0])
    seen = []
    hook = model.transformer_blocks[0].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["rope"]), with_kwargs=True)
    ADAPTER.enable(model, mesh, "auto")
    try:
        parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
        hook.remove()
    want = shard_sequence(model.rotary_pos_emb(NUM_MEMORY + SHAPES[0].frames, torch.device("cpu")), mesh, dim=0)
    got = seen[0]
    return {"not_cut": float(got.shape != want.shape), "rows": rel_err(got, want) if got.shape == want.shape else 1.0}


PROMPTS = (["a dog barks", "rain"], ["noise", "low quality"])  # of different lengths: padded, masked
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last splits [uncond, cond] over cfg
INPAINT_GRIDS = [(2, 1, 1), (2, 2, 1)]  # no CFG in the inpainting pipeline
DURATION = 2.0  # seconds: 16 latent frames + 7 memory tokens = 23 tokens


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, audio) of 2 steps, batched CFG, seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(
        pipe, "audios", prompt=prompt, negative_prompt=negative_prompt, guidance_scale=3.0, duration=DURATION,
        num_inference_steps=2, generator=torch.Generator().manual_seed(0),
    )


def _inpaint(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, audio) of 2 inpainting steps, a different masked span per element, seed 0."""
    audio = torch.randn(2, 2, int(DURATION * SAMPLING_RATE), generator=torch.Generator().manual_seed(1))
    return parity.latents_and(
        pipe, "audios", prompt=PROMPTS[0], duration=DURATION, audio=audio, mask_start_seconds=[0.5, 1.0],
        mask_end_seconds=[1.5, 1.75], num_inference_steps=2, generator=torch.Generator().manual_seed(0),
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    names = ("latents", "audios")
    results = parity.pipeline_cases(tiny_stable_audio3_pipeline("text"), _generate,
                                    parity.pipeline_grids(PIPELINE_GRIDS),
                                    names=names)
    return {**results, **parity.pipeline_cases(tiny_stable_audio3_pipeline("inpaint"), _inpaint,
                                               parity.pipeline_grids(INPAINT_GRIDS, "inpaint"), names=names,
                                               after_disable="inpaint-after-disable")}


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    # gradient checkpointing: the model passes the blocks' arguments (local_seq, num_memory_tokens)
    # positionally, and block 0's recompute shards its saved input again
    parity.record(results, "grad-checkpointing",
                  lambda: parity.checkpointed_gradient_errors(*_build(SHAPES[0]), ADAPTER, init_usp(2, 2)))
    parity.record(results, "rope-rows", lambda: _rope_rows_case(init_usp(1, 4)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES), TOL,
)


def test_gradients_with_checkpointing_match_one_process(grid_results):
    parity.assert_within(grid_results, "grad-checkpointing", TOL)


def test_rope_rows_of_each_rank_match_one_process(grid_results):
    parity.assert_within(grid_results, "rope-rows", TOL, {"not_cut": 0.0})


def test_cfg_split_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS]
                         + [f"inpaint-u{u}r{r}cfg{c}" for u, r, c in INPAINT_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"audios": TOL_AUDIO}, fallback="pipeline")


@pytest.mark.parametrize("key", ["pipeline-after-disable", "inpaint-after-disable"])
def test_disable_usp_gives_back_the_bit_identical_audio(grid_results, key: str):
    parity.assert_within(grid_results, key, 0.0)


# ---- single process: the memory boundary, restore exactly, loud failures --------------------------


@pytest.mark.parametrize(("lo", "hi", "memory", "frames"), [
    (0, 6, 6, (0, 0)), (6, 12, 1, (0, 5)), (12, 18, 0, (5, 11)), (0, 9, 7, (0, 2)), (0, 3, 3, (0, 0)),
])
def test_memory_split_of_a_shard(lo: int, hi: int, memory: int, frames: tuple[int, int]):
    """Note [Stable Audio 3's memory boundary on a shard], with 7 memory tokens."""
    got_memory, got_frames = memory_split(lo, hi, 7)
    assert (got_memory, got_frames.start, got_frames.stop) == (memory, *frames)


test_one_rank_is_bit_identical_to_stock = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[0]), ADAPTER)


def test_inpainting_and_memory_change_the_output():
    """What the grid cases cover matters: the inpainting condition and the memory tokens each change the output."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    inputs.local_add_cond = inputs.local_add_cond.roll(1, dims=2)
    assert rel_err(parity.forward(model, inputs), ref) > 1e-3
    model, inputs = _build(SHAPES[0])
    with torch.no_grad():
        model.memory_tokens.mul_(-1)
    assert rel_err(parity.forward(model, inputs), ref) > 1e-3


def test_an_inpainting_condition_of_the_wrong_length_is_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        inputs.hidden_states = inputs.hidden_states[:, :, :-1]
        with pytest.raises(ValueError, match="local_add_cond has 16 frames but the transformer has 22 tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


class _CustomProcessor(StableAudio3SelfAttnProcessor):
    """A subclass of stock's self-attention processor: not stock's, so not known to be routable."""


test_a_custom_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_stable_audio3, ADAPTER, "transformer_blocks.1.self_attn", _CustomProcessor)
