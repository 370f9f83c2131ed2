"""LTX-Video adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Model: a tiny 2-layer
``LTXVideoTransformer3DModel`` (4 heads x 16 head_dim, every weight perturbed;
``usp_dit.demo.tiny_ltx_video``) called three ways: as ``LTXPipeline`` calls it (one timestep per
element, RoPE from the latent grid with the pipeline's interpolation scale), as the image-to-video
pipeline does (one random timestep per token, the first latent frame at 0) and as the condition
pipeline does (per-token timestep and ``video_coords``, element 1's shifted in time). Latents give
45, 63 and 27 tokens (none divides 2 or 4), batch 2 with a different prompt, timestep and padded
prompt mask per element (element 0's has a hole: cross-attention takes any key mask).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced ("auto" never merges at
these sizes). Each case: output vs the stock output, block 0's self-attention sees at most
ceil(tokens / P) tokens, and after ``disable`` the output is bit-identical. Every parameter's
gradient (loss / P on each rank, summed over the sequence group, equals one process's:
tests/adapter_parity.gradient_errors): every call style on 2 ranks, the LTXPipeline and
image-to-video ones on 4, and image-to-video once with gradient checkpointing (2x2). Each rank's
rotated Q/K of block 0 equal the same rows of one process's (RoPE and the per-token modulation cut
like the tokens). The tiny ``LTXPipeline`` (T5 encoder, 2 steps, classifier-free guidance batched
in one transformer call of batch 2, negative and positive prompts of different padded lengths, LTX
VAE decode) through ``pipe.enable_usp()`` on (U, R) = (2,1) and (2,2) and with ``cfg_degree=2`` on
(2,1,2) equals one process's.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the pipeline's final latents. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks): measured 4.2e-7 at most
on outputs (with the schedules forced), 2.5e-6 on the worst gradient, 0 on the rotated Q/K, 9.2e-7
on the pipeline's latents. The decoded frames: 1e-4 (an untrained random VAE's gain, as in
tests/test_video_pipelines.py; measured 1.3e-6).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_ltx

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_ltx_video import ltx_video_inputs, tiny_ltx_video, tiny_ltx_video_pipeline
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import ltx_video
from usp_dit.pipelines.families.ltx_video import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas


@dataclass(frozen=True)
class Shape:
    call: str  # "t2v" (LTXPipeline), "i2v" (per-token timestep), "cond" (per-token timestep and video_coords)
    frames: int  # latent sizes (= token grid: patch 1)
    height: int
    width: int

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width

    def __str__(self) -> str:
        return f"{self.call}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("t2v", 3, 3, 5),  # 45 tokens
    Shape("i2v", 3, 3, 7),  # 63 tokens, 63 timesteps per element
    Shape("cond", 3, 3, 3),  # 27 tokens with their coordinates
]
# "cond" differs from "i2v" by its RoPE coordinates alone: its gradients on 2 ranks suffice.
GRAD_SHAPES = {2: SHAPES, 4: SHAPES[:2]}


def _build(shape: Shape, seed: int = 0):
    model = tiny_ltx_video(seed=seed)
    inputs = ltx_video_inputs(
        model, shape.frames, shape.height, shape.width, per_token_timestep=shape.call != "t2v",
        video_coords=shape.call == "cond",
    )
    return model, inputs


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's self-attention length vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with ``enable_gradient_checkpointing()`` (per-token timestep): block 0's recompute
    in backward re-shards its saved full input; the blocks get the already-cut RoPE and modulation."""
    model, inputs = _build(SHAPES[1])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


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


def _rotated_qk_case(shape: Shape, mesh) -> dict[str, float]:
    """Design, positional tables: each rank's rotated Q/K equal the same rows of one process's; the
    stock run records diffusers' dispatch call, the sharded run the usp_attention call it is routed to."""
    model, inputs = _build(shape)
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_ltx, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of 2 steps at 96 x 160 x 17 frames (3 x 3 x 5 = 45 tokens), seed 0,
    guidance batched: [negative; positive] prompts of different padded lengths in one call."""
    return parity.latents_and(
        pipe, "frames",
        prompt="a red fox", negative_prompt="blurry", height=96, width=160, num_frames=17, num_inference_steps=2,
        max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="pt",
    )


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (2, 1, 2)])  # (U, R, cfg)


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The tiny LTXPipeline on each of ``PIPELINE_GRIDS`` through ``pipe.enable_usp``."""
    return parity.pipeline_cases(tiny_ltx_video_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS),
                                 names=("latents", "frames"), check_enabled=False)


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh), GRAD_SHAPES)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    for shape in SHAPES[1:]:
        parity.record(results, f"rotated-qk-{shape.call}", lambda: _rotated_qk_case(shape, init_usp(2, 2)))
    two_heads = tiny_ltx_video(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(by_world=GRAD_SHAPES) + ["grad-ckpt-p4"], TOL,
)


@pytest.mark.parametrize("call", ["i2v", "cond"])
def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results, call: str):
    parity.assert_within(grid_results, f"rotated-qk-{call}", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    """Sequence parallel on (2,1) and (2,2); cfg parallel on (2,1,2): LTXPipeline batches its guidance."""
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: registration, restore exactly, loud failures --------------------------------


def test_attention_mask_in_self_attention_is_refused():
    model = tiny_ltx_video()
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        x = torch.randn(1, 5, 64)
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model.transformer_blocks[0].attn1(x, None, torch.zeros(1, 1, 5), None)
    finally:
        ADAPTER.disable(model)


def test_timestep_of_wrong_length_is_refused():
    model, inputs = _build(SHAPES[1])
    inputs.timestep = inputs.timestep[:, :-1]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="124 entries for a batch of 2 and 63 video tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_ltx_video, ADAPTER, ltx_video, "_RoutedLTXProcessor")
