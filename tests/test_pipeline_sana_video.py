"""Sana-Video adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``SanaVideoTransformer3DModel`` s (4 heads x 16 of
linear self-attention with RoPE, 2 x 32 of cross-attention, every weight perturbed;
``usp_dit.demo.tiny_sana_video``) in two variants: "t2v" (RMS QK norm across heads, timestep only)
on a 3 x 3 x 5 token grid (frames x height x width), and "guided" (no QK norm, embedded guidance)
on 5 x 3 x 1, where a rank's tokens span two frames and its spatial conv's window has zero rows
between frames. Neither 45 nor 15 divides 2 or 4. Batch 2 with a different latent, prompt,
timestep (and guidance) per element; 6 text tokens with masks of different valid lengths per
element (3 and 6; 2 and 5). RoPE positions come from the grid (random latents, every frame and row
at its own position).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced (there is no ring: the
linear attention's summaries are all-reduced over the sequence group, the schedules must not
matter). Each case: output vs stock, block 0's self-attention sees at most ceil(tokens / P) tokens,
after ``disable`` the output is bit-identical. Per variant, on 2 and on 4 ranks: every parameter's
gradient (against the exact maths: below), and once with gradient checkpointing. Each rank's
Mix-FFN spatial and temporal conv outputs equal the same tokens of one process's (the halo
exchanges alone). The transformer enabled with cfg_degree=2 on a batch of 2 (the mask split too)
equals stock; ``SanaImageToVideoPipeline``'s per-token timestep (0 on the conditioning frame) on
(1,4,1) equals stock; a grid with fewer tokens than ranks raises on every rank. (The
fullgraph-compiled grid is tests/test_compile_grid.py's "sana_video" case, on (2,2,1).)
The tiny ``SanaVideoPipeline`` (Gemma-2, Wan VAE; two prompts of different lengths, batched CFG
[uncond, cond] in one call) through ``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2) (the cfg
split of the batched halves), 2 steps, equal to one process's; after ``disable_usp`` bit-identical;
``SanaImageToVideoPipeline`` (the same components, a per-token timestep) on (2,2,1), its latents.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, conv outputs and the pipeline's
final latents: sharding only reorders float32 sums (each rank's part of the two summaries, then
their all-reduced sum); the convs' products are the same. Gradients are measured against the exact
maths (the model in float64, its linear attention in float64 too: ``_Float64LinearAttention``), each
parameter's error allowed max(1e-5, 2 x the error of the stock float32 model there) -- the rule of
tests/test_pipeline_sana.py, for the same reason: the division by the summed keys amplifies float32
rounding in the stock gradient itself. Decoded videos: 1e-4 (an untrained random VAE's gain, as in
tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_sana_video import sana_video_inputs, tiny_sana_video, tiny_sana_video_pipeline
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines._grid_conv import GridShards, own_tokens, window_rows
from usp_dit.pipelines.families.sana_video import ADAPTER, _rotated
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_VIDEO = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    frames: int  # token grid
    height: int
    width: int
    prompt_lengths: tuple[int, int]

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width

    def __str__(self) -> str:
        return f"{self.variant}-{self.frames}x{self.height}x{self.width}"


SHAPES = [Shape("t2v", 3, 3, 5, (3, 6)), Shape("guided", 5, 3, 1, (2, 5))]


def _build(shape: Shape, seed: int = 0):
    model = tiny_sana_video(shape.variant, seed=seed)
    return model, sana_video_inputs(model, shape.frames, shape.height, shape.width, list(shape.prompt_lengths))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.tokens)


class _Float64LinearAttention:
    """Diffusers' ``SanaLinearAttnProcessor3_0`` maths without its float32 upcast: the exact
    reference in a float64 model."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        q, k = (torch.relu(t.unflatten(2, (attn.heads, -1))) for t in (q, k))  # (B, S, H, D)
        qr, kr = (_rotated(t, *rotary_emb).permute(0, 2, 3, 1) for t in (q, k))  # (B, H, D, S)
        q, k, v = (t.permute(0, 2, 3, 1) for t in (q, k, v.unflatten(2, (attn.heads, -1))))
        z = 1 / (k.sum(-1, keepdim=True).transpose(-2, -1) @ q + 1e-15)
        h = ((v @ kr.transpose(-1, -2)) @ qr * z).flatten(1, 2).transpose(1, 2)
        return attn.to_out[1](attn.to_out[0](h))


@functools.cache  # per shape: the 2- and 4-rank cases share the references
def _reference_grads(shape: Shape) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(exact gradients, the stock float32 model's gradients) of one process."""
    model, inputs = _build(shape)
    model.double()
    for block in model.transformer_blocks:
        block.attn1.processor = _Float64LinearAttention()
    for name, value in inputs.__dict__.items():
        if torch.is_tensor(value) and value.is_floating_point():
            setattr(inputs, name, value.double())
    exact = parity._param_grads(model, inputs, 1)
    model, inputs = _build(shape)
    return exact, parity._param_grads(model, inputs, 1)


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    """Every parameter's gradient, summed over the sequence group (each rank's loss L / P), against
    the exact one: its error over max(TOL, 2 x the stock float32 model's error there) (at most 1)."""
    exact, stock = _reference_grads(shape)
    model, inputs = _build(shape)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return parity.allowance_gradient_errors(model, inputs, ADAPTER, mesh, exact, stock, TOL)


def _conv_outputs(model, inputs) -> dict[str, list[torch.Tensor]]:
    """Every block's ``ff.conv_depth`` and ``ff.conv_temp`` outputs, each as (B, C, tokens) in token order."""
    seen = {"conv_depth": [], "conv_temp": []}

    def keep(name, frames_first):
        def hook(module, args, out):
            if frames_first:  # conv_depth: (B * F, C, H, W) one process, (B, C, 1, S_local) sharded
                b = seen["batch"]
                out = out.unflatten(0, (b, -1)).transpose(1, 2) if out.shape[0] != b else out
            seen[name].append(out.flatten(2))
        return hook

    seen["batch"] = inputs.hidden_states.shape[0]
    hooks = [h for b in model.transformer_blocks
             for h in (b.ff.conv_depth.register_forward_hook(keep("conv_depth", True)),
                       b.ff.conv_temp.register_forward_hook(keep("conv_temp", False)))]
    try:
        parity.forward(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _conv_case(mesh) -> dict[str, float]:
    """Each rank's spatial and temporal conv outputs equal the same tokens of one process's (5 x 3 x 1 on 4)."""
    shape = SHAPES[1]
    model, inputs = _build(shape)
    refs = _conv_outputs(model, inputs)
    ADAPTER.enable(model, mesh, "auto")
    try:
        outs = _conv_outputs(model, inputs)  # the hooks registered after ours see this rank's tokens
    finally:
        ADAPTER.disable(model)
    a, b = GridShards(shape.tokens, 1, mesh.sequence_degree, 1).span(mesh.seq_rank)
    return {f"{name}{i}": rel_err(o, r[..., a:b]) for name in ("conv_depth", "conv_temp")
            for i, (o, r) in enumerate(zip(outs[name], refs[name]))}


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2: its batch of 2 (masks of 3 and 6 tokens) split."""
    return parity.cfg_split_case(*_build(SHAPES[0]), mesh)


def _too_few_tokens_case(mesh) -> dict[str, float]:
    """A 1 x 1 x 3 grid on 4 sequence ranks: NotImplementedError on every rank, naming the grid."""
    model = tiny_sana_video()
    inputs = sana_video_inputs(model, 1, 1, 3, [2, 6])
    ADAPTER.enable(model, mesh, "auto")
    try:
        parity.forward(model, inputs)
    except NotImplementedError as exc:
        return {"wrong_error": float("1 x 1 x 3 token grid on 4 sequence ranks" not in str(exc))}
    finally:
        ADAPTER.disable(model)
    return {"did_not_raise": 1.0}


def _per_token_timestep_case(mesh) -> dict[str, float]:
    """``SanaImageToVideoPipeline``'s timestep: one per token (B, 1, F, H, W), 0 on the first
    (conditioning) frame, the rest differing per element; cut like the tokens by the time hook."""
    shape = SHAPES[0]
    model, inputs = _build(shape)
    first = torch.zeros(1, 1, shape.frames, shape.height, shape.width)
    first[:, :, 0] = 1.0
    inputs.timestep = inputs.timestep[:, None, None, None, None] * (1 - first)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.tokens)


PROMPTS = (["a red fox jumps", "a cat"], ["blurry", "dark and dim"])  # of different lengths: padded, masked


def _generate(pipe, output_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, video) of 2 steps at 32 x 96 x 9 frames (3 x 2 x 6 = 36 tokens), batched CFG, seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(
        pipe, "frames",
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.5, height=32, width=96, frames=9,
        num_inference_steps=2, max_sequence_length=16, complex_human_instruction=None,
        use_resolution_binning=False, generator=torch.Generator().manual_seed(0), output_type=output_type,
    )


# Decoding the video is the slow part on CPU: decoded on one grid, the other grids compare latents.
PIPELINE_GRIDS = [(2, 1, 1, "pt"), (2, 2, 1, "latent"), (1, 2, 2, "latent")]  # the last splits [uncond, cond]


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_sana_video_pipeline()
    pipe.set_progress_bar_config(disable=True)
    ref_latents, ref_video = _generate(pipe, "pt")
    results = {}
    for u, r, c, output_type in PIPELINE_GRIDS:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe.transformer)
        try:
            latents, video = _generate(pipe, output_type)
        finally:
            pipe.disable_usp()
        errors = {"not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe.transformer)),
                  "latents": rel_err(latents, ref_latents)}
        if output_type == "pt":
            errors["video"] = rel_err(video, ref_video)
        results[f"pipeline-u{u}r{r}cfg{c}"] = errors
    again_latents, _ = _generate(pipe, "latent")
    results["pipeline-after-disable"] = {"not_bit_identical": float(not torch.equal(again_latents, ref_latents))}
    results["pipeline-i2v-u2r2cfg1"] = _image_to_video_case(pipe)
    return results


def _image_to_video_case(t2v) -> dict[str, float]:
    """``SanaImageToVideoPipeline`` of the same components (a gradient image as the first frame:
    the per-token timestep, 0 on it), batched CFG, 2 steps, on (2,2,1): final latents equal."""
    from diffusers import SanaImageToVideoPipeline

    from usp_dit.demo.tiny_video import gradient_image

    pipe = SanaImageToVideoPipeline(**t2v.components)
    pipe.set_progress_bar_config(disable=True)

    def latents() -> torch.Tensor:
        last = {}

        def keep(pipe, step, timestep, tensors):
            last["latents"] = tensors["latents"]
            return {}

        pipe(image=gradient_image(32, 96), prompt=PROMPTS[0][:1], negative_prompt=PROMPTS[1][:1], guidance_scale=4.5,
             height=32, width=96, frames=9, num_inference_steps=2, max_sequence_length=16,
             complex_human_instruction=None, use_resolution_binning=False, generator=torch.Generator().manual_seed(0),
             output_type="latent", callback_on_step_end=keep)
        return last["latents"]

    ref = latents()
    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    try:
        return {"latents": rel_err(latents(), ref)}
    finally:
        pipe.disable_usp()


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    # Checkpointing: block 0's recompute re-shards, every block's sets its grids and fetches its halos again.
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[1], init_usp(2, 2), checkpointing=True))
    parity.record(results, "conv-halo", lambda: _conv_case(init_usp(1, 4)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    parity.record(results, "too-few-tokens", lambda: _too_few_tokens_case(init_usp(2, 2)))
    parity.record(results, "per-token-timestep", lambda: _per_token_timestep_case(init_usp(1, 4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
    grad_tol=1.0,  # each parameter's error over its allowance (module docstring)
)


def test_mix_ffn_convs_equal_the_same_tokens_of_one_process(grid_results):
    parity.assert_within(grid_results, "conv-halo", TOL)


def test_cfg_split_of_a_masked_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_a_grid_with_fewer_tokens_than_ranks_is_refused_on_every_rank(grid_results):
    parity.assert_within(grid_results, "too-few-tokens", 0.0)


def test_per_token_timestep_of_image_to_video_matches_one_process(grid_results):
    parity.assert_within(grid_results, "per-token-timestep", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c, _ in PIPELINE_GRIDS] + ["pipeline-i2v-u2r2cfg1"])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"video": TOL_VIDEO}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_latents(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: the window arithmetic, restore exactly, loud failures ------------------------


@pytest.mark.parametrize("frames,height,width,parts", [(3, 3, 5, 4), (5, 3, 1, 4), (2, 1, 7, 3), (4, 2, 3, 4)])
def test_per_frame_and_temporal_windows_give_one_process_convs(frames, height, width, parts):
    """``_grid_conv`` with ``frame_rows`` (Note [a per-frame conv over sharded video tokens]) and a
    (3, 1) conv along time: each rank's window, built from the full tokens, convolved and cut to its
    tokens, equals one process's per-frame / temporal conv there (bit for bit: same products)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, frames * height * width)
    spatial = torch.nn.Conv2d(3, 3, 3, 1, 1, groups=3)
    per_frame = x.unflatten(-1, (frames, height, width)).transpose(1, 2).flatten(0, 1)  # (B * F, C, H, W)
    ref_spatial = spatial(per_frame).unflatten(0, (2, frames)).transpose(1, 2).flatten(2)
    temporal = torch.nn.Conv2d(3, 3, (3, 1), 1, (1, 0))
    ref_temporal = temporal(x.unflatten(-1, (frames, height * width))).flatten(2)
    for conv, ref, grid in ((spatial, ref_spatial, GridShards(frames * height, width, parts, 1, frame_rows=height)),
                            (temporal, ref_temporal, GridShards(frames, height * width, parts, 1))):
        for rank in range(parts):
            lo, hi = grid.window(rank)
            a, b = grid.span(rank)
            got = own_tokens(conv(window_rows(x[..., lo:hi], grid, rank)), grid, rank)
            assert torch.allclose(got, ref[..., a:b], rtol=0, atol=1e-6), (grid, rank)


def test_frame_rows_must_divide_the_height():
    with pytest.raises(ValueError, match="frame_rows=2 does not divide height=5"):
        GridShards(5, 3, 2, 1, frame_rows=2)


test_one_rank_is_bit_identical_to_stock = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[0]), ADAPTER)


def test_controlnet_residuals_are_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="controlnet_block_samples"):
            model(**inputs.kwargs(), controlnet_block_samples=(torch.zeros(2, 45, 64),))
    finally:
        ADAPTER.disable(model)


def test_a_conv_the_halo_is_not_sized_for_is_refused():
    model = tiny_sana_video()
    conv = model.transformer_blocks[1].ff.conv_temp
    model.transformer_blocks[1].ff.conv_temp = torch.nn.Conv2d(conv.in_channels, conv.out_channels, (5, 1), 1, (2, 0))
    with pytest.raises(NotImplementedError, match=r"transformer_blocks.1.ff.conv_temp has .*\(5, 1\)"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_a_custom_processor_is_refused():
    class Custom:
        def __call__(self, attn, hidden_states, **kwargs):
            return hidden_states

    model = tiny_sana_video()
    model.transformer_blocks[0].attn1.processor = Custom()
    with pytest.raises(NotImplementedError, match="Custom"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")
