"""FramePack adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each). Models: tiny ``HunyuanVideoFramepackTransformer3DModel``s as the released
FramePack (history embedders at 1x, 2x, 4x, the SigLIP image projection, guidance embedding; one
dual-stream, one single-stream and one token-refiner block; 4 heads x 16 head_dim; every weight
perturbed; ``usp_dit.demo.tiny_hunyuan_video_framepack``). Two packed sequences (Note [FramePack's
packed sequence]): 83 tokens (2 (4x) + 6 (2x) + 30 clean + 45 noisy; batch 2 with a different
prompt, image, history, timestep and guidance per element and padded prompts of different valid
lengths: element 0's mask has a hole, the blocks' mask is a prefix of the valid count, as in
stock) and 41 tokens (1 + 4 + 9 + 27; batch 1: the model crops the text and passes no mask). None
divides 2 or 4; on 4 ranks the noisy/history seam falls inside rank 1's shard, so the noisy-token
crop (Note [FramePack's noisy-token crop]) is checked across a shard boundary. The frame indices
of every part are random (distinct, increasing), so every RoPE row differs from a plain range.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
ring grids also with the "stream" and "gather_merge" schedules forced (one ring grid per shape in
CI: adapter_parity Note [schedules in CI]). Each case: output vs the stock output, block 0's
attention sees at most ceil(packed tokens / P) video tokens (text and image tokens are
replicated), after ``disable`` the output is bit-identical. Every parameter's gradient (loss / P
on each rank, summed over the sequence group, equals one process's; the token refiner's key bias,
zero by maths, against its weight's scale, as tests/test_pipeline_hunyuan_video.py): both shapes on
2 ranks, the batch-2 shape on 4 ranks and once with gradient checkpointing (2x2: block 0's
recompute re-shards, the last block's recompute gathers again). Each rank's rotated Q/K of block 0
equal the same rows of one process's (the packed RoPE table cut like the tokens). The tiny
``HunyuanVideoFramepackPipeline`` (Llama and CLIP text encoders, SigLIP image encoder, 2 steps,
true CFG with a negative prompt: two calls of batch 1 a step, inverted anti-drifting sampling,
HunyuanVideo VAE encode and decode) through ``pipe.enable_usp()`` on (2,1), (2,2) and (1,2,2)
equals one process's; at cfg 2 the two calls of a step run on the two cfg groups at once
(``steps + 1`` computations per rank).

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the pipeline's final latents. Sharding only reorders float32 sums
(attention merged by log-sum-exp, gradients summed over ranks): measured 4.3e-7 at most on outputs
(0 on the batch-1 shape under the "auto" schedule: one kernel call over the whole K/V), 2.3e-6 on the
worst gradient, 0 on the rotated Q/K, 6.4e-7 on the pipeline's latents. The decoded frames: 1e-4
(an untrained random VAE's gain on latents that differ by ~1e-7, as in
tests/test_pipeline_hunyuan_video.py; measured 3.3e-6).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers.models.transformers import transformer_hunyuan_video

from tests import adapter_parity as parity
from tests import family_checks
from tests.test_pipeline_hunyuan_video import gradient_errors  # the refiner's zero-by-maths key bias
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_hunyuan_video_framepack import (
    TINY_PROMPT_TEMPLATE,
    framepack_inputs,
    framepack_tokens,
    tiny_framepack,
    tiny_framepack_pipeline,
)
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families.hunyuan_video import USPHunyuanVideoAttnProcessor
from usp_dit.pipelines.families.hunyuan_video_framepack import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4
STEPS = 2


@dataclass(frozen=True)
class Shape:
    frames: tuple[int, int, int, int]  # latent frames: noisy, clean, 2x history, 4x history
    height: int
    width: int
    batch: int

    def __str__(self) -> str:
        return "f{}-{}-{}-{}".format(*self.frames) + f"h{self.height}w{self.width}b{self.batch}"


SHAPES = [
    Shape((3, 2, 2, 4), 6, 10, 2),  # 2 + 6 + 30 + 45 = 83 packed tokens, masks of different lengths
    Shape((3, 1, 2, 4), 6, 6, 1),  # 1 + 4 + 9 + 27 = 41, batch 1 (text cropped, no mask)
]
GRAD_SHAPES = {2: SHAPES, 4: [SHAPES[0]]}


def _build(shape: Shape, seed: int = 0):
    model = tiny_framepack(seed=seed)
    valid = None if shape.batch == 2 else [[0, 1, 2, 3, 4]]
    return model, framepack_inputs(model, shape.frames, shape.height, shape.width, valid=valid)


def _tokens(model, shape: Shape) -> tuple[int, int]:
    return framepack_tokens(model, shape.frames, shape.height, shape.width)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's packed token count vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    packed, _ = _tokens(model, shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, packed)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
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
    """Each rank's rotated packed-token Q/K equal the same rows of one process's (the stock call is
    the whole batch's [packed; image; text]; the routed one element 0's, its prompt being padded)."""
    model, inputs = _build(SHAPES[0])
    packed, _ = _tokens(model, SHAPES[0])
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_hunyuan_video, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t[:1, :packed], mesh)

    return {"q": rel_err(q, rows(q_ref)), "k": rel_err(k, rows(k_ref))}


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames): 48 x 80 pixels, a 3-frame window (89 packed tokens), 2 steps, true CFG."""
    g = torch.Generator().manual_seed(7)
    pixels = torch.randint(0, 256, (48, 80, 3), generator=g, dtype=torch.uint8).numpy()
    from PIL import Image

    return parity.latents_and(
        pipe, "frames", image=Image.fromarray(pixels), prompt="a red fox", negative_prompt="blurry",
        true_cfg_scale=3.0, height=48, width=80, num_frames=9, latent_window_size=3, num_inference_steps=STEPS,
        max_sequence_length=16, prompt_template=TINY_PROMPT_TEMPLATE, generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )


PIPELINE_GRIDS = parity.ci_grids(parity.pipeline_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)]))


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(
        tiny_framepack_pipeline(), _generate, PIPELINE_GRIDS, names=("latents", "frames"),
        probe=lambda pipe, grid: parity.cfg_pair_computations(pipe, grid, STEPS),
    )


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: gradient_errors(*_build(shape), ADAPTER, mesh), GRAD_SHAPES)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_framepack(num_heads=2, head_dim=32), ADAPTER,
                                                          init_usp(ulysses_degree=4)))
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


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: registration, restore exactly, loud failures --------------------------------


def test_shapes_have_the_token_counts_the_docstring_states():
    model = tiny_framepack()
    assert [_tokens(model, s) for s in SHAPES] == [(83, 45), (41, 27)]


# the refiner's local attention keeps its stock processor
test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[1]), ADAPTER, (USPHunyuanVideoAttnProcessor, AttnProcessor2_0))


@pytest.mark.parametrize("blocks, reason", [
    ("transformer_blocks", "num_layers=0 \\(single-stream blocks only\\) is not supported"),
    ("single_transformer_blocks", "num_single_layers=0 is not supported: the packed tokens are gathered"),
])
def test_a_missing_block_list_is_refused(blocks: str, reason: str):
    model = tiny_framepack()
    setattr(model, blocks, torch.nn.ModuleList())
    with pytest.raises(NotImplementedError, match=reason):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


test_a_foreign_token_refiner_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_framepack, ADAPTER, "context_embedder.token_refiner.refiner_blocks.0.attn")


def test_a_rope_table_of_another_length_is_refused():
    """A packed table whose rows are not the packed tokens (e.g. a history part the forward packed
    without its table) is refused, not cut misaligned."""
    model, inputs = _build(SHAPES[1])
    block = model.transformer_blocks[0]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    short = block.register_forward_pre_hook(lambda m, args: (*args[:4], tuple(t[1:] for t in args[4])), prepend=True)
    try:
        with pytest.raises(ValueError, match="freqs_cis has \\[40, 40\\] rows but the packed sequence has 41"):
            parity.forward(model, inputs)
    finally:
        short.remove()
        ADAPTER.disable(model)
