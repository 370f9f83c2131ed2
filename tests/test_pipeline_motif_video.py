"""Motif-Video adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Models: tiny ``MotifVideoTransformer3DModel``s
(4 heads x 16 head_dim, every weight perturbed; ``usp_dit.demo.tiny_motif_video``) in two variants
that between them build every block type: T2V (a dual-stream block and two single-stream blocks,
both kinds with text cross-attention, the last single-stream block a *decoder* block, whose two
streams are both video: Note [Motif-Video's decoder blocks]) and I2V (image tokens in front of the
text, no decoder). Latents give 45 and 27 tokens (none divides 2 or 4), batch 2 with a different
prompt and timestep per element and a different prompt mask (element 0: a hole, 6 valid of 9;
element 1: 7 valid).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
ring grids also with the "stream" and "gather_merge" schedules forced (Note [schedules in CI]). Each
case: output vs the stock output, block 0's attention sees at most ceil(tokens / P) video tokens
(the text is replicated), after ``disable`` the output is bit-identical. Every parameter's gradient
(loss / P on each rank, summed over the sequence group, equals one process's) for both variants
on 2 and 4 ranks, and T2V with gradient checkpointing (2x2). The decoder block's attention call
holds exactly this rank's rows of both streams (2 x its shard). Each rank's rotated Q/K of block 0
equal the same rows of one process's. Fullgraph compile: tests/test_compile_grid.py (the T2V model,
decoder included, on 16 tokens: SHAPES[2], used for nothing else).

Pipeline: the tiny ``MotifVideoPipeline`` (a character T5 encoder for T5Gemma2, the Wan VAE, the
classifier-free guider: two transformer calls of batch 1 a step, prompt and negative prompt of
different lengths) through ``pipe.enable_usp()`` on (2,1), (2,2) and ``cfg_degree=2`` on (1,2,2)
(the two calls of a step on the two cfg groups at once: ``steps + 1`` computations per rank), equal
to one process; bit-identical after ``disable_usp``.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the pipeline's latents. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks). The decoded frames:
1e-4 (an untrained random VAE's gain, as in tests/test_video_pipelines.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_motif_video

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_motif_video import (
    motif_video_inputs,
    motif_video_tokens,
    tiny_motif_video,
    tiny_motif_video_pipeline,
)
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import motif_video
from usp_dit.pipelines.families.motif_video import ADAPTER, DECODER_MARK, USPMotifVideoAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas


@dataclass(frozen=True)
class Shape:
    variant: str  # "t2v" (decoder block, cross-attention) or "i2v" (image tokens)
    frames: int  # latent sizes
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("t2v", 3, 6, 10),  # 3 x 3 x 5 = 45 tokens
    Shape("i2v", 3, 6, 6),  # 27 tokens, + 5 image tokens before the 9 text tokens
    Shape("t2v", 2, 4, 8),  # 16 tokens: tests/test_compile_grid.py's (a compiled decoder needs P | S)
]
GRID_SHAPES = SHAPES[:2]


def _build(shape: Shape, seed: int = 0):
    model = tiny_motif_video(shape.variant, seed=seed)
    return model, motif_video_inputs(model, shape.frames, shape.height, shape.width)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's video token count vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    tokens = motif_video_tokens(model, shape.frames, shape.height, shape.width)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with ``enable_gradient_checkpointing()``: the recompute of every block (decoder
    included) runs the routed processors again on the shard."""
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _decoder_tokens_case(mesh) -> dict[str, float]:
    """The decoder block's routed call holds this rank's rows of both streams: 2 x its shard of the
    45 tokens (Note [Motif-Video's decoder blocks]); the block ran (1.0 otherwise)."""
    model, inputs = _build(SHAPES[0])
    seen = []
    inner = motif_video.usp_attention

    def spy(q, k, v, **kwargs):
        seen.append(q.shape[1])
        return inner(q, k, v, **kwargs)

    ADAPTER.enable(model, mesh, "auto")
    try:
        with mock.patch.object(motif_video, "usp_attention", spy):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    shard = shard_sequence(torch.zeros(45), mesh, dim=0).shape[0]
    return {"decoder_not_2x_shard": float(seen != [2 * shard])}  # one decoder block: one call a forward


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated video Q/K of block 0 equal the same rows of one process's (element 0:
    its prompt is padded, so the router calls usp_attention once per element)."""
    model, inputs = _build(SHAPES[0])
    seen_ref, seen = [], []

    def spy_on(module, name: str, store: list):
        inner = getattr(module, name)

        def spy(q, k, v, *args, **kwargs):
            store.append((q.clone(), k.clone()))
            return inner(q, k, v, *args, **kwargs)
        return mock.patch.object(module, name, spy)

    with spy_on(transformer_motif_video, "dispatch_attention_fn", seen_ref):
        parity.forward(model, inputs)
    ADAPTER.enable(model, mesh, "auto")
    try:
        with spy_on(_routing, "usp_attention", seen):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    (q_ref, k_ref), (q, k) = seen_ref[0], seen[0]
    rows = lambda t: shard_sequence(t[:1, :45], mesh)
    return {"q": rel_err(q, rows(q_ref)), "k": rel_err(k, rows(k_ref))}


# ---- the pipeline ------------------------------------------------------------------------------------

PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # (U, R, cfg)
STEPS = 2


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of 2 steps at 48 x 80 x 9 frames (3 x 3 x 5 = 45 tokens), seed 0."""
    return parity.latents_and(pipe, "frames", prompt="a red fox jumps over a log", negative_prompt="blurry", height=48,
                              width=80, num_frames=9, num_inference_steps=STEPS, max_sequence_length=16,
                              generator=torch.Generator().manual_seed(0), output_type="pt")


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_motif_video_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS),
                                 names=("latents", "frames"),
                                 probe=lambda pipe, grid: parity.cfg_pair_computations(pipe, grid, STEPS))


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, GRID_SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "decoder-tokens", lambda: _decoder_tokens_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    two_heads = tiny_motif_video("t2v", num_heads=2)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(GRID_SHAPES), parity.grad_keys(GRID_SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_decoder_block_attends_both_streams_of_this_rank(grid_results):
    parity.assert_within(grid_results, "decoder-tokens", 0.0)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", list(parity.pipeline_grids(PIPELINE_GRIDS)))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, 0.0, {"latents": TOL, "frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: what enable changes, loud failures ------------------------------------------


def test_disable_restores_processors_hooks_and_decoder_marks():
    model, inputs = _build(SHAPES[1])  # no cross-attention: every attention module is routed
    parity.assert_disable_restores(model, inputs, ADAPTER, USPMotifVideoAttnProcessor)
    model, inputs = _build(SHAPES[0])
    decoder = model.single_transformer_blocks[-1].attn
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    marked = [getattr(b.attn, DECODER_MARK, False) for b in model.single_transformer_blocks]
    ADAPTER.disable(model)
    assert marked == [False, True] and DECODER_MARK not in decoder.__dict__


def test_a_custom_processor_is_refused():
    model, _ = _build(SHAPES[0])

    class Custom(transformer_motif_video.MotifVideoCrossAttnProcessor2_0):
        pass

    model.single_transformer_blocks[0].cross_attn.set_processor(Custom())
    with pytest.raises(NotImplementedError, match=r"single_transformer_blocks\.0\.cross_attn\.processor is Custom"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_a_mask_in_a_decoder_block_is_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        x = torch.randn(1, 45, 64)
        model.rope(inputs.hidden_states)  # this call's token count (the table hook records it)
        with pytest.raises(NotImplementedError, match="decoder blocks route dense unmasked attention only"):
            model.single_transformer_blocks[-1].attn(x, x, torch.ones(1, 1, 1, 90, dtype=torch.bool), None)
    finally:
        ADAPTER.disable(model)


def test_decoder_split_is_one_contiguous_split_of_both_streams():
    """Note [Motif-Video's decoder blocks]: the pieces are split_sizes(2 S, P) exactly when P | S."""
    from usp_dit.sharding.partition import split_sizes

    for num, degree in ((45, 2), (45, 4), (16, 4), (27, 4)):
        same = [2 * s for s in split_sizes(num, degree)] == split_sizes(2 * num, degree)
        assert same == (num % degree == 0)
