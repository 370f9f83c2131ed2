"""ChronoEdit adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids as two data-parallel replicas).
Model: a tiny 2-layer ``ChronoEditTransformer3DModel`` (ChronoEdit-14B's config: Wan 2.1 I2V's,
CLIP image tokens through the added K/V cross-attention; 4 heads x 16, every weight perturbed;
``usp_dit.demo.tiny_chronoedit``), batch 2 with a different prompt and timestep per element, 512
text and 5 image tokens. Shapes:
- "edit": 2 latent frames (the edit mode: the RoPE's temporal positions 0 and
  ``rope_temporal_skip_len - 1``), 2 x 3 x 5 = 30 tokens: two frames make every count even, so
  this one divides 2 but not 4;
- "reason": 3 latent frames (temporal reasoning's longer video: Wan's RoPE), 27 tokens, one random
  timestep per token (the model's (B, seq) timestep path, Wan's ``WanTimestepHook``).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced. Each case: output vs stock, block 0's attention
sees at most ceil(tokens / P) tokens, bit-identical after ``disable``. Every parameter's gradient
on 2 and 4 ranks for both shapes, and with gradient checkpointing; each rank's rotated Q/K of block
0 (the edit mode's RoPE) equal the same rows of one process's. The stock ``ChronoEditPipeline``
(T5-less: seeded prompt embeds, tiny CLIP vision encoder, Wan VAE, UniPC), built tiny, through
``pipe.enable_usp()`` on (2,1) and (2,2) (the VAE on the grid too: ``usp_dit.pipelines.vae``),
with temporal reasoning on (2,2) (3 latent frames for a step, then 2), and ``cfg_degree=2`` (its
two guidance calls a step on the two cfg groups), each equal to one process.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients, rotated Q/K and the
pipeline's final latents: sharding only reorders float32 sums (attention merged by log-sum-exp,
gradients summed over ranks). The decoded frames: 1e-4 (an untrained random VAE's gain, as in
tests/test_pipeline_wan.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_chronoedit

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_chronoedit import chronoedit_inputs, chronoedit_tokens, tiny_chronoedit, tiny_chronoedit_pipeline
from usp_dit.demo.tiny_video import TEXT_DIM, gradient_image
from usp_dit.demo.tiny_wan import I2V_TEXT_LEN
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families.chronoedit import ADAPTER
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

    @property
    def per_token_timestep(self) -> bool:
        return self.variant == "reason"

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [Shape("edit", 2, 6, 10), Shape("reason", 3, 6, 6)]


def _build(shape: Shape, seed: int = 0):
    model = tiny_chronoedit(seed=seed)
    inputs = chronoedit_inputs(model, shape.frames, shape.height, shape.width,
                               per_token_timestep=shape.per_token_timestep)
    return model, inputs


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    tokens = chronoedit_tokens(model, shape.frames, shape.height, shape.width)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.blocks[0].attn1, tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _first_attention_call(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated (q, k), each (B, S or S_local, H, D), of the first attention call of a forward."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """The edit mode's RoPE (temporal skip): each rank's rotated Q/K are the same rows of one process's."""
    model, inputs = _build(SHAPES[0])
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_chronoedit, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


def _generate(pipe, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames) of an edit at 48 x 80 (2 latent frames of 3 x 5 tokens), 2 steps,
    seeded prompt embeds (the pipeline's prompt cleaning needs ftfy, which the tests do not)."""
    g = torch.Generator().manual_seed(1)
    prompt, negative = (torch.randn(1, I2V_TEXT_LEN, TEXT_DIM, generator=g) for _ in range(2))
    return parity.latents_and(
        pipe, "frames",
        image=gradient_image(48, 80), prompt_embeds=prompt, negative_prompt_embeds=negative, height=48, width=80,
        num_inference_steps=kwargs.pop("steps", 2), generator=torch.Generator().manual_seed(0), output_type="pt",
        **kwargs,
    )


# Temporal reasoning: 9 frames (3 latent frames, 27 tokens) for the first step, then the first and last.
REASONING = dict(num_frames=9, enable_temporal_reasoning=True, num_temporal_reasoning_steps=1, steps=3)
PIPELINE_CASES = {"pipeline-u2r1": ((2, 1, 1), {}), "pipeline-u2r2": ((2, 2, 1), {}),
                  "pipeline-reasoning-u2r2": ((2, 2, 1), REASONING), "pipeline-cfg2": ((1, 1, 2), {})}


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The tiny ChronoEditPipeline through ``pipe.enable_usp`` on each of ``PIPELINE_CASES``, then
    bit-identical after ``pipe.disable_usp``."""
    pipe = tiny_chronoedit_pipeline()
    pipe.set_progress_bar_config(disable=True)
    refs = {"": _generate(pipe), "reasoning": _generate(pipe, **REASONING)}
    results = {}
    for key, ((u, r, c), kwargs) in PIPELINE_CASES.items():
        ref_latents, ref_frames = refs["reasoning" if kwargs else ""]
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        try:
            latents, frames = _generate(pipe, **kwargs)
        finally:
            pipe.disable_usp()
        results[key] = {"latents": rel_err(latents, ref_latents), "frames": rel_err(frames, ref_frames)}
    again_latents, again_frames = _generate(pipe)
    same = torch.equal(again_latents, refs[""][0]) and torch.equal(again_frames, refs[""][1])
    results["pipeline-after-disable"] = {"not_bit_identical": float(not same)}
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_chronoedit(num_heads=2, head_dim=32), ADAPTER,
                                                          init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_edit_mode_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", sorted(PIPELINE_CASES))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_edit(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process ------------------------------------------------------------------------------


def test_attention_mask_is_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model.blocks[0].attn1(torch.randn(1, 5, 64), None, torch.ones(1, 1, 5, 5, dtype=torch.bool), None)
    finally:
        ADAPTER.disable(model)


def test_wan_processor_is_not_taken_for_chronoedits():
    """Wan's own WanAttnProcessor (another class, another module) on a ChronoEdit model is refused."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    model, _ = _build(SHAPES[0])
    model.blocks[0].attn1.processor = WanAttnProcessor()
    with pytest.raises(NotImplementedError, match="blocks.0.attn1.processor is WanAttnProcessor"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


# ---- the video example's ChronoEdit option (argument checks only: nothing loads) -------------------


def _video_example(monkeypatch):
    from tests.test_examples_cli import _example

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return _example("generate_video")


def test_video_example_chronoedit_defaults_and_reasoning(monkeypatch):
    ex = _video_example(monkeypatch)
    args = ex.parse_args(["--model", "chronoedit"])
    assert (args.frames, args.height, args.width, args.degrees) == (5, 96, 144, (1, 1, 1))
    assert ex.TINY_TEXT_LENS["chronoedit"] == I2V_TEXT_LEN
    edit = ex.chronoedit_kwargs(args)
    assert edit["image"].size == (144, 96) and "enable_temporal_reasoning" not in edit
    reasoning = ex.chronoedit_kwargs(ex.parse_args(["--model", "chronoedit", "--frames", "9", "--steps", "4"]))
    assert reasoning["enable_temporal_reasoning"] and reasoning["num_temporal_reasoning_steps"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--model", "wan", "--image", "x.png"], "--image with --model wan: only chronoedit, consisid, hunyuan_video_framepack, "
                                             "sana_wm, wan_animate take an image"),
    (["--model", "chronoedit", "--image", "/no/such.png"], "--image /no/such.png: no such file"),
    (["--model", "chronoedit", "--frames", "7"], "--frames 7 must be 4k + 1"),
])
def test_video_example_refuses_what_chronoedit_cannot_take(argv, message, monkeypatch):
    import re

    from usp_dit.cli.launch import UsageError

    with pytest.raises(UsageError, match=re.escape(message)):
        _video_example(monkeypatch).parse_args(argv)
