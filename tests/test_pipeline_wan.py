"""Wan adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each (the adapter sees a sequence group of 2,
as on a 2-rank job). Models: tiny 2-layer ``WanTransformer3DModel`` s (4 heads x 16 head_dim, every
weight perturbed; ``usp_dit.demo.tiny_wan``) in three variants: Wan 2.1 T2V, Wan 2.1 I2V (CLIP
image tokens through the added K/V cross-attention, 512 text tokens as the stock processor
requires) and Wan 2.2 TI2V-5B (3x the latent channels, one random timestep per token). Latents give
45, 27 and 63 tokens (none divides 2 or 4), batch 2 with a different prompt and timestep per element.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced ("auto" never merges at
these sizes). Each case: output vs the stock output, block 0's attention sees at most
ceil(tokens / P) tokens, and after ``disable`` the output is bit-identical. Per variant, on 2 and
on 4 ranks: every parameter's gradient (loss / P on each rank, summed over the sequence group,
equals one process's: tests/adapter_parity.gradient_errors), and once with gradient
checkpointing. Wan 2.2's two experts: both transformers enabled with
``usp_dit.enable_usp(..., mesh=mesh)`` and called in turn; the tiny two-expert ``WanPipeline``
(T5 encoder, 2 steps with guidance, Wan VAE decode) through ``pipe.enable_usp()``, which enables
both experts on one mesh (``pipe.disable_usp()`` restores both), on (2,1) and (2,2), its video
equal to one process's and both experts run; the tiny TI2V-5B-like ``WanPipeline`` (``expand_timesteps``) on
(2,2); ``cfg_degree=2`` on a Wan pipeline runs a step's two guidance calls on the two cfg groups
(``usp_dit.pipelines.cfg_pair``), equal to one process.

Each rank's rotated Q/K of block 0 are compared with the same rows of one process's (RoPE and
TI2V's per-token modulation sliced like the tokens).

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the pipeline's final latents. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks): measured 2.7e-7 at most
on outputs with the schedules forced (0 with "auto", which at these sizes makes one kernel call
over the whole K/V: the same arithmetic per query row as stock) and 2.1e-6 on the worst gradient.
The decoded frames: 1e-4 (an untrained random VAE's gain, as in tests/test_video_pipelines.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_wan

import usp_dit
from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_wan import tiny_wan, tiny_wan_pipeline, wan_inputs, wan_tokens
from usp_dit.pipelines import _routing, is_usp_enabled
from usp_dit.pipelines.families.wan import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas


@dataclass(frozen=True)
class Shape:
    variant: str
    frames: int  # latent sizes
    height: int
    width: int

    @property
    def per_token_timestep(self) -> bool:
        return self.variant == "ti2v-5b"

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("t2v", 3, 6, 10),  # 3 x 3 x 5 = 45 tokens
    Shape("i2v", 3, 6, 6),  # 27 tokens, + 5 image and 512 text tokens in cross-attention
    Shape("ti2v-5b", 3, 6, 14),  # 63 tokens, 63 per-token timesteps per element
]


def _build(shape: Shape, seed: int = 0):
    model = tiny_wan(shape.variant, seed=seed)
    inputs = wan_inputs(model, shape.frames, shape.height, shape.width, per_token_timestep=shape.per_token_timestep)
    return model, inputs


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's attention length vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    tokens = wan_tokens(model, shape.frames, shape.height, shape.width)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.blocks[0].attn1, tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with ``enable_gradient_checkpointing()`` (TI2V): block 0's recompute in backward
    re-shards its saved full input, and the blocks get the already-sliced RoPE table and modulation."""
    model, inputs = _build(SHAPES[2])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _two_experts_case(mesh) -> dict[str, float]:
    """Wan 2.2 A14B's experts: both enabled through ``usp_dit.enable_usp(..., mesh=mesh)``, called
    high-noise, low-noise, high-noise as the pipeline does, each equal to its stock output."""
    shape = SHAPES[0]
    experts = [_build(shape, seed=s)[0] for s in (0, 7)]
    _, inputs = _build(shape)
    refs = [parity.forward(m, inputs) for m in experts]
    for m in experts:
        usp_dit.enable_usp(m, mesh=mesh)
    try:
        errors = {f"expert{i}-call{k}": rel_err(parity.forward(experts[i], inputs), refs[i]) for k,
                  i in enumerate((0, 1, 0))}
    finally:
        for m in experts:
            usp_dit.disable_usp(m)
    same = all(torch.equal(parity.forward(m, inputs), r) for m, r in zip(experts, refs))
    errors["disable_not_bit_identical"] = float(not same)
    return errors


def _first_attention_call(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, k) that block 0's self-attention hands ``module.name`` (the first attention call of
    a forward), each (B, S or S_local, H, D), rotated."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Design, positional tables: each rank's rotated Q/K equal the same rows of one process's.
    TI2V (per-token timestep, 63 tokens); the stock run records diffusers' dispatch call, the
    sharded run the usp_attention call it is routed to."""
    model, inputs = _build(SHAPES[2])
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_wan, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


def _generate(pipe, calls: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of 2 steps at 48 x 80 x 9 frames (3 x 3 x 5 = 45 tokens), seed 0."""
    last = {}

    def keep_latents(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return {}

    experts = [name for name in ("transformer", "transformer_2") if getattr(pipe, name) is not None]
    hooks = [getattr(pipe, name).register_forward_pre_hook(lambda *a, name=name: calls.append(name))
             for name in experts]
    try:
        frames = pipe(
            prompt="a red fox jumps over a log", negative_prompt="blurry", height=48, width=80, num_frames=9,
            num_inference_steps=2, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
            output_type="pt", callback_on_step_end=keep_latents,
        ).frames
    finally:
        for h in hooks:
            h.remove()
    return last["latents"], frames


PIPELINE_GRIDS = [(2, 1), (2, 2)]  # (U, R): a 2-rank sequence group (dp 2) and all 4 ranks


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The tiny two-expert WanPipeline on each of ``PIPELINE_GRIDS``: ``pipe.enable_usp`` enables
    both experts on one mesh, ``pipe.disable_usp`` restores both."""
    pipe = tiny_wan_pipeline(two_experts=True)
    pipe.set_progress_bar_config(disable=True)
    ref_calls = []
    ref_latents, ref_frames = _generate(pipe, ref_calls)
    results = {}
    for u, r in PIPELINE_GRIDS:
        calls = []
        pipe.enable_usp(ulysses_degree=u, ring_degree=r)
        both = is_usp_enabled(pipe.transformer) and is_usp_enabled(pipe.transformer_2)
        try:
            latents, frames = _generate(pipe, calls)
        finally:
            pipe.disable_usp()
        neither = not (is_usp_enabled(pipe.transformer) or is_usp_enabled(pipe.transformer_2))
        results[f"pipeline-u{u}r{r}"] = {
            "not_both_enabled_then_restored": float(not (both and neither)),
            "latents": rel_err(latents, ref_latents),
            "frames": rel_err(frames, ref_frames),
            # 2 steps x (cond, uncond): the high-noise expert at t=1000, the low-noise one at t=8.9.
            "experts_not_both_run": float(set(calls) != {"transformer", "transformer_2"} or calls != ref_calls),
        }
    again_latents, again_frames = _generate(pipe, [])
    same = torch.equal(again_latents, ref_latents) and torch.equal(again_frames, ref_frames)
    results["pipeline-after-disable"] = {"not_bit_identical": float(not same)}
    return results


def _ti2v_pipeline_case() -> dict[str, float]:
    """The tiny TI2V-5B-like WanPipeline (``expand_timesteps``: a (1, 45) timestep per call) on
    (U, R) = (2, 2) through ``pipe.enable_usp``."""
    pipe = tiny_wan_pipeline(ti2v=True)
    pipe.set_progress_bar_config(disable=True)
    ref_latents, ref_frames = _generate(pipe, [])
    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    try:
        latents, frames = _generate(pipe, [])
    finally:
        pipe.disable_usp()
    return {"latents": rel_err(latents, ref_latents), "frames": rel_err(frames, ref_frames)}


def _pipeline_cfg_case() -> dict[str, float]:
    """cfg_degree=2 on the Wan pipeline: it calls the transformer once per guidance branch, and the
    two calls of a step run on the two cfg groups (usp_dit.pipelines.cfg_pair; counted in
    tests/test_cfg_pair.py): equal to one process."""
    pipe = tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    ref_latents, ref_frames = _generate(pipe, [])
    pipe.enable_usp(cfg_degree=2)
    try:
        latents, frames = _generate(pipe, [])
    finally:
        pipe.disable_usp()
    return {"latents": rel_err(latents, ref_latents), "frames": rel_err(frames, ref_frames)}


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "two-experts", lambda: _two_experts_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    two_heads = tiny_wan("t2v", num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    parity.record(results, "pipeline-ti2v-u2r2", _ti2v_pipeline_case)
    parity.record(results, "pipeline-cfg2", _pipeline_cfg_case)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_both_wan22_experts_enabled_directly_match_stock(grid_results):
    parity.assert_within(grid_results, "two-experts", TOL)


PIPELINE_KEYS = [f"pipeline-u{u}r{r}" for u, r in PIPELINE_GRIDS] + ["pipeline-ti2v-u2r2"]


@pytest.mark.parametrize("key", PIPELINE_KEYS)
def test_pipeline_matches_one_process(grid_results, key: str):
    """Two experts on each of PIPELINE_GRIDS; TI2V-5B on (2, 2)."""
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_cfg_parallel_runs_the_two_guidance_calls_of_wan_pipelines(grid_results):
    parity.assert_within(grid_results, "pipeline-cfg2", TOL_FRAMES)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: registration, restore exactly, loud failures --------------------------------


def test_attention_mask_is_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        x = torch.randn(1, 5, 64)
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model.blocks[0].attn1(x, None, torch.ones(1, 1, 5, 5, dtype=torch.bool), None)
    finally:
        ADAPTER.disable(model)


def test_per_token_timestep_of_wrong_length_is_refused():
    model, inputs = _build(SHAPES[2])
    inputs.timestep = inputs.timestep[:, :-1]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="62 entries per batch element but the latent has 63 video tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


# ---- the video example's Wan option (argument checks only: nothing loads) -------------------------


@pytest.mark.parametrize("argv, message", [
    (["--model", "wan", "--frames", "11"], "--frames 11 must be 4k + 1"),
    (["--model", "wan", "--cfg", "3"], "--cfg 3: the cfg groups run classifier-free guidance's two branches"),
])
def test_video_example_refuses_what_wan_cannot_take(argv, message, monkeypatch):
    from tests.test_examples_cli import _example
    from usp_dit.cli.launch import UsageError

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match=re.escape(message)):
        _example("generate_video").parse_args(argv)


def test_video_example_wan_defaults(monkeypatch):
    from tests.test_examples_cli import _example

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = _example("generate_video").parse_args(["--model", "wan"])
    assert (args.frames, args.degrees) == (9, (1, 1, 1))
