"""AnyFlow adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``AnyFlowTransformer3DModel`` s (4 heads x 16
head_dim, every weight perturbed, the delta-embedding gate 0.3; ``usp_dit.demo.tiny_anyflow``):
text-to-video, image-conditioned (5 image tokens before the text in cross-attention) and, on (2,2),
``deltatime_type="t-r"``. Latents give 45 and 27 tokens (neither divides 2 or 4; on 4 ranks every
shard starts or ends mid-frame, so the per-frame modulation rows are cut inside a frame), batch 2
with a different prompt and a random ``t`` and ``r <= t`` per latent frame and element.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS),
the ring grids also with the "stream" and "gather_merge" schedules forced (Note [schedules in CI]).
Each case: output vs the stock output, block 0's attention sees at most ceil(tokens / P) tokens,
and after ``disable`` the output is bit-identical. Every parameter's gradient on 2 and 4 ranks
(loss / P per rank summed over the sequence group equals one process's), and once with gradient
checkpointing. Each rank's rotated Q/K of block 0 equal the same rows of one process's (the dict
RoPE table cut on its dim 2). The tiny ``AnyFlowPipeline`` (T5 stand-in, Wan VAE, flow-map Euler
scheduler, 2 steps continuing a 5-frame video (2 context latent frames at t = 0), guidance 2.0 so
that [negative; positive] are batched in one call) through
``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2), equal to one process, then bit-identical
after ``disable_usp``.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients, rotated Q/K and the
pipeline's final latents: sharding only reorders float32 sums (attention blocks merged by
log-sum-exp, gradients summed over ranks). The decoded frames: 1e-4 (an untrained random VAE's
gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_anyflow

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_anyflow import anyflow_inputs, anyflow_tokens, tiny_anyflow, tiny_anyflow_pipeline
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families.anyflow import ADAPTER, USPAnyFlowAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    frames: int  # latent sizes
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("t2v", 3, 6, 10),  # 3 x 3 x 5 = 45 tokens
    Shape("i2v", 3, 6, 6),  # 27 tokens, + 5 image and 9 text tokens in cross-attention
]
T_MINUS_R = Shape("t-r", 3, 6, 10)


def _build(shape: Shape, seed: int = 0):
    model = tiny_anyflow(shape.variant, seed=seed)
    return model, anyflow_inputs(model, shape.frames, shape.height, shape.width)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's attention length vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    tokens = anyflow_tokens(model, shape.frames, shape.height, shape.width)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.blocks[0].attn1, tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with ``enable_gradient_checkpointing()``: block 0's recompute re-shards its saved
    full input; the blocks get the already-cut RoPE table and modulation."""
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _first_attention_call(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated (q, k), each (B, S or S_local, H, D), of the first call to ``module.name`` in a
    forward: block 0's self-attention (``attn1`` runs before ``attn2``)."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated Q/K equal the same rows of one process's (stock: diffusers' dispatch call;
    sharded: the usp_attention call it is routed to)."""
    model, inputs = _build(SHAPES[0])
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_anyflow, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents (1, 3, 4, 6, 10), frames) of 2 steps at 48 x 80 x 9 frames (45 tokens), guidance 2,
    continuing a 5-frame video: the pipeline VAE-encodes it to 2 context latent frames, writes them into
    the latents and gives them t = 0 each step (timestep rows [0, 0, t]: per-frame modulation)."""
    video = torch.rand(1, 5, 3, 48, 80, generator=torch.Generator().manual_seed(1))
    return parity.latents_and(
        pipe, "frames", prompt="a red fox jumps over a log", negative_prompt="blurry", video=video, height=48,
        width=80, num_frames=9, num_inference_steps=2, guidance_scale=2.0, max_sequence_length=16,
        generator=torch.Generator().manual_seed(0), output_type="pt",
    )


PIPELINE_GRIDS = parity.ci_grids(parity.pipeline_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)]))


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, f"u2r2-{T_MINUS_R}", lambda: _output_case(T_MINUS_R, init_usp(2, 2)))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    two_heads = tiny_anyflow("t2v", num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", lambda: parity.pipeline_cases(
        tiny_anyflow_pipeline(), _generate, PIPELINE_GRIDS, names=("latents", "frames")), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES) + [f"u2r2-{T_MINUS_R}"], parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_pipeline_matches_one_process(grid_results, key: str):
    """(2,1) and (2,2) sequence-parallel; (1,2,2): the batched [negative; positive] split over cfg."""
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES})


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: restore exactly, loud failures ------------------------------------------------


def test_one_rank_is_bit_identical_and_disable_restores_processors():
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    before = [m.processor for m in model.modules() if hasattr(m, "processor")]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        assert all(isinstance(b.attn1.processor, USPAnyFlowAttnProcessor) for b in model.blocks)
        assert torch.equal(parity.forward(model, inputs), ref)
    finally:
        ADAPTER.disable(model)
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == before
    assert not [type(m).__name__ for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]


def test_attention_mask_is_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model.blocks[0].attn1(hidden_states=torch.randn(1, 5, 64), attention_mask=torch.ones(1, 1, 5, 5).bool())
    finally:
        ADAPTER.disable(model)


def test_temporal_patch_above_one_is_refused():
    model = tiny_anyflow("t2v")
    model.register_to_config(patch_size=(2, 2, 2))
    with pytest.raises(NotImplementedError, match=r"patch_size\[0\]=2"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


test_replaced_processor_is_refused = family_checks.foreign_processor_refused(
    lambda: tiny_anyflow("t2v"), ADAPTER, "blocks.1.attn2", transformer_anyflow.AnyFlowAttnProcessor)


def test_the_far_model_has_its_own_plan():
    """The frame-autoregressive AnyFlow FAR runs its inference calls through its own plan
    (tests/test_pipeline_anyflow_far.py), not this one."""
    from diffusers import AnyFlowFARTransformer3DModel

    from usp_dit.pipelines.base import registered_adapters
    from usp_dit.pipelines.families import anyflow_far

    owners = [a for a in registered_adapters() if getattr(a, "model_class", None) is AnyFlowFARTransformer3DModel]
    assert owners == [anyflow_far.ADAPTER]


# ---- the video example's AnyFlow option (one process, no grid) -------------------------------------


def test_video_example_anyflow_defaults_and_tiny_generation(monkeypatch):
    """The tiny default (9 frames of 96 x 144: 162 tokens) through the example's own load and generate."""
    from tests.test_examples_cli import _example

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ex = _example("generate_video")
    args = ex.parse_args(["--model", "anyflow", "--steps", "1", "--height", "48", "--width", "80"])
    assert (args.frames, args.degrees) == (9, (1, 1, 1))
    pipe = ex.load_pipeline(args, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    frames = ex.generate(pipe, args)
    assert frames.shape == (9, 48, 80, 3) and torch.isfinite(torch.from_numpy(frames)).all()
    assert ex.video_tokens(args, pipe) == 3 * 3 * 5


def test_video_example_refuses_cfg_without_guidance(monkeypatch):
    from tests.test_examples_cli import _example
    from usp_dit.cli.launch import UsageError

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match="AnyFlowPipeline is guidance-distilled"):
        _example("generate_video").parse_args(["--model", "anyflow", "--cfg", "2"])
