"""HunyuanVideo adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Models: tiny ``HunyuanVideoTransformer3DModel``s
(one dual-stream, one single-stream and one token-refiner block; 4 heads x 16 head_dim; every weight
perturbed; ``usp_dit.demo.tiny_hunyuan_video``) in three variants: T2V (guidance-distilled), I2V
``latent_concat`` and I2V ``token_replace`` (the first latent frame's tokens modulated apart).
Latents give 45, 27 and 63 tokens (none divides 2 or 4; token_replace's 21 first-frame tokens fall
on rank 0 and part of rank 1 on 4 ranks), batch 2 with a different prompt, timestep and guidance
per element, and padded prompts of different valid lengths per element (element 0's mask has a
hole: the token refiner honours it, the blocks' mask is a prefix of the valid count, as in stock);
latent_concat's prompts are unpadded (no mask reaches usp_attention: one call for the batch).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced ("auto" never merges at
these sizes). Each case: output vs the stock output, block 0's attention sees at most
ceil(tokens / P) video tokens (text is replicated: all T text tokens on every rank), and after
``disable`` the output is bit-identical. Every parameter's gradient (loss / P on each rank,
summed over the sequence group, equals one process's; the token refiner's key bias, zero by
maths, is measured against its weight's scale: ``_ZERO_BY_MATHS``): every variant on 2 ranks,
T2V and token_replace on 4 ranks, and token_replace once with gradient checkpointing (2x2).
Each rank's rotated Q/K of block 0 equal the same rows of one process's. The tiny
``HunyuanVideoPipeline`` (Llama and CLIP text encoders, 2 steps, "true cfg" with a negative prompt:
two transformer calls of batch 1 per step, prompts of different padded lengths, HunyuanVideo VAE
decode) through ``pipe.enable_usp()`` on (2,1) and (2,2) equals one process's. Its two calls a
step at ``cfg_degree=2`` (the family's ``cfg_branch_args``, run on the two cfg groups at once):
tests/test_cfg_pair.py.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the pipeline's final latents. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks): measured 4.1e-7 at most
on outputs (with the schedules forced), 1.0e-6 on the worst gradient, 0 on the rotated Q/K and on
the pipeline (its "auto" schedule makes one kernel call over the whole K/V at these sizes). The
decoded frames: 1e-4 (an untrained random VAE's gain, as in tests/test_video_pipelines.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from diffusers.models.transformers import transformer_hunyuan_video

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_hunyuan_video import (
    TINY_PROMPT_TEMPLATE,
    hunyuan_video_inputs,
    hunyuan_video_tokens,
    tiny_hunyuan_video,
    tiny_hunyuan_video_pipeline,
)
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import hunyuan_video
from usp_dit.pipelines.families.hunyuan_video import ADAPTER
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

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("t2v", 3, 6, 10),  # 3 x 3 x 5 = 45 tokens
    Shape("i2v-concat", 3, 6, 6),  # 27 tokens
    Shape("i2v-token-replace", 3, 6, 14),  # 63 tokens, the first 21 (frame 0) modulated apart
]


# latent_concat differs from T2V by its input channels alone: its gradients on 2 ranks suffice.
GRAD_SHAPES = {2: SHAPES, 4: [SHAPES[0], SHAPES[2]]}


def _build(shape: Shape, seed: int = 0):
    model = tiny_hunyuan_video(shape.variant, seed=seed)
    # latent_concat gets unpadded prompts: the router's other path (one call for the whole batch, no mask)
    valid = [list(range(9))] * 2 if shape.variant == "i2v-concat" else None
    return model, hunyuan_video_inputs(model, shape.frames, shape.height, shape.width, valid=valid)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's video token count vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    tokens = hunyuan_video_tokens(model, shape.frames, shape.height, shape.width)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, tokens)


# Key biases whose gradient is zero by maths: the token refiner's attention has no norm after
# ``to_k``, and softmax over keys ignores a shift shared by all keys of a query row, so
# d(loss)/d(to_k.bias) is rounding noise (~1e-8 against ~1 for its weight): relative to itself it
# says nothing. Its error is measured against its module's ``to_k.weight`` gradient instead.
_ZERO_BY_MATHS = re.compile(r"^context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn\.to_k\.bias$")


def gradient_errors(model, inputs, adapter, mesh) -> dict[str, float]:
    """tests/adapter_parity.gradient_errors (loss / P on each rank, gradients summed over the
    sequence group vs one process's), with ``_ZERO_BY_MATHS`` measured against their weight's scale."""
    ref = parity._param_grads(model, inputs, 1)
    adapter.enable(model, mesh, "auto")
    try:
        grads = parity._param_grads(model, inputs, mesh.sequence_degree)
    finally:
        adapter.disable(model)
    worst = 0.0
    for name, g in grads.items():
        g = g.contiguous()  # gloo reduces contiguous buffers only
        dist.all_reduce(g, group=mesh.seq_group)
        if _ZERO_BY_MATHS.match(name):
            scale = ref[name.replace(".bias", ".weight")].abs().max().item()
            worst = max(worst, (g - ref[name]).abs().max().item() / scale)
        else:
            worst = max(worst, rel_err(g, ref[name]))
    return {"grad": worst}


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with ``enable_gradient_checkpointing()`` (token_replace): block 0's recompute in
    backward re-shards its saved full input, and every block's recompute gets the local first-frame count."""
    model, inputs = _build(SHAPES[2])
    model.enable_gradient_checkpointing()
    return gradient_errors(model, inputs, ADAPTER, mesh)


def _first_attention_call(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, k) that block 0's attention hands ``module.name`` first, rotated."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Design, positional tables: each rank's rotated video Q/K equal the same rows of one process's.

    The stock run records diffusers' dispatch call ([video; text] of the whole batch); the sharded
    run the first usp_attention call it is routed to (batch element 0 alone: its prompt is padded,
    so the router calls once per element)."""
    model, inputs = _build(SHAPES[2])
    num_video = hunyuan_video_tokens(model, SHAPES[2].frames, SHAPES[2].height, SHAPES[2].width)
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_hunyuan_video, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)

    def rows(t: torch.Tensor) -> torch.Tensor:  # this rank's rows of element 0's video tokens
        return shard_sequence(t[:1, :num_video], mesh)

    return {"q": rel_err(q, rows(q_ref)), "k": rel_err(k, rows(k_ref))}


def _generate(pipe, true_cfg: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of 2 steps at 48 x 80 x 9 frames (3 x 3 x 5 = 45 tokens), seed 0; with
    ``true_cfg`` a negative prompt of another padded length (two transformer calls per step)."""
    extra = dict(negative_prompt="blurry", true_cfg_scale=3.0) if true_cfg else {}
    return parity.latents_and(
        pipe, "frames",
        prompt="a red fox", height=48, width=80, num_frames=9, num_inference_steps=2, max_sequence_length=16,
        prompt_template=TINY_PROMPT_TEMPLATE, generator=torch.Generator().manual_seed(0), output_type="pt", **extra,
    )


PIPELINE_GRIDS = [(2, 1), (2, 2)]  # (U, R): a 2-rank sequence group (dp 2) and all 4 ranks


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The tiny HunyuanVideoPipeline on each of ``PIPELINE_GRIDS`` through ``pipe.enable_usp``."""
    grids = {f"pipeline-u{u}r{r}": (u, r, 1) for u, r in PIPELINE_GRIDS}
    return parity.pipeline_cases(tiny_hunyuan_video_pipeline(), _generate, grids, names=("latents", "frames"),
                                 check_enabled=False)


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: gradient_errors(*_build(shape), ADAPTER, mesh), GRAD_SHAPES)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    two_heads = tiny_hunyuan_video("t2v", num_heads=2, head_dim=32)
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


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}" for u, r in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: registration, restore exactly, loud failures --------------------------------


def test_framepack_is_another_class_not_matched():
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    framepack = HunyuanVideoFramepackTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, text_embed_dim=16, pooled_projection_dim=16, rope_axes_dim=(2, 2, 4),
    )
    assert not ADAPTER.matches(framepack)


def test_single_stream_blocks_alone_are_refused():
    """num_layers=0: the tokens are split at transformer_blocks.0, which such a model lacks."""
    model = tiny_hunyuan_video()
    model.transformer_blocks = torch.nn.ModuleList()
    with pytest.raises(NotImplementedError, match="num_layers=0 \\(single-stream blocks only\\) is not supported"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


test_a_foreign_token_refiner_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_hunyuan_video, ADAPTER, "context_embedder.token_refiner.refiner_blocks.0.attn")


def test_a_mask_over_video_tokens_is_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    attn = model.transformer_blocks[0].attn
    try:
        x, text = torch.randn(2, 5, 64), torch.randn(2, 3, 64)
        mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
        mask[:, :, :, 0] = False
        with pytest.raises(NotImplementedError, match="masks video tokens"):
            attn.processor.route.state.seq_len = 5  # as block 0's hook records it in a forward
            attn(x, text, mask, image_rotary_emb=None)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_hunyuan_video, ADAPTER, hunyuan_video, "_RoutedHunyuanProcessor")
