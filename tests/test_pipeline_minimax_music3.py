"""MiniMax Music 3 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Model: a tiny 2-layer
``MiniMaxMusic3Transformer1DModel`` (4 heads x 16 head_dim, 8 of them rotated; every weight
perturbed; ``usp_dit.demo.tiny_minimax_music3``). 12 latent frames: with the time token 13 tokens
(divides neither 2 nor 4), the time token on the first rank (Note [MiniMax Music 3's time token]);
batch 2 with a different latent, condition and timestep per element; the RoPE positions are the
model's own (0 .. frames), checked per rank through the rotated Q/K.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2)
(tests/adapter_parity.GRIDS); each ring grid also with the "stream" and "gather_merge" schedules
forced (adapter_parity Note [schedules in CI]). Each case: output vs the stock output, block 0's
attention sees at most ceil(tokens / P) tokens, and after ``disable`` the output is bit-identical.
Every parameter's gradient (loss / P on each rank, summed over the sequence group, equals one
process's) on 2 and 4 ranks, and with gradient checkpointing. Fullgraph compile: the whole enabled
model in one Dynamo graph on (2,2) equals eager (backend "eager": a graph break fails as under
inductor, at half the time of "aot_eager").

Pipeline: Diffusers ships MiniMax Music 3 as modular blocks around an autoregressive language model
and an RVQ depth decoder (not built tiny here). The guider's two calls a step (condition, then zeros)
are made directly on the transformer enabled with ``usp_dit.enable_usp(model, mesh=...)`` on the cfg
grid (1,2,2), equal one process's, with ``steps + 1`` computations per rank (the two calls of a step
on the two cfg groups at once: ``usp_dit.pipelines.cfg_pair``). The stock modular core denoise step
(``MiniMaxMusic3CoreDenoiseStep``: two 200-frame windows of 689 and 447 latent frames, each from
its own noise, blended; tiny condition encoder: ``tiny_minimax_music3_denoise``) runs through
``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2) (there ``steps + 1`` computations a window),
equal to one process's, ``disable_usp`` bit for bit; with each rank's generator seeded by its rank
the windows' noise is rank 0's (Note [modular pipelines]).

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient and the rotated Q/K. Sharding only reorders float32 sums (attention in blocks merged by
log-sum-exp, gradients summed over ranks).
"""
from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_minimax_music3

import usp_dit
from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp
from usp_dit.demo.tiny_minimax_music3 import (
    FRAME_DIM,
    FRAME_LAYERS,
    MiniMaxMusic3Inputs,
    minimax_music3_inputs,
    tiny_minimax_music3,
    tiny_minimax_music3_denoise,
)
from usp_dit.pipelines.families import minimax_music3
from usp_dit.pipelines.families.minimax_music3 import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas
FRAMES = 12  # + the time token: 13 tokens
STEPS = 2

SHAPES = [f"f{FRAMES}"]


def _build(seed: int = 0):
    return tiny_minimax_music3(seed=seed), minimax_music3_inputs(FRAMES)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: str, mesh) -> dict[str, float]:
    """Output vs stock, block 0's attention length vs ceil((1 + frames) / P), bit-identity after disable."""
    model, inputs = _build()
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, FRAMES + 1)


def _gradient_case(shape: str, mesh) -> dict[str, float]:
    return parity.gradient_errors(*_build(), ADAPTER, mesh)


def _guided_calls(model, steps: list[MiniMaxMusic3Inputs]) -> list[torch.Tensor]:
    """The guider's calls: per step the condition's, then zeros' (the unconditional branch)."""
    outs = []
    for inputs in steps:
        uncond = MiniMaxMusic3Inputs(inputs.hidden_states, inputs.timestep,
                                     torch.zeros_like(inputs.encoder_hidden_states))
        outs += [parity.forward(model, inputs), parity.forward(model, uncond)]
    return outs


def _two_call_cfg_case(mesh) -> dict[str, float]:
    """cfg_degree=2 on the guider's two calls a step: equal one process's; block 0 computed
    ``steps + 1`` times on this rank (the first step's two calls, then one pair a step)."""
    model, first = _build()
    steps = [first] + [minimax_music3_inputs(FRAMES, seed=s) for s in range(1, STEPS)]
    for later in steps[1:]:  # the same condition every step, as the guider's
        later.encoder_hidden_states = first.encoder_hidden_states
    refs = _guided_calls(model, steps)
    computed = []
    hook = model.transformer_blocks[0].register_forward_pre_hook(lambda m, a: computed.append(1))
    usp_dit.enable_usp(model, mesh=mesh)
    try:
        outs = _guided_calls(model, steps)
    finally:
        usp_dit.disable_usp(model)
        hook.remove()
    errors = {f"call{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(outs, refs))}
    return {**errors, "computations_not_steps_plus_1": float(len(computed) != STEPS + 1)}


# The stock modular core denoise step (tiny_minimax_music3_denoise): 230 frames make two windows,
# [0, 200) and [100, 230): 689 and 447 latent frames (+ the time token: 690 and 448 tokens, neither
# divides 4), each flow-matched from its own noise in STEPS steps of the guider's two calls.
PIPELINE_FRAMES, WINDOWS = 230, 2
PIPELINE_GRIDS = parity.ci_grids(
    {"pipeline-u2r1": (2, 1, 1), "pipeline-u2r2": (2, 2, 1), "pipeline-u1r2cfg2": (1, 2, 2)})


def _denoise(pipe, generator: torch.Generator | None = None) -> tuple[torch.Tensor]:
    """The windows' denoised latents side by side (1, IN_CHANNELS, 689 + 447), seed 0 by default."""
    frames = torch.randn(1, PIPELINE_FRAMES, FRAME_LAYERS * FRAME_DIM, generator=torch.Generator().manual_seed(5))
    chunks = pipe(frame_hiddens=frames, num_inference_steps=STEPS, output="latent_chunks",
                  generator=generator if generator is not None else torch.Generator().manual_seed(0))
    return (torch.cat(chunks, dim=-1),)


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The core denoise pipeline through ``pipe.enable_usp()`` on each grid vs one process."""
    pipe = tiny_minimax_music3_denoise()
    pipe.set_progress_bar_config(disable=True)
    # At cfg 2 block 0 runs steps + 1 times a window (each window's condition is new: its first
    # step's two calls teach the pair again, cfg_pair Note [two calls a step]): the shared probe's
    # "steps + 1" with steps := WINDOWS (STEPS + 1) - 1.
    probe = lambda pipe, grid: parity.cfg_pair_computations(pipe, grid, WINDOWS * (STEPS + 1) - 1)  # noqa: E731
    return parity.pipeline_cases(pipe, _denoise, PIPELINE_GRIDS, names=("latents",), probe=probe)


def _rank_seeded_case() -> dict[str, float]:
    """Note [modular pipelines], noise in loops: each window draws its noise inside the loop from
    the call's generator; with each rank's generator seeded by its rank, ``pipe.enable_usp()`` on
    (2,2,1) gives every rank one process's latents with rank 0's seed; so does a call without a
    generator whose ranks seeded their global RNG by their rank."""
    import torch.distributed as dist

    pipe = tiny_minimax_music3_denoise()
    pipe.set_progress_bar_config(disable=True)
    frames = torch.randn(1, PIPELINE_FRAMES, FRAME_LAYERS * FRAME_DIM, generator=torch.Generator().manual_seed(5))

    def unseeded(seed: int) -> torch.Tensor:  # no generator: each window's noise from the global RNG
        torch.manual_seed(seed)
        return torch.cat(pipe(frame_hiddens=frames, num_inference_steps=STEPS, output="latent_chunks"), dim=-1)

    (ref,), unseeded_ref = _denoise(pipe), unseeded(0)
    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    try:
        (got,) = _denoise(pipe, torch.Generator().manual_seed(dist.get_rank()))
        unseeded_got = unseeded(dist.get_rank())
    finally:
        pipe.disable_usp()
    return {"latents": rel_err(got, ref), "global_rng_latents": rel_err(unseeded_got, unseeded_ref)}


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    # gradient checkpointing: block 0's recompute re-shards its saved input
    parity.record(results, "grad-ckpt-p4",
                  lambda: parity.checkpointed_gradient_errors(*_build(), ADAPTER, init_usp(2, 2)))
    # each rank's rotated Q/K of block 0 (time token included) equal the same rows of one process's
    parity.record(results, "rotated-qk",
                  lambda: parity.rotated_qk_case(*_build(), ADAPTER, init_usp(2, 2), transformer_minimax_music3))
    parity.record(results, "two-call-cfg", lambda: _two_call_cfg_case(init_usp(1, 2, 2)))
    two_heads = tiny_minimax_music3(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "compiled", lambda: parity.compiled_case(*_build(), init_usp(2, 2), backend="eager"))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    parity.record(results, "pipeline-rank-seeded", _rank_seeded_case)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    # check_groups=False: the compiled case's torch compile caches (functional collectives' graphs)
    # keep references to the process groups past the job, as in tests/test_compile_grid.py.
    return parity.spawn_grid(_run_all, WORLD, check_groups=False)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_cfg_parallel_runs_the_guiders_two_calls_at_once(grid_results):
    parity.assert_within(grid_results, "two-call-cfg", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


def test_whole_model_compiles_fullgraph_in_one_graph(grid_results):
    parity.assert_within(grid_results, "compiled", TOL)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_core_denoise_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_latents(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_rank_seeded_noise_in_each_window_is_the_first_ranks(grid_results):
    parity.assert_within(grid_results, "pipeline-rank-seeded", TOL)


# ---- single process: loud failures ----------------------------------------------------------------


test_a_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_minimax_music3, ADAPTER, "transformer_blocks.1.attn")
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_minimax_music3, ADAPTER, minimax_music3, "_RoutedMusic3Processor")
