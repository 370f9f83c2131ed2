"""ACE-Step adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Model: a tiny 2-layer
``AceStepTransformer1DModel`` (layer 0 sliding-window, layer 1 full attention; 4 query heads and 2
K/V heads x 16 head_dim; every weight perturbed; ``usp_dit.demo.tiny_ace_step``). Latents of 25
frames (patch 2: 13 audio tokens, the last patch padded as stock does; 13 divides neither 2 nor
4), batch 2 with a different latent, context, condition and (t, r) per element; the RoPE positions
are the model's own (0 .. seq - 1), checked per rank through the rotated Q/K.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2)
(tests/adapter_parity.GRIDS); each ring grid also with the "stream" and "gather_merge" schedules
forced (adapter_parity Note [schedules in CI]). Each case: output vs the stock output, block 0's
attention sees at most ceil(tokens / P) tokens, and after ``disable`` the output is bit-identical.
Every parameter's gradient (loss / P on each rank, summed over the sequence group, equals one
process's) on 2 and 4 ranks, and with gradient checkpointing (the checkpointed path passes the
layers' arguments by position). A config of full-attention layers only, with a window narrower than
the sequence (21 frames, 11 tokens), on (2,2). A sliding window of 4 over the 13 tokens (a band that
hides pairs): exact on the grids without ring (2,1,1), (4,1,1) (4 query heads over 2 K/V heads:
each rank's K/V head copied) and (2,1,2), with gradients on 2 and 4 ranks; refused on every rank of
a ring grid and under a flash backend (Note [ACE-Step's sliding window]). Fullgraph compile: the whole enabled model
in one Dynamo graph on (2,2) equals eager (backend "eager": a graph break fails as under inductor,
at half the time of "aot_eager").

Pipeline: the tiny ``AceStepPipeline`` (Qwen3 text encoder over a character tokenizer, condition
encoder, Oobleck VAE; two prompts and lyrics; 2 steps of batched APG guidance: one call on the
[cond, null] batch) through ``pipe.enable_usp()`` on (2,1), (2,2) and with ``cfg_degree=2`` on
(1,2,2), equal one process's; after ``disable_usp`` bit-identical.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the pipeline's final latents. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks); the sliding layer's
all-zero mask, dropped, only changes which SDPA kernel stock uses. The decoded audio: 1e-4 (the
pipeline renormalises it to a peak of -1 dBFS: an untrained random VAE's gain on the latents' error).
"""
from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import ace_step_transformer

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_ace_step import ace_step_inputs, tiny_ace_step, tiny_ace_step_pipeline
from usp_dit.pipelines.families import ace_step
from usp_dit.pipelines.families.ace_step import ADAPTER

TOL = 1e-5
TOL_AUDIO = 1e-4
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas

SHAPES = ["f25"]  # latent frames: 13 audio tokens (the full-attention config: 21 frames, 11 tokens)


def _build(shape: str, seed: int = 0, **config):
    frames = int(shape[1:])
    return tiny_ace_step(seed=seed, **config), ace_step_inputs(frames), math.ceil(frames / 2)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: str, mesh, **config) -> dict[str, float]:
    """Output vs stock, block 0's attention length vs ceil(S / P), bit-identity after disable."""
    model, inputs, tokens = _build(shape, **config)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.layers[0].self_attn, tokens)


def _gradient_case(shape: str, mesh) -> dict[str, float]:
    model, inputs, _ = _build(shape)
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _band_gradient_case(mesh) -> dict[str, float]:
    """Gradients through the Ulysses band attention (a window of 4 over 13 tokens)."""
    model, inputs, _ = _build(SHAPES[0], sliding_window=4)
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _band_on_ring_case(mesh) -> dict[str, float]:
    """A band narrower than the sequence on a ring grid: NotImplementedError on every rank."""
    model, inputs, _ = _build(SHAPES[0], sliding_window=4)
    ADAPTER.enable(model, mesh, "auto")
    try:
        parity.forward(model, inputs)
    except NotImplementedError as exc:
        return {"wrong_error": float("which usp_attention's ring cannot express (ring_degree=2)" not in str(exc))}
    finally:
        ADAPTER.disable(model)
    return {"did_not_raise": 1.0}


BAND_GRIDS = [(2, 1, 1), (4, 1, 1), (2, 1, 2)]  # (U, R, cfg): no ring


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, audio) of 2 guided steps, two prompts, 10.5 s (21 frames: 11 audio tokens)."""
    return parity.latents_and(pipe, "audios", prompt=["a calm piano piece", "fast guitar"],
                              lyrics=["[verse]\nsoft notes", "[chorus]\nloud"], audio_duration=10.5,
                              num_inference_steps=2, generator=torch.Generator().manual_seed(0), max_text_length=32)


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # (U, R, cfg)


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    # gradient checkpointing: the layers recomputed in backward, their arguments (the RoPE table, the
    # sliding mask) passed by position
    parity.record(results, "grad-ckpt-p4",
                  lambda: parity.checkpointed_gradient_errors(*_build(SHAPES[0])[:2], ADAPTER, init_usp(2, 2)))
    parity.record(results, "full-layers-u2r2", lambda: _output_case(
        "f21", init_usp(2, 2), sliding_window=4, layer_types=["full_attention"] * 2))
    for grid in BAND_GRIDS:
        parity.record(results, "band-u{}r{}cfg{}".format(*grid),
                      lambda grid=grid: _output_case(SHAPES[0], init_usp(*grid), sliding_window=4))
    parity.record(results, "band-grad-p2", lambda: _band_gradient_case(init_usp(2, 1)))
    parity.record(results, "band-grad-p4", lambda: _band_gradient_case(init_usp(4, 1)))
    parity.record(results, "band-on-ring", lambda: _band_on_ring_case(init_usp(2, 2)))
    # each rank's rotated Q/K of layer 0 equal the same rows of one process's (the RoPE rows cut like the tokens)
    parity.record(results, "rotated-qk",
                  lambda: parity.rotated_qk_case(*_build(SHAPES[0])[:2], ADAPTER, init_usp(2, 2), ace_step_transformer))
    two_heads = tiny_ace_step(num_heads=2, num_kv_heads=1, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "compiled",
                  lambda: parity.compiled_case(*_build(SHAPES[0])[:2], init_usp(2, 2), backend="eager"))
    parity.record(results, "pipeline", lambda: parity.pipeline_cases(
        tiny_ace_step_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS), names=("latents", "audios")),
        many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    # check_groups=False: the compiled case's torch compile caches (functional collectives' graphs)
    # keep references to the process groups past the job, as in tests/test_compile_grid.py.
    return parity.spawn_grid(_run_all, WORLD, check_groups=False)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_full_attention_layers_run_at_any_length(grid_results):
    parity.assert_within(grid_results, "full-layers-u2r2", TOL)


@pytest.mark.parametrize("key", [f"band-u{u}r{r}cfg{c}" for u, r, c in BAND_GRIDS] + ["band-grad-p2", "band-grad-p4"])
def test_a_narrow_sliding_window_runs_exactly_on_ulysses(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


def test_a_narrow_sliding_window_on_a_ring_is_refused_on_every_rank(grid_results):
    parity.assert_within(grid_results, "band-on-ring", 0.0)


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


def test_a_narrow_sliding_window_under_a_flash_backend_is_refused():
    """Under a flash backend the model builds no band mask (it passes window_size): refused."""
    model, inputs, _ = _build("f21", sliding_window=4)  # 11 tokens: |i - j| <= 4 hides pairs
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with mock.patch.object(ace_step_transformer, "_is_flash_attention_backend", lambda processor=None: True), \
                pytest.raises(NotImplementedError, match=r"\|i - j\| <= 4\) does not cover the 11 audio tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_a_foreign_cross_attention_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_ace_step, ADAPTER, "layers.1.cross_attn")
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_ace_step, ADAPTER, ace_step, "_RoutedAceStepProcessor")
