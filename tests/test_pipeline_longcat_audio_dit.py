"""LongCat-AudioDiT adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Model: a tiny 2-block
``LongCatAudioDiTTransformer`` (4 heads x 16 head_dim; the release's text ConvNeXt stack, QK norm,
long skip and latent condition; every weight perturbed, the zero-initialised AdaLN, GRN and output
layers too; ``usp_dit.demo.tiny_longcat_audio_dit``). 13 latent frames (13 audio tokens: divides
neither 2 nor 4) with the all-True audio mask the pipeline passes; batch 2 with a different latent,
condition, timestep and prompt per element, the prompts of different valid lengths (9 and 6 of 9,
padded as the pipeline pads to the longest); the RoPE positions are the model's own (0 .. seq - 1),
checked per rank through the rotated Q/K.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2)
(tests/adapter_parity.GRIDS); each ring grid also with the "stream" and "gather_merge" schedules
forced (adapter_parity Note [schedules in CI]). Each case: output vs the stock output, block 0's
attention sees at most ceil(tokens / P) tokens, and after ``disable`` the output is bit-identical.
The "local" AdaLN variant (per block, from the text's masked mean) on (2,2). Every parameter's
gradient (loss / P on each rank, summed over the sequence group, equals one process's) on 2 and 4
ranks (the model declares no gradient checkpointing). An audio mask with padded frames is refused
(Note [LongCat-AudioDiT's audio mask]). Fullgraph compile: the whole enabled model in one Dynamo
graph on (2,2) equals eager (backend "eager": a graph break fails as under inductor, at half the
time of "aot_eager").

Pipeline: the tiny ``LongCatAudioDiTPipeline`` (UMT5 over a character tokenizer, LongCat VAE; two
prompts and a negative prompt of another length; 2 steps; true CFG: two transformer calls a step)
through ``pipe.enable_usp()`` on (2,1) and (2,2), and with ``cfg_degree=2`` on (1,2,2) (the two calls
of a step on the two cfg groups at once: ``steps + 1`` transformer computations per rank instead of
``2 * steps``), equal one process's; after ``disable_usp`` bit-identical.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the pipeline's final latents. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks). The decoded audio: 1e-4
(an untrained random VAE's gain, as in tests/test_video_pipelines.py).
"""
from __future__ import annotations

import functools

import pytest
import torch
from diffusers.models.transformers import transformer_longcat_audio_dit

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_longcat_audio_dit import (
    longcat_audio_dit_inputs,
    tiny_longcat_audio_dit,
    tiny_longcat_audio_dit_pipeline,
)
from usp_dit.pipelines.families import longcat_audio_dit
from usp_dit.pipelines.families.longcat_audio_dit import ADAPTER

TOL = 1e-5
TOL_AUDIO = 1e-4
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas
FRAMES = 13
STEPS = 2

SHAPES = [f"s{FRAMES}"]


def _build(adaln_type: str = "global", seed: int = 0):
    return tiny_longcat_audio_dit(adaln_type=adaln_type, seed=seed), longcat_audio_dit_inputs(FRAMES)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: str, mesh, adaln_type: str = "global") -> dict[str, float]:
    """Output vs stock, block 0's attention length vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(adaln_type)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.blocks[0].self_attn, FRAMES)


def _gradient_case(shape: str, mesh) -> dict[str, float]:
    return parity.gradient_errors(*_build(), ADAPTER, mesh)


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, audio) of 2 steps with true CFG, two prompts, 2.6 s (13 audio tokens)."""
    return parity.latents_and(pipe, "audios", prompt=["soft ocean ambience", "rain on a tin roof"],
                              negative_prompt="noise", audio_duration_s=2.6, num_inference_steps=STEPS,
                              generator=torch.Generator().manual_seed(0), output_type="pt")


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # (U, R, cfg)


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "adaln-local-u2r2", lambda: _output_case(SHAPES[0], init_usp(2, 2), adaln_type="local"))
    # each rank's rotated Q/K of block 0 equal the same rows of one process's (the audio RoPE rows cut
    # like the tokens)
    parity.record(results, "rotated-qk",
                  lambda: parity.rotated_qk_case(*_build(), ADAPTER, init_usp(2, 2), transformer_longcat_audio_dit))
    two_heads = tiny_longcat_audio_dit(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "compiled", lambda: parity.compiled_case(*_build(), init_usp(2, 2), backend="eager"))
    parity.record(results, "pipeline", lambda: parity.pipeline_cases(
        tiny_longcat_audio_dit_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS),
        names=("latents", "audios"), check_enabled=False,
        probe=functools.partial(parity.cfg_pair_computations, steps=STEPS, blocks="blocks")), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    # check_groups=False: the compiled case's torch compile caches (functional collectives' graphs)
    # keep references to the process groups past the job, as in tests/test_compile_grid.py.
    return parity.spawn_grid(_run_all, WORLD, check_groups=False)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES), TOL,
)


def test_local_adaln_variant_matches_one_process(grid_results):
    parity.assert_within(grid_results, "adaln-local-u2r2", TOL)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


def test_whole_model_compiles_fullgraph_in_one_graph(grid_results):
    parity.assert_within(grid_results, "compiled", TOL)


@pytest.mark.parametrize("key", list(parity.pipeline_grids(PIPELINE_GRIDS)))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, 0.0, {"latents": TOL, "audios": TOL_AUDIO}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_audio(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: loud failures ----------------------------------------------------------------


def test_an_audio_mask_with_padded_frames_is_refused():
    model, inputs = _build()
    inputs.attention_mask[1, -3:] = False
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask marks padded audio frames"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_no_audio_mask_runs_as_stock():
    model, _ = _build()
    inputs = longcat_audio_dit_inputs(FRAMES, audio_mask=False)
    ref = parity.forward(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        assert torch.equal(parity.forward(model, inputs), ref)
    finally:
        ADAPTER.disable(model)


test_a_foreign_cross_attention_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_longcat_audio_dit, ADAPTER, "blocks.1.cross_attn")
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_longcat_audio_dit, ADAPTER, longcat_audio_dit, "_RoutedSelfAttnProcessor")
