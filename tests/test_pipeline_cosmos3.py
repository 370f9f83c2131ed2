"""Cosmos 3 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``Cosmos3OmniTransformer`` s (4 query heads over 2
K/V heads x 16, every weight perturbed; ``usp_dit.demo.tiny_cosmos3``) in two variants: the
Qwen3-style backbone, and the Nemotron-style one (relu2, no text q/k norm, the gen stream's own
key norm for the text keys) with sound and action tokens in the gen stream. Each call packs two
vision items of different sizes (odd latent sizes, padded to the patch inside the model; the
second item's first frame conditioned, so not every vision token is predicted): 35 and 31 gen
tokens (neither divides 2 or 4) beside 7 and 9 text tokens, a random timestep per noisy token and
random mRoPE positions. (The model has no batch dimension: a call is one packed sequence; the
two items stand in for batch 2.)

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1) (U above the 2 K/V heads), (1,4,1),
(1,2,2) (tests/adapter_parity.GRIDS); each ring grid also with the "stream" and "gather_merge"
schedules forced. Each case: every prediction (vision, sound, action) vs the stock output, block 0's
attention sees at most ceil(gen tokens / P) gen tokens, and after ``disable`` the output is
bit-identical. Per variant, on 2 and on 4 ranks: every parameter's gradient (loss / P on each rank,
summed over the sequence group); once with gradient checkpointing. Each rank's rotated gen Q/K of
block 0 equal the same rows of one process's (the fullgraph compile of one grid is
tests/test_compile_grid.py's "cosmos3" case). The tiny ``Cosmos3OmniPipeline`` (2 steps with guidance, Wan VAE decoded by the
parallel VAE) through ``pipe.enable_usp()`` on (2,1) and (2,2) and with ``cfg_degree=2`` (the two
guidance calls of a step on the two cfg groups), equal to one process.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the pipeline's final latents: sharding only reorders float32 sums
(the text keys joined at another place, attention in blocks merged by log-sum-exp, gradients
summed over ranks). The decoded frames: 1e-4 (an untrained random VAE's gain, as in
tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from diffusers.models.transformers import transformer_cosmos3

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_cosmos3 import cosmos3_inputs, cosmos3_output, tiny_cosmos3, tiny_cosmos3_pipeline
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.families import cosmos3
from usp_dit.pipelines.families.cosmos3 import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    text: int
    vision: tuple[tuple[int, int, int], ...]  # latent (T, H, W) per item
    sound: int = 0
    action: int = 0

    def __str__(self) -> str:
        return f"{self.variant}-t{self.text}-s{self.sound}a{self.action}"


SHAPES = [
    Shape("qwen3", 7, ((3, 5, 6), (2, 3, 4))),  # 27 + 8 = 35 gen tokens
    Shape("nemotron-omni", 9, ((2, 5, 6), (1, 3, 4)), sound=6, action=3),  # 18 + 4 + 6 + 3 = 31
]


def _build(shape: Shape, seed: int = 0):
    model = tiny_cosmos3(shape.variant, seed=seed)
    inputs = cosmos3_inputs(model, shape.text, list(shape.vision), shape.sound, shape.action, seed=seed + 5)
    return model, inputs


def _forward(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return cosmos3_output(model(**inputs.kwargs(), return_dict=False))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    ref = _forward(model, inputs)
    lengths = []
    ADAPTER.enable(model, mesh, "auto")
    hook = model.layers[0].self_attn.register_forward_pre_hook(lambda m, args: lengths.append(args[1].shape[0]))
    try:
        out = _forward(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)
    again = _forward(model, inputs)
    return {
        "out": rel_err(out, ref),
        "block0_tokens_above_ceil": float(not lengths or max(lengths) > math.ceil(inputs.gen_tokens / mesh.sequence_degree)),
        "disable_not_bit_identical": float(not torch.equal(again, ref)),
    }


def _param_grads(model, inputs, divisor: int) -> dict[str, torch.Tensor]:
    out = cosmos3_output(model(**inputs.kwargs(), return_dict=False))
    loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(123))).sum() / divisor
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params.items(), grads)}


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    """Loss / P on each rank; parameter gradients summed over the sequence group equal one process's."""
    model, inputs = _build(shape)
    if checkpointing:
        model.enable_gradient_checkpointing()
    ref = _param_grads(model, inputs, 1)
    ADAPTER.enable(model, mesh, "auto")
    try:
        grads = _param_grads(model, inputs, mesh.sequence_degree)
    finally:
        ADAPTER.disable(model)
    worst = 0.0
    for name, g in grads.items():
        g = g.contiguous()
        dist.all_reduce(g, group=mesh.seq_group)
        worst = max(worst, rel_err(g, ref[name]))
    return {"grad": worst}


def _gen_qk(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, k) of block 0's gen attention call (the second attention call of a forward), rotated."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        _forward(model, inputs)
    return seen[1] if module is transformer_cosmos3 else seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated gen Q/K (and the text K it joins) equal the same rows of one process's."""
    model, inputs = _build(SHAPES[1])
    und = SHAPES[1].text
    q_ref, k_ref = _gen_qk(model, inputs, transformer_cosmos3, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _gen_qk(model, inputs, cosmos3, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref[:, und:], mesh))}


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of 2 steps with guidance at 48 x 80 x 9 frames (45 vision tokens), seed 0."""
    return parity.latents_and(pipe, "video", prompt="a red fox jumps over a log", negative_prompt="blurry", height=48,
                              width=80, num_frames=9, num_inference_steps=2, guidance_scale=3.0,
                              generator=torch.Generator().manual_seed(0), output_type="pt")


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (2, 1, 2)])  # (U, R, cfg)


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_cosmos3_pipeline()
    pipe.set_progress_bar_config(disable=True)
    ref_latents, ref_frames = _generate(pipe)
    results = {}
    for u, r, c in PIPELINE_GRIDS:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe)
        try:
            latents, frames = _generate(pipe)
            pair = pipe.transformer._usp_dit_state.cfg_pair
            stats = dict(pair.stats) if pair is not None else {}
        finally:
            pipe.disable_usp()
        errors = {"latents": rel_err(latents, ref_latents), "frames": rel_err(frames, ref_frames),
                  "not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe))}
        if c == 2:  # the first step learns the pair, the second's two calls run at once: 3 computed
            errors["not_paired"] = float(stats != dict(computed=3, speculated=1, served=1, dropped=0))
        results[f"pipeline-u{u}r{r}cfg{c}"] = errors
    again_latents, again_frames = _generate(pipe)
    same = torch.equal(again_latents, ref_latents) and torch.equal(again_frames, ref_frames)
    results["pipeline-after-disable"] = {"not_bit_identical": float(not same)}
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "grad-ckpt-p4",
                  lambda: _gradient_case(SHAPES[1], init_usp(*parity.GRAD_GRID[4]), checkpointing=True))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    for rank, res in enumerate(grid_results):
        errors = res.get(key) or res.get("pipeline", "no result")
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {n: v for n, v in errors.items() if not v <= (TOL_FRAMES if n == "frames" else TOL)}
        assert not worst, f"rank {rank}: {worst}"


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: loud failures -------------------------------------------------------------------


def test_another_context_parallelism_is_refused():
    model, _ = _build(SHAPES[0])
    model._cp_shard_fn = lambda und, gen, rope: (und, gen, rope)
    with pytest.raises(NotImplementedError, match="_cp_shard_fn already set"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_masked_or_dropout_calls_are_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        route = model.layers[0].self_attn.processor.route
        q = torch.randn(1, 4, 4, 16)
        with pytest.raises(NotImplementedError, match="unmasked attention only"):
            cosmos3.route_cosmos3_attention(q, q, q, attn_mask=torch.ones(1, 4, dtype=torch.bool),
                                            parallel_config=route)
        with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
            cosmos3.route_cosmos3_attention(q, q, q, dropout_p=0.1, parallel_config=route)
    finally:
        ADAPTER.disable(model)
    assert "_cp_shard_fn" not in model.__dict__ and "_cp_gather_fn" not in model.__dict__


def test_gen_rope_rows_must_match_the_gen_tokens():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        und, gen = torch.randn(3, 64), torch.randn(5, 64)
        rope = (torch.randn(3, 16), torch.randn(3, 16), torch.randn(4, 16), torch.randn(4, 16))
        with pytest.raises(ValueError, match="gen RoPE table has 4 rows but the gen stream has 5 tokens"):
            model._cp_shard_fn(und, gen, rope)
    finally:
        ADAPTER.disable(model)


# ---- the video example's Cosmos 3 option (argument checks only: nothing loads) ----------------------


def test_video_example_cosmos3_defaults(monkeypatch):
    from tests.test_examples_cli import _example

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    example = _example("generate_video")
    args = example.parse_args(["--model", "cosmos3"])
    assert (args.frames, args.height, args.width, args.degrees) == (9, 96, 144, (1, 1, 1))
    assert example.FAMILIES["cosmos3"].pipeline == "Cosmos3OmniPipeline"
    assert example.FAMILIES["cosmos3"].cfg == "two calls"


def test_video_example_cosmos3_has_no_planner_model(monkeypatch):
    from tests.test_examples_cli import _example
    from usp_dit.cli.launch import UsageError

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match="no cost model for this family"):
        _example("generate_video").parse_args(["--model", "cosmos3", "--degrees", "auto"])
