"""EasyAnimate adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (tests/adapter_parity.run_grid_cases); the 2-rank grids
run on it as two data-parallel replicas. Models (usp_dit/demo/tiny_easyanimate.py): tiny 2-layer
``EasyAnimateTransformer3DModel`` s, 4 heads x 16, every weight perturbed, in three variants: V5.1
(MMDiT blocks throughout), "mixed-control" (block 1 past ``mmdit_layers``: the text concatenated
into the video's projections; a post-MLP norm; a second, T5 text stream; control latents on
channels) and "inpaint" (mask and masked-video latents on channels). Latents of 27, 45 and 27 video
tokens (divide neither 2 nor 4) and 24 (do), batch 2 with different prompts and timesteps; the
RoPE table is the model's own (``rope_embedding``), real 3D positions. Grids (U, R, cfg): (2,1,1),
(1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with the "stream" and
"gather_merge" schedules forced (tests/adapter_parity Note [schedules in CI]). Each case: output vs
stock, block 0's attention sees at most ceil(tokens / P) video tokens (the text is replicated),
bit-identical after ``disable``. Gradients (V5.1 and mixed-control) on (1,2,1) and (2,2,1), and
with gradient checkpointing on (2,2,1): per-rank losses L / P, parameter gradients summed over the
sequence group equal one process's. Each rank's rotated Q/K of block 0 equal the same rows of one
process's. Dropout in training: the replicated text stream is the same on every rank after each
block. The stock ``EasyAnimatePipeline`` (Qwen2-VL-like text encoder, Magvit VAE; two prompts with
negative prompts, batched [uncond, cond] guidance, 2 steps, 48 x 48 x 9 frames = 27 tokens beside
256 text tokens) through ``pipe.enable_usp()`` on (2,1), (2,2) and (2,1,cfg 2) equals one process;
``disable_usp`` gives the bit-identical video back. ulysses_degree 4 on a 2-head model, a
non-stock processor, and dropout with blocks past ``mmdit_layers`` are refused.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, gradients, rotated
Q/K and the pipeline's final latents: sharding only reorders float32 sums (attention merged by
log-sum-exp, projections on fewer rows, gradients summed over ranks), a few 1e-7 relative at these
sizes. The decoded frames: 1e-4 (an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
The text stream's spread across ranks under dropout: 0 (the same mask, the same arithmetic).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from diffusers.models.attention_processor import AttnProcessor2_0

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_easyanimate import (
    easyanimate_inputs,
    easyanimate_tokens,
    tiny_easyanimate,
    tiny_easyanimate_pipeline,
)
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families.easyanimate import ADAPTER, USPEasyAnimateAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4
TEXT_LEN = 7  # easyanimate_inputs' default prompt length


@dataclass(frozen=True)
class Shape:
    variant: str
    frames: int  # latent sizes
    height: int
    width: int

    @property
    def tokens(self) -> int:
        return self.frames * (self.height // 2) * (self.width // 2)

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("v5.1", 3, 6, 6),  # 27 video tokens
    Shape("v5.1", 2, 8, 6),  # 24
    Shape("mixed-control", 3, 6, 10),  # 45
    Shape("inpaint", 3, 6, 6),  # 27
]
GRAD_SHAPES = [SHAPES[0], SHAPES[2]]


def _build(shape: Shape, dropout: float = 0.0):
    model = tiny_easyanimate(shape.variant, dropout=dropout)
    return model, easyanimate_inputs(model, shape.frames, shape.height, shape.width, text_len=TEXT_LEN)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    assert easyanimate_tokens(model, shape.frames, shape.height, shape.width) == shape.tokens
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with ``enable_gradient_checkpointing()``: block 0's recompute re-shards its saved
    full input; every block gets the already-cut RoPE table."""
    model, inputs = _build(SHAPES[2])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Block 0's rotated Q/K on each rank (the routed usp_attention call's video part) equal the same
    rows of one process's (the stock F.scaled_dot_product_attention call's, past the text)."""
    model, inputs = _build(SHAPES[2])
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def stock_spy(q, k, v, *args, **kwargs):
        seen.append((q[:, :, TEXT_LEN + 5:].transpose(1, 2), k[:, :, TEXT_LEN + 5:].transpose(1, 2)))  # + 5 T5 tokens
        return sdpa(q, k, v, *args, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", stock_spy):
        parity.forward(model, inputs)
    q_ref, k_ref = seen[0]
    seen.clear()
    usp_attention = _routing.usp_attention

    def usp_spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return usp_attention(q, k, v, *args, **kwargs)

    ADAPTER.enable(model, mesh, "auto")
    try:
        with mock.patch.object(_routing, "usp_attention", usp_spy):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    q, k = seen[0]
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


def _text_spread_under_dropout(mesh) -> dict[str, float]:
    """V5.1 with dropout 0.3 in training, each rank its own global RNG: the text stream each block
    returns is the same on every rank of the sequence group (``txt_ff``'s dropouts draw the group's
    mask), and differs from the eval-mode stream (dropout ran)."""
    model, inputs = _build(SHAPES[0], dropout=0.3)
    streams = []
    hooks = [b.register_forward_hook(lambda m, a, out: streams.append(out[1].detach().clone()))
             for b in model.transformer_blocks]
    ADAPTER.enable(model, mesh, "auto")
    try:
        parity.forward(model, inputs)
        eval_streams, streams[:] = list(streams), []
        model.train()
        torch.manual_seed(1000 + dist.get_rank())
        parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
        for h in hooks:
            h.remove()
    spread = 0.0
    for s in streams:
        everyone = [torch.empty_like(s) for _ in range(mesh.sequence_degree)]
        dist.all_gather(everyone, s.contiguous(), group=mesh.seq_group)
        spread = max(spread, max((e - s).abs().max().item() for e in everyone))
    return {"text_spread": spread, "dropout_inactive": float(torch.equal(streams[0], eval_streams[0]))}


# ---- the stock pipeline ----------------------------------------------------------------------------

PIPELINE_GRIDS = parity.ci_grids({"pipeline-u2r1": (2, 1, 1), "pipeline-u2r2": (2, 2, 1), "pipeline-u2cfg2": (2, 1, 2)})


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of two prompts at 48 x 48 x 9 frames (27 tokens), 2 steps, guidance 5."""
    return parity.latents_and(
        pipe, "frames", prompt=["a red fox jumps over a log", "a cat"], negative_prompt=["blurry", "dark"],
        height=48, width=48, num_frames=9, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_easyanimate_pipeline(), _generate, PIPELINE_GRIDS, names=("latents", "frames"))


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh),
                          {2: GRAD_SHAPES, 4: GRAD_SHAPES})
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "dropout", lambda: _text_spread_under_dropout(init_usp(2, 2)))
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_easyanimate(num_heads=2, head_dim=16), ADAPTER,
                                                          init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(GRAD_SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_dropout_on_the_replicated_text_draws_one_mask(grid_results):
    parity.assert_within(grid_results, "dropout", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: restore exactly, refusals, the example ---------------------------------------


def test_disable_restores_and_one_rank_is_bit_identical():
    model, inputs = _build(SHAPES[2])
    parity.assert_disable_restores(model, inputs, ADAPTER, USPEasyAnimateAttnProcessor)
    parity.assert_one_rank_bit_identical(model, inputs, ADAPTER)


test_a_processor_other_than_the_stock_one_is_refused = family_checks.foreign_processor_refused(
    lambda: _build(SHAPES[0])[0], ADAPTER, "transformer_blocks.1.attn1", AttnProcessor2_0)


def test_dropout_with_blocks_past_mmdit_layers_is_refused():
    model, _ = _build(SHAPES[2], dropout=0.1)
    with pytest.raises(NotImplementedError, match=r"dropout=0.1 with blocks \[1\] past mmdit_layers=1"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_video_example_easyanimate_defaults_and_tiny_generation(monkeypatch):
    from tests.test_examples_cli import _example

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ex = _example("generate_video")
    args = ex.parse_args(["--model", "easyanimate", "--steps", "1", "--height", "48", "--width", "48"])
    assert args.frames == 9
    frames = ex.generate(ex.load_pipeline(args, torch.device("cpu")), args)
    assert frames.shape == (9, 48, 48, 3) and np.isfinite(frames).all()
