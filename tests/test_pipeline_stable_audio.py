"""Stable Audio adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Model: a tiny 2-layer ``StableAudioDiTModel`` (4 heads x 16, partial
RoPE over the first 8 channels of each head, GQA cross-attention with 2 K/V heads, every weight
perturbed; ``usp_dit.demo.tiny_stable_audio``) on 22 and 32 latent frames: with the prepended
global token 23 and 33 tokens, dividing neither 2 nor 4 (on 4 ranks rank 0 holds the global token
and 5 or 8 frames). Batch 2 with a different latent, prompt, timestep and seconds embedding per
element; the first shape with a cross-attention text mask of different valid lengths (2 and 6 of 6),
the second without; the RoPE table as the pipeline makes it.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
the forced ring schedules "stream" and "gather_merge" on one ring grid per shape (Note [schedules in
CI]). Each case: output vs stock, block 0's self-attention sees at most ceil(tokens / P) tokens,
after ``disable`` the output is bit-identical. On 2 and on 4 ranks: every parameter's gradient. The
transformer enabled with cfg_degree=2 on a batch of 2 equals stock. Each rank's RoPE rows in block
0's self-attention are the same rows of the whole table (the global token at position 0 included).
The tiny ``StableAudioPipeline`` (T5 encoder, seconds projection, Oobleck VAE, EDM DPM-Solver++,
23 tokens; two prompts and two negative prompts of different lengths, batched CFG [uncond, cond] in
one call) through ``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2), 2 steps, equal to one
process's (final latents 1e-5, decoded audio 1e-4: an untrained random VAE's gain, as in
tests/test_pipeline_wan.py); after ``disable_usp`` bit-identical. The compiled case is in
tests/test_compile_grid.py (ADAPTER_CASES).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and gradients: sharding only reorders
float32 sums (attention merged by log-sum-exp over blocks of keys; everything else is the stock
arithmetic per token).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_stable_audio import stable_audio_inputs, tiny_stable_audio, tiny_stable_audio_pipeline
from usp_dit.pipelines.families.stable_audio import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_AUDIO = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    frames: int  # latent frames; the model attends over 1 + frames tokens
    masked: bool  # a cross-attention text mask of different valid lengths per element

    def __str__(self) -> str:
        return f"{self.frames}f" + ("-masked" if self.masked else "")


SHAPES = [Shape(22, True), Shape(32, False)]


def _build(shape: Shape, seed: int = 0):
    model = tiny_stable_audio(seed=seed)
    return model, stable_audio_inputs(model, shape.frames, [2, 6] if shape.masked else None)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.frames + 1)


def _gradient_case(shape: Shape, mesh) -> dict[str, float]:
    """Every parameter's gradient, summed over the sequence group (each rank's loss L / P), vs one
    process's; the frozen Fourier timestep weights too (made trainable here: a gradient to check)."""
    model, inputs = _build(shape)
    model.time_proj.weight.requires_grad_(True)
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _rope_rows(model, inputs) -> torch.Tensor:
    """The cos table block 0's self-attention rotated its queries with (S or S_local, rot_dim): the
    stock processor imports ``apply_rotary_emb`` at each call, so a patch of it sees the rows used."""
    from diffusers.models import embeddings

    seen = []
    stock = embeddings.apply_rotary_emb

    def keep(x, freqs_cis, *args, **kwargs):
        seen.append(freqs_cis[0])
        return stock(x, freqs_cis, *args, **kwargs)

    with mock.patch.object(embeddings, "apply_rotary_emb", keep):
        parity.forward(model, inputs)
    return seen[0]


def _rope_rows_case(mesh) -> dict[str, float]:
    """Each rank's RoPE rows equal the same rows of the whole table; 1.0 if the table was not cut."""
    model, inputs = _build(SHAPES[0])
    full = inputs.rotary_embedding[0]
    ADAPTER.enable(model, mesh, "auto")
    try:
        got = _rope_rows(model, inputs)
    finally:
        ADAPTER.disable(model)
    want = shard_sequence(full, mesh, dim=0)
    return {"not_cut": float(got.shape != want.shape), "rows": rel_err(got, want) if got.shape == want.shape else 1.0}


PROMPTS = (["a dog barks", "rain"], ["noise", "low quality"])  # of different lengths: padded, masked
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last splits [uncond, cond] over cfg


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, audio) of 2 steps at 22 latent frames (23 tokens), batched CFG, seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.decoded_latents_and(
        pipe, "audios", prompt=prompt, negative_prompt=negative_prompt, guidance_scale=3.0, num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_stable_audio_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS),
                                 names=("latents", "audios"))


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "rope-rows", lambda: _rope_rows_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES), TOL,
)


def test_rope_rows_of_each_rank_match_one_process(grid_results):
    parity.assert_within(grid_results, "rope-rows", TOL, {"not_cut": 0.0})


def test_cfg_split_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"audios": TOL_AUDIO}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_audio(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: restore exactly, loud failures ----------------------------------------------


test_one_rank_is_bit_identical_to_stock = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[0]), ADAPTER)


def test_text_mask_and_rope_change_the_output():
    """What the grid cases cover matters: the text mask and the RoPE table each change the output."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    inputs.encoder_attention_mask = torch.ones_like(inputs.encoder_attention_mask)
    assert rel_err(parity.forward(model, inputs), ref) > 1e-3
    model, inputs = _build(SHAPES[0])
    inputs.rotary_embedding = tuple(t.roll(1, dims=0) for t in inputs.rotary_embedding)
    assert rel_err(parity.forward(model, inputs), ref) > 1e-3


def test_an_audio_mask_is_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model(**inputs.kwargs(), attention_mask=torch.ones(2, SHAPES[0].frames, dtype=torch.bool))
    finally:
        ADAPTER.disable(model)


def test_a_rope_table_of_the_wrong_length_is_refused():
    model, inputs = _build(SHAPES[0])
    inputs.rotary_embedding = tuple(t[:-1] for t in inputs.rotary_embedding)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="rotary_embedding has 22 rows but the transformer has 23"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_a_custom_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_stable_audio, ADAPTER, "transformer_blocks.0.attn1", AttnProcessor2_0)
