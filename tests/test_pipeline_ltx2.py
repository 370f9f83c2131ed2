"""LTX-2 adapter: sharded transformer outputs (video and audio) and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Models: tiny 2-layer
``LTX2VideoTransformer3DModel``s (video 4 heads x 16, audio 4 x 8, every weight perturbed;
``usp_dit.demo.tiny_ltx2``) in three variants and call styles: LTX-2.0 with interleaved RoPE as
``LTX2Pipeline`` calls it (one timestep per element, RoPE grids built by the model); LTX-2.0 with
split RoPE as the image-to-video pipeline calls it (one random timestep per video token, the first
latent frame at 0, ``video_coords`` with element 1 shifted in time, the cross-modal timestep);
LTX-2.3-like (gated attention, prompt modulation, perturbed attention) in a spatio-temporal
guidance call (block 1 perturbed for element 1 only). Video tokens 45, 63 and 27, audio tokens 7,
9 and 5 (none divides 2 or 4); batch 2 with a different prompt, timestep and padded prompt mask
per element, and audio prompt masks unlike the video ones.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: the video
and the audio outputs vs the stock outputs, block 0's video self-attention sees at most
ceil(S_v / P) tokens, and after ``disable`` both outputs are bit-identical. Every parameter's
gradient of a loss over both outputs (loss / P on each rank, summed over the sequence group,
equals one process's: the replicated audio stream and the video-to-audio merge's backward,
Note [v2a] in usp_dit.pipelines.families.ltx2): every variant on 2 ranks, the first two on 4, and
once with gradient checkpointing. Each rank's rotated Q/K of block 0's self-attention equal the
same rows of one process's (split RoPE, per-token modulation). The tiny ``LTX2Pipeline`` (Gemma 3
encoder, text connectors, LTX-2 video VAE, audio VAE and vocoder; LTX-2.3-like transformer; 2 steps;
classifier-free guidance batched in one call of batch 2, spatio-temporal and modality-isolation
guidance in two more calls of batch 1) through ``pipe.enable_usp()`` on (2,1) and (2,2), and with
``cfg_degree=2`` on (2,1,2) with only classifier-free guidance (the batch-1 calls are refused
there, also tested) equals one process's: final video latents, decoded frames and waveform.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the pipeline's final latents. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks). The decoded frames and
the waveform: 1e-4 (an untrained random VAE and vocoder amplify the latents' rounding, as in
tests/test_video_pipelines.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_ltx2

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_ltx2 import ltx2_inputs, tiny_ltx2, tiny_ltx2_pipeline
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import ltx2
from usp_dit.pipelines.families.ltx2 import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_DECODED = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str  # tiny_ltx2.VARIANTS
    call: str  # "t2v", "i2v", "stg" (tiny_ltx2.ltx2_inputs)
    frames: int  # latent sizes (= video token grid: patch 1)
    height: int
    width: int
    audio: int  # audio tokens

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width

    def __str__(self) -> str:
        return f"{self.variant}-{self.call}-f{self.frames}h{self.height}w{self.width}a{self.audio}"


SHAPES = [
    Shape("2.0", "t2v", 3, 3, 5, 7),  # 45 video tokens
    Shape("2.0-split", "i2v", 3, 3, 7, 9),  # 63, one timestep each
    Shape("2.3", "stg", 3, 3, 3, 5),  # 27
]
GRAD_SHAPES = {2: SHAPES, 4: SHAPES[:2]}


def _build(shape: Shape, seed: int = 0):
    model = tiny_ltx2(shape.variant, seed=seed)
    return model, ltx2_inputs(model, shape.frames, shape.height, shape.width, shape.audio, call=shape.call)


def _both(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model(**inputs.kwargs(), return_dict=False)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Video and audio vs stock, block 0's self-attention length vs ceil(S_v / P), bit-identity after disable."""
    model, inputs = _build(shape)
    ref = _both(model, inputs)
    lengths = []

    def seen(module, args, kwargs):
        lengths.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1])

    ADAPTER.enable(model, mesh, "auto")
    hook = model.transformer_blocks[0].attn1.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        video, audio = _both(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)
    again = _both(model, inputs)
    return {
        "video": rel_err(video, ref[0]), "audio": rel_err(audio, ref[1]),
        "block0_tokens_above_ceil": float(not lengths or max(lengths) > math.ceil(shape.tokens / mesh.sequence_degree)),
        "disable_not_bit_identical": float(not (torch.equal(again[0], ref[0]) and torch.equal(again[1], ref[1]))),
    }


def _param_grads(model, inputs, divisor: int) -> dict[str, torch.Tensor]:
    """Gradients of a random weighting of both outputs, / ``divisor``."""
    video, audio = model(**inputs.kwargs(), return_dict=False)
    g = torch.Generator().manual_seed(123)
    loss = ((video * torch.randn(video.shape, generator=g)).sum() + (audio * torch.randn(audio.shape, generator=g)).sum())
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss / divisor, list(params.values()), allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params.items(), grads)}


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    """Every parameter's gradient summed over the sequence group vs one process's (the worst one)."""
    import torch.distributed as dist

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


def _first_attention_call(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated (q, k) block 0's self-attention hands ``module.name`` (a forward's first attention call)."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        _both(model, inputs)
    return seen[0]


def _rotated_qk_case(shape: Shape, mesh) -> dict[str, float]:
    """Each rank's rotated Q/K equal the same rows of one process's (the stock dispatch call vs the
    usp_attention call it is routed to)."""
    model, inputs = _build(shape)
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_ltx2, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


CFG_ONLY = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0}


def _generate(pipe, **guidance) -> dict[str, torch.Tensor]:
    """Final video latents, frames and waveform of 2 steps at 96 x 160 x 17 frames (45 video, 18
    audio tokens), seed 0, [negative; positive] prompts of different padded lengths batched."""
    last = {}

    def keep_latents(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return {}

    out = pipe(
        prompt="a red fox", negative_prompt="blurry", height=96, width=160, num_frames=17, num_inference_steps=2,
        max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="pt",
        spatio_temporal_guidance_blocks=[1], callback_on_step_end=keep_latents, **guidance,
    )
    return {"latents": last["latents"], "frames": out.frames, "audio": out.audio}


# (U, R, cfg); cfg 2 with classifier-free guidance only
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (2, 1, 2)])


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_ltx2_pipeline(variant="2.3")
    pipe.set_progress_bar_config(disable=True)
    refs = {False: _generate(pipe), True: _generate(pipe, **CFG_ONLY)}
    results = {}
    for u, r, c in PIPELINE_GRIDS:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        try:
            got = _generate(pipe, **(CFG_ONLY if c > 1 else {}))
            if c > 1:
                try:
                    _generate(pipe)
                    results["pipeline-cfg2-batch1-refused"] = {"did_not_raise": 1.0}
                except NotImplementedError as exc:
                    results["pipeline-cfg2-batch1-refused"] = {"wrong_error": float("the batch is 1" not in str(exc))}
        finally:
            pipe.disable_usp()
        ref = refs[c > 1]
        results[f"pipeline-u{u}r{r}cfg{c}"] = {k: rel_err(got[k], ref[k]) for k in ref}
    again = _generate(pipe)
    same = all(torch.equal(again[k], refs[False][k]) for k in again)
    results["pipeline-after-disable"] = {"not_bit_identical": float(not same)}
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case, GRAD_SHAPES)
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[1], init_usp(2, 2), checkpointing=True))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(SHAPES[1], init_usp(2, 2)))
    two_heads = tiny_ltx2(num_heads=2, head_dim=32, audio_head_dim=16)
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


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    """Sequence parallel on (2,1) and (2,2); cfg parallel on (2,1,2): LTX2Pipeline batches its guidance."""
    parity.assert_within(grid_results, key, TOL_DECODED, {"latents": TOL}, fallback="pipeline")


def test_cfg_parallel_refuses_the_guidance_calls_of_batch_one(grid_results):
    parity.assert_within(grid_results, "pipeline-cfg2-batch1-refused", 0.0)


def test_disable_usp_gives_back_the_bit_identical_video_and_audio(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: loud failures --------------------------------------------------------------


def test_video_self_attention_mask_is_refused():
    """IC-LoRA's (B, S_v, S_v) mask over video tokens: refused at the call."""
    model, inputs = _build(SHAPES[0])
    mask = torch.ones(2, SHAPES[0].tokens, SHAPES[0].tokens)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="video_self_attention_mask"):
            model(**inputs.kwargs(), video_self_attention_mask=mask)
    finally:
        ADAPTER.disable(model)


def test_timestep_of_wrong_length_is_refused():
    model, inputs = _build(SHAPES[1])
    inputs.timestep = inputs.timestep[:, :-1]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="124 entries for a batch of 2 and 63 video tokens"):
            _both(model, inputs)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_ltx2, ADAPTER, ltx2.USPLTX2VideoToAudioProcessor, "_plain",
    match="do not call dispatch_attention_fn, the call usp_dit routes")
test_a_custom_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_ltx2, ADAPTER, "transformer_blocks.1.video_to_audio_attn", torch.nn.Identity)
