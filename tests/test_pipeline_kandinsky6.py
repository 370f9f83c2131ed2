"""Kandinsky 6 adapter: sharded transformer outputs (video and audio) and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks. Model: a tiny ``Kandinsky6Transformer3DModel`` (1 text block a stream, 2 fused
blocks, video 4 heads x 16, audio 2 x 16, the releases' ``ca_rope`` / ``cross_gates`` /
``fix_modulation``, two token types; every weight perturbed, the zero-initialised modulations too;
``usp_dit.demo.tiny_kandinsky6``). Shapes: video 3 x 6 x 10 latents (45 tokens) with 7 audio
tokens and a prompt mask of 9 and 5 real tokens of 9 (batch 2); an image-like 1 x 6 x 14 (21
tokens) without audio (the fused blocks' video-only path) and without a mask; no count divides 2
or 4. A different prompt, pooled embedding, timestep and token types per element; random RoPE
positions.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced (the video-only shape on the default schedule:
CI time). Each case: the video and audio outputs vs the stock outputs, block 0's video
self-attention sees at most ceil(tokens / P) tokens, and after ``disable`` both outputs are
bit-identical. On 2 and 4 ranks every parameter's gradient of a loss over both outputs (loss / P a
rank, summed over the sequence group, equals one process's: the replicated text and audio streams
and the audio-from-video merge's backward), and once with gradient checkpointing (the gather at the
last block sits inside its recompute). The stock ``Kandinsky6TI2VAPipeline``, built tiny, through
``pipe.enable_usp()`` on (2,1) and (2,2) and with ``cfg_degree=2`` (its two guidance calls a step
on the two cfg groups; prompt and negative prompt with different padding masks), 2 steps,
``output_type="latent"``: its final video and audio latents (the VAEs decode outside the
transformer and are tested with their own families). Refused: a model without fused blocks; the
super-resolution transformer (NABLA sparse attention).

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient and the pipeline's final latents. Sharding only reorders float32 sums (attention over
blocks of keys merged by log-sum-exp, gradients of replicated streams summed over ranks); the stock
RoPE casts back to the input dtype (float32), unlike Kandinsky 5's bfloat16 round trip, so a float32
model reproduces itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_kandinsky6 import kandinsky6_inputs, kandinsky6_tokens, tiny_kandinsky6, tiny_kandinsky6_pipeline
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.families.kandinsky6 import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4


@dataclass(frozen=True)
class Shape:
    frames: int  # latent sizes
    height: int
    width: int
    audio: int | None  # audio tokens; None: video only
    masked: bool  # a prompt mask of different lengths per element

    def __str__(self) -> str:
        return f"f{self.frames}h{self.height}w{self.width}a{self.audio}" + ("-masked" if self.masked else "")


SHAPES = [
    Shape(3, 6, 10, 7, True),  # 3 x 3 x 5 = 45 video tokens, 7 audio
    Shape(1, 6, 14, None, False),  # 1 x 3 x 7 = 21, video only
]


def _fits(shape: Shape, grid: tuple) -> bool:
    """The video-only shape on the grids at their default schedule (CI time)."""
    return shape.audio is not None or grid[3] is None


def _build(shape: Shape, seed: int = 0):
    model = tiny_kandinsky6(seed=seed)
    inputs = kandinsky6_inputs(model, shape.frames, shape.height, shape.width, audio_len=shape.audio,
                               text_valid=(9, 5) if shape.masked else None)
    return model, inputs


def _outputs(model, inputs) -> list[torch.Tensor]:
    """[video] or [video, audio] of one forward."""
    with torch.no_grad():
        return list(model(**inputs.kwargs(), return_dict=False))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Video and audio vs stock, block 0's video self-attention length vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    ref = _outputs(model, inputs)
    lengths = []

    def seen(module, args, kwargs):
        lengths.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1])

    ADAPTER.enable(model, mesh, "auto")
    attention = model.visual_transformer_blocks[0].video_dec_block.self_attention
    hook = attention.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        got = _outputs(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)
    again = _outputs(model, inputs)
    tokens = kandinsky6_tokens(model, shape.frames, shape.height, shape.width)
    errors = {name: rel_err(g, r) for name, g, r in zip(("video", "audio"), got, ref)}
    errors["outputs_missing"] = float(len(got) != len(ref) or len(ref) != 1 + (shape.audio is not None))
    errors["block0_tokens_above_ceil"] = float(not lengths or max(lengths) > math.ceil(tokens / mesh.sequence_degree))
    errors["disable_not_bit_identical"] = float(not all(torch.equal(a, r) for a, r in zip(again, ref)))
    return errors


def _param_grads(model, inputs, divisor: int) -> dict[str, torch.Tensor]:
    """Gradients of a random weighting of every output, / ``divisor``."""
    outs = model(**inputs.kwargs(), return_dict=False)
    g = torch.Generator().manual_seed(123)
    loss = sum((out * torch.randn(out.shape, generator=g)).sum() for out in outs)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss / divisor, list(params.values()), allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params.items(), grads)}


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    """Every parameter's gradient summed over the sequence group vs one process's (the worst one)."""
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
        g = g.contiguous()  # gloo reduces contiguous buffers only
        dist.all_reduce(g, group=mesh.seq_group)
        worst = max(worst, rel_err(g, ref[name]))
    return {"grad": worst}


def _generate(pipe) -> dict[str, torch.Tensor]:
    """Final video and audio latents of 2 guided steps at 48 x 80 x 9 frames (45 video, 11 audio
    tokens), seed 0; a prompt and a shorter negative prompt, each padded to 24 tokens and masked."""
    out = pipe(prompt="a red fox jumps", negative_prompt="blurry", height=48, width=80, num_frames=9,
               num_inference_steps=2, guidance_scale=3.0, max_sequence_length=24, output_type="latent",
               generator=torch.Generator().manual_seed(0))
    return {"latents": out.frames, "audio_latents": out.audio}


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (2, 1, 2)])  # (U, R, cfg)


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The tiny pipeline on each of ``PIPELINE_GRIDS`` vs its stock run; after ``disable_usp`` bit-identical."""
    pipe = tiny_kandinsky6_pipeline()
    pipe.set_progress_bar_config(disable=True)
    ref = _generate(pipe)
    results = {}
    for u, r, c in PIPELINE_GRIDS:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe.transformer)
        try:
            got = _generate(pipe)
        finally:
            pipe.disable_usp()
        errors = {name: rel_err(got[name], ref[name]) for name in ref}
        errors["not_enabled_then_restored"] = float(not enabled or is_usp_enabled(pipe.transformer))
        results[f"pipeline-u{u}r{r}cfg{c}"] = errors
    again = _generate(pipe)
    results["pipeline-after-disable"] = {"not_bit_identical": float(not all(torch.equal(again[k], ref[k]) for k in ref))}
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case, fits=_fits)
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[0], init_usp(2, 2), checkpointing=True))
    two_heads = tiny_kandinsky6(num_heads=2, head_dim=32, audio_heads=1)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES, _fits), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("grid", PIPELINE_GRIDS, ids=lambda g: "u{}r{}cfg{}".format(*g))
def test_pipeline_matches_one_process(grid_results, grid):
    key = "pipeline-u{}r{}cfg{}".format(*grid)
    for rank, res in enumerate(grid_results):
        errors = res.get(key) or res.get("pipeline", "no result")
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {name: v for name, v in errors.items() if not v <= TOL}
        assert not worst, f"rank {rank}: above {TOL}: {worst}"


def test_disable_usp_gives_back_the_bit_identical_pipeline_output(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: refusals ---------------------------------------------------------------------


def test_a_model_without_fused_blocks_is_refused():
    model, _ = _build(SHAPES[0])
    model.visual_transformer_blocks = torch.nn.ModuleList()
    with pytest.raises(NotImplementedError, match="num_visual_blocks=0"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_a_mask_in_a_parallel_site_is_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        attention = model.visual_transformer_blocks[0].video_dec_block.self_attention
        x = torch.randn(2, 5, model.config.model_dim)
        with pytest.raises(NotImplementedError, match="no attention mask in the video self-attention"):
            attention(x, attn_mask=torch.ones(2, 5, dtype=torch.bool))
    finally:
        ADAPTER.disable(model)


def test_the_super_resolution_transformer_has_its_own_plan():
    """Kandinsky 6 SR (every layer NABLA) runs on grids without a ring through its own plan
    (tests/test_pipeline_kandinsky6_sr.py), not this one."""
    from diffusers import Kandinsky6SRTransformer3DModel

    from usp_dit.pipelines.base import registered_adapters
    from usp_dit.pipelines.families import kandinsky6_sr

    owners = [a for a in registered_adapters() if getattr(a, "model_class", None) is Kandinsky6SRTransformer3DModel]
    assert owners == [kandinsky6_sr.ADAPTER]


# ---- the video example's Kandinsky 6 option (argument checks only: nothing loads) -----------------


def test_video_example_kandinsky6_defaults(monkeypatch):
    from tests.test_examples_cli import _example
    from usp_dit.cli.launch import UsageError

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    example = _example("generate_video")
    args = example.parse_args(["--model", "kandinsky6"])
    assert (args.frames, args.height, args.width, args.degrees) == (9, 96, 144, (1, 1, 1))
    with pytest.raises(UsageError, match="--frames 11 must be 4k [+] 1"):
        example.parse_args(["--model", "kandinsky6", "--frames", "11"])
