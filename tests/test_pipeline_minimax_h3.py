"""MiniMax-H3 adapter: sharded transformer outputs (video and audio) and gradients equal one
process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids as two data-parallel replicas).
Model: a tiny 2-layer ``MiniMaxH3Transformer3DModel`` with one text-refiner block (4 heads x 16,
hidden 48, 12 of 16 head channels rotated; every weight perturbed; ``usp_dit.demo.tiny_minimax_h3``),
batch 2 with a different prompt, video and audio per element (the packed layout -- timesteps,
indices, tags, positions -- is shared by the batch: the model's contract). Each modality's rows
are scattered over the packed sequence in a random order, so every shard holds text, video and
audio rows; random (t, h, w) positions; 3 distinct timesteps, a random one per row. Shapes:
- "av": 5 text + 12 video + 4 audio = 21 rows (divides neither 2 nor 4);
- "video": 7 text + 20 video rows, no audio (an empty audio head output) = 27 rows.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced. Each case: video and audio outputs vs stock,
block 0's attention sees at most ceil(rows / P) rows, bit-identical after ``disable``. Every
parameter's gradient (of a loss on both outputs) on 2 and 4 ranks for both shapes, and with
gradient checkpointing. ``enable_usp(shard_weights=True)`` (FSDP2 over ``transformer_blocks``) on
(2,2): the output equals the unsharded grid's exactly.

The stock pipeline: MiniMax-H3 ships only as Diffusers modular blocks
(``diffusers.modular_pipelines.minimax_h3``): ``pipe.enable_usp()`` on the modular pipeline of the stock
``MiniMaxH3CoreDenoiseStep`` (the packed layout, noise, per-row timesteps, denoising loop) around
a tiny transformer, 64 x 64 x 124 frames (148 video + 414 audio + 7 text = 569 rows), 3 steps, on
(2,1), (2,2) and (1,2,2) (guidance-distilled: one call a step, so the cfg groups each run the
batch of one whole), its final video and audio latents equal to one process's; bit-identical after
``disable_usp``. Text encoder and VAEs are not built (seeded prompt embeds; latents compared).

The video example (``examples/generate_video.py --model minimax_h3``): the stock core denoise and
decode steps with tiny VAEs (``tiny_minimax_h3_pipeline``) under torchrun on 2 ranks, ring 2
(``tests/_examples_job.py``), 64 x 96 x 124 frames (222 video + 414 audio + 7 text = 643 rows),
2 steps: it prints MATCH against one rank (frames and soundtrack; the example's
tolerance, 1e-4) and rank 0 writes a 124-frame GIF and a stereo 32 kHz WAV of 124 / 24 s.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and gradients: sharding only reorders
float32 sums (attention merged by log-sum-exp, gradients summed over ranks). FSDP2 against the
unsharded grid: 0 (the same weights reach the same maths; only where they sit changed).
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
import wave
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from tests import adapter_parity as parity
from usp_dit import disable_usp, enable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_minimax_h3 import minimax_h3_inputs, minimax_h3_text, tiny_minimax_h3, tiny_minimax_h3_denoise
from usp_dit.pipelines.families.minimax_h3 import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4


@dataclass(frozen=True)
class Shape:
    name: str
    text: int
    video: int
    audio: int

    def __str__(self) -> str:
        return f"{self.name}-t{self.text}v{self.video}a{self.audio}"


SHAPES = [Shape("av", 5, 12, 4), Shape("video", 7, 20, 0)]


def _build(shape: Shape, seed: int = 0):
    return tiny_minimax_h3(seed=seed), minimax_h3_inputs(shape.text, shape.video, shape.audio, seed=seed)


def _both(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(video (B, n_video, C), audio (B, n_audio, C_audio)) of one forward."""
    return tuple(model(**inputs.kwargs(), return_dict=False))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Both outputs through the adapter vs stock; 1.0 if block 0's attention saw more than
    ceil(rows / P) rows (or never ran), or if the outputs after ``disable`` are not bit-identical."""
    model, inputs = _build(shape)
    with torch.no_grad():
        ref = _both(model, inputs)
        lengths = []
        hook = model.transformer_blocks[0].attn.register_forward_pre_hook(
            lambda module, args: lengths.append(args[0].shape[1]))
        ADAPTER.enable(model, mesh, "auto")
        try:
            out = _both(model, inputs)
        finally:
            hook.remove()
            ADAPTER.disable(model)
        again = _both(model, inputs)
    ceil = math.ceil((shape.text + shape.video + shape.audio) / mesh.sequence_degree)
    return {
        "video": rel_err(out[0], ref[0]),
        "audio": rel_err(out[1], ref[1]) if shape.audio else float(out[1].numel() != 0),
        "block0_tokens_above_ceil": float(not lengths or max(lengths) > ceil),
        "disable_not_bit_identical": float(not all(torch.equal(a, b) for a, b in zip(again, ref))),
    }


def _grads(model, inputs, divisor: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of a seeded weighted sum of both outputs, divided by ``divisor``."""
    g = torch.Generator().manual_seed(123)
    loss = sum((out * torch.randn(out.shape, generator=g)).sum() for out in _both(model, inputs)) / divisor
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params.items(), grads)}


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    """Each rank's loss is L / P; the gradients summed over the sequence group equal one process's of L."""
    model, inputs = _build(shape)
    if checkpointing:
        model.enable_gradient_checkpointing()
    ref = _grads(model, inputs, 1)
    ADAPTER.enable(model, mesh, "auto")
    try:
        grads = _grads(model, inputs, mesh.sequence_degree)
    finally:
        ADAPTER.disable(model)
    worst = 0.0
    for name, g in grads.items():
        g = g.contiguous()  # gloo reduces contiguous buffers only
        dist.all_reduce(g, group=mesh.seq_group)
        worst = max(worst, rel_err(g, ref[name]))
    return {"grad": worst}


def _shard_weights_case(mesh) -> dict[str, float]:
    """FSDP2 over ``transformer_blocks``: the same outputs as the unsharded grid, bit for bit."""
    model, inputs = _build(SHAPES[0])
    with torch.no_grad():
        ref = _both(model, inputs)
        enable_usp(model, mesh=mesh)
        grid = _both(model, inputs)
        disable_usp(model)
        enable_usp(model, mesh=mesh, shard_weights=True)
        try:
            sharded = _both(model, inputs)
        finally:
            disable_usp(model)
    return {"video": rel_err(sharded[0], ref[0]), "audio": rel_err(sharded[1], ref[1]),
            "video_vs_unsharded_grid": (sharded[0] - grid[0]).abs().max().item(),
            "audio_vs_unsharded_grid": (sharded[1] - grid[1]).abs().max().item()}


def _denoise(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(video latents, audio latents) of a seeded 3-step text-to-video+audio run at 64 x 64."""
    out = pipe(**minimax_h3_text(seed=3), height=64, width=64, num_frames=124, num_inference_steps=3,
               generator=torch.Generator().manual_seed(0),
               output=["latents", "audio_latents"])
    return out["latents"], out["audio_latents"]


PIPELINE_GRIDS = parity.ci_grids(
    {"pipeline-u2r1": (2, 1, 1), "pipeline-u2r2": (2, 2, 1), "pipeline-u1r2cfg2": (1, 2, 2)})


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_minimax_h3_denoise()
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        ref = _denoise(pipe)
        results = {}
        for key, grid in PIPELINE_GRIDS.items():
            pipe.enable_usp(mesh=init_usp(*grid))  # a ModularPipeline (Note [modular pipelines])
            try:
                video, audio = _denoise(pipe)
            finally:
                pipe.disable_usp()
            results[key] = {"video": rel_err(video, ref[0]), "audio": rel_err(audio, ref[1])}
        again = _denoise(pipe)
    results["pipeline-after-disable"] = {"not_bit_identical": float(not all(map(torch.equal, again, ref)))}
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[0], init_usp(2, 2), checkpointing=True))
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_minimax_h3(num_heads=2, head_dim=32), ADAPTER,
                                                          init_usp(4)))
    parity.record(results, "shard-weights-u2r2", lambda: _shard_weights_case(init_usp(2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    # check_groups=False: FSDP2's and DTensor's caches keep the meshes they have seen for the life
    # of the process (as in tests/test_shard_weights.py).
    return parity.spawn_grid(_run_all, WORLD, check_groups=False)


@pytest.mark.parametrize("key", parity.output_keys(SHAPES))
def test_sharded_outputs_match_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


@pytest.mark.parametrize("key", parity.grad_keys(SHAPES) + ["grad-ckpt-p4"])
def test_parameter_gradients_match_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


def test_shard_weights_equals_the_unsharded_grid(grid_results):
    for rank, res in enumerate(grid_results):
        errors = res["shard-weights-u2r2"]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        assert errors["video"] <= TOL and errors["audio"] <= TOL, f"rank {rank}: {errors}"
        assert errors["video_vs_unsharded_grid"] == 0 and errors["audio_vs_unsharded_grid"] == 0, f"rank {rank}: {errors}"


@pytest.mark.parametrize("key", [*PIPELINE_GRIDS, "pipeline-after-disable"])
def test_stock_denoise_blocks_match_one_process(grid_results, key: str):
    for rank, res in enumerate(grid_results):
        errors = res.get(key) or res.get("pipeline", "no result")
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        assert all(v <= (0.0 if key == "pipeline-after-disable" else TOL) for v in errors.values()), f"rank {rank}: {errors}"


# ---- single process ------------------------------------------------------------------------------


def test_attention_mask_is_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model.transformer_blocks[0].attn(torch.randn(1, 5, 48), None, torch.ones(1, 1, 5, 5, dtype=torch.bool))
    finally:
        ADAPTER.disable(model)


def test_a_custom_refiner_processor_is_refused():
    """The text refiner's attention runs locally with its stock processor; another one is refused."""
    model, _ = _build(SHAPES[0])

    class Custom:
        def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
            return hidden_states

    model.token_refiner.refiner_blocks[0].attn.processor = Custom()
    with pytest.raises(NotImplementedError, match="token_refiner.refiner_blocks.0.attn.processor is Custom"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_per_row_vector_of_another_length_is_refused():
    """A per-row vector whose length is not the packed sequence's (its rows would not line up)."""
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    hook = model.transformer_blocks[1].register_forward_pre_hook(
        lambda module, args: (args[0], args[1], args[2][:-1], args[3]), prepend=True)
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="adaln_indices has 20 rows but the packed sequence has 21"):
            _both(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)


# ---- the video example under torchrun ----------------------------------------------------------------


def test_the_video_example_prints_match_on_two_ranks(tmp_path):
    """Ring 2 under torchrun (the grids' parity is the pipeline cases' above; this checks the
    example): its header, its MATCH line, its GIF (124 frames of 96 x 64) and its WAV (stereo,
    16-bit, 32 kHz, 207 audio latents x 800 samples). One run: the job's imports are its cost."""
    from PIL import Image

    from tests.test_examples_cli import ROOT, _env

    runs = {"r2": ("--ring 2 --ulysses 1", "ring=2, ulysses=1")}
    jobs = [f"generate_video --model minimax_h3 {grid} --steps 2 --output {name}.gif" for name, (grid, _) in runs.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "_examples_job.py"), *jobs]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    blocks = re.split(r"(?m)^usp_dit \S+: USPMesh\(dp=1, cfg=1, ", proc.stdout)[1:]
    assert len(blocks) == len(runs), proc.stdout
    for (name, (_, mesh)), block in zip(runs.items(), blocks):
        assert block.startswith(f"{mesh}, device_type='cpu') on 2 ranks, cpu; tiny random MiniMaxH3ModularPipeline, "
                                "124 frames of 64x96 (222 video tokens), 2 steps"), block
        assert f"wrote {name}.gif" in block and f"{name}.wav" in block, block
        assert re.search(r"max\|diff\|/max\|one rank\| = \S+ \(tolerance 1e-04\): MATCH", block), block
        with Image.open(tmp_path / f"{name}.gif") as video:
            assert (video.size, video.n_frames) == ((96, 64), 124)
        with wave.open(str(tmp_path / f"{name}.wav")) as audio:
            assert (audio.getnchannels(), audio.getsampwidth(), audio.getframerate(), audio.getnframes()) == (
                2, 2, 32000, 207 * 800)
