"""HunyuanVideo 1.5 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Models: tiny ``HunyuanVideo15Transformer3DModel``s
(two dual-stream blocks, one token-refiner block; 4 heads x 16 head_dim; every weight perturbed;
``usp_dit.demo.tiny_hunyuan_video15``) in two variants: T2V (all-zero image embeddings, which the
model masks out) and I2V with MeanFlow (image embeddings and a second timestep). Latents give 45
and 27 tokens (none divides 2 or 4), batch 2 with a different prompt and timestep per element, and
per element different valid lengths in each condition stream: element 0's prompt mask has a hole
and it has no glyph (ByT5) tokens at all, element 1 has 4 of each, so the joined stream (image,
glyph, prompt; valid tokens first) has a different valid prefix per element.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs the
stock output, block 0's attention sees at most ceil(tokens / P) video tokens (the stream is
replicated), and after ``disable`` the output is bit-identical. Every parameter's gradient (loss / P
on each rank, summed over the sequence group, equals one process's; the token refiner's key bias,
zero by maths, is measured against its weight's scale) for both variants on 2 ranks, T2V on 4,
and T2V once with gradient checkpointing (2x2). Each rank's rotated Q/K of block 0 equal the same rows
of one process's. Fullgraph compile: each dual-stream block compiled (Diffusers' regional
compilation, ``_repeated_blocks``) on (2,2) equals eager; the whole model cannot be compiled
fullgraph even alone (its forward branches on ``all(image_embeds == 0)`` and indexes the streams
by their masks: data-dependent shapes).

Pipelines: the tiny ``HunyuanVideo15Pipeline`` and ``HunyuanVideo15ImageToVideoPipeline`` (Qwen2.5-VL
and ByT5 text encoders, SigLIP image encoder, the HunyuanVideo 1.5 VAE; 2 steps; the CFG guider:
two transformer calls of batch 1 a step, prompt and negative prompt of different lengths, the prompt
with quoted text, hence glyph tokens, the negative without) through ``pipe.enable_usp()`` on (2,1)
and (2,2), and with ``cfg_degree=2`` on (1,2,2) (the two calls of a step on the two cfg groups at
once: ``steps + 1`` transformer computations per rank instead of ``2 * steps``), equal one process's
((2,1) under --full: Note [pipeline grids in CI]). The parallel VAE decodes (and for I2V encodes)
the VAE split by rows: decode and encode on (2,2) (and (4,1) under --full) equal one process's,
each rank seeing its share of the rows.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the latents the pipeline decodes. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks). The decoded frames and
the VAE cases: 1e-4 (an untrained random VAE's gain, as in tests/test_video_pipelines.py).
Measured (4 gloo ranks, CPU): 3.4e-7 on outputs (schedules forced), 1.6e-6 on the worst gradient,
0 on the rotated Q/K, 2.8e-7 compiled, 1.5e-6 on the pipelines' latents and 1.7e-6 on frames,
6.9e-7 / 3.0e-7 on the VAE's decode / encode.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.models.transformers import transformer_hunyuan_video15

from tests import adapter_parity as parity
from tests import family_checks
from tests.test_pipeline_hunyuan_video import gradient_errors
from usp_dit import enable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_hunyuan_video15 import (
    hunyuan_video15_inputs,
    hunyuan_video15_tokens,
    tiny_hunyuan_video15,
    tiny_hunyuan_video15_pipeline,
    tiny_hunyuan_video15_vae,
)
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import hunyuan_video15
from usp_dit.pipelines.families.hunyuan_video15 import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import full_suite, rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas


@dataclass(frozen=True)
class Shape:
    variant: str  # "t2v" or "i2v-meanflow"
    frames: int  # latent sizes
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("t2v", 3, 3, 5),  # 45 tokens
    Shape("i2v-meanflow", 3, 3, 3),  # 27 tokens
]


# The I2V + MeanFlow variant adds embedders, not attention paths: its gradients on 2 ranks suffice.
GRAD_SHAPES = {2: SHAPES, 4: [SHAPES[0]]}


def _build(shape: Shape, seed: int = 0):
    image = shape.variant != "t2v"
    model = tiny_hunyuan_video15(meanflow=image, seed=seed)
    return model, hunyuan_video15_inputs(model, shape.frames, shape.height, shape.width, image=image)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's video token count vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    tokens = hunyuan_video15_tokens(model, shape.frames, shape.height, shape.width)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with ``enable_gradient_checkpointing()``: block 0's recompute re-shards its saved input."""
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
    """Each rank's rotated video Q/K equal the same rows of one process's (element 0: its stream
    is padded, so the router calls usp_attention once per element)."""
    model, inputs = _build(SHAPES[0])
    num_video = hunyuan_video15_tokens(model, SHAPES[0].frames, SHAPES[0].height, SHAPES[0].width)
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_hunyuan_video15, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t[:1, :num_video], mesh)

    return {"q": rel_err(q, rows(q_ref)), "k": rel_err(k, rows(k_ref))}


def _compiled_blocks_case(mesh) -> dict[str, float]:
    """The enabled model with each dual-stream block ``torch.compile(fullgraph=True)`` (``parity.compile_backend()``: "aot_eager" under --full, Dynamo alone in CI)
    vs the enabled eager model (Diffusers' regional compilation; the routed attention, the rotary
    table's rows and the key mask check all traced)."""
    model, inputs = _build(SHAPES[1])
    enable_usp(model, mesh=mesh)
    ref = parity.forward(model, inputs)
    torch._dynamo.reset()
    for block in model.transformer_blocks:
        block.compile(backend=parity.compile_backend(), fullgraph=True)
    got = parity.forward(model, inputs)
    return {"err": rel_err(got, ref)}


# ---- pipelines ----------------------------------------------------------------------------------------


def _image() -> PIL.Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, size=(30, 30, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)  # square: the pipeline picks 48 x 48 (3 x 3 patches a frame)


def _generate(pipe, image_to_video: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the latents the VAE decodes, frames) of 2 steps, 9 frames, seed 0: T2V at 48 x 80 (45
    tokens), I2V at the image's 48 x 48 (27 tokens)."""
    args = dict(prompt='a red fox and the sign "open"', negative_prompt="blurry", num_frames=9, num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), output_type="pt")
    args.update(image=_image()) if image_to_video else args.update(height=48, width=80)
    return parity.decoded_latents_and(pipe, "frames", **args)


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # (U, R, cfg)
STEPS = 2


@contextlib.contextmanager
def _vae_split_and_computations(pipe, grid: tuple[int, int, int]) -> Iterator[Callable[[], dict[str, float]]]:
    """The ``pipeline_cases`` probe: 1.0 unless the VAE is split, and ``cfg_pair_computations``."""
    from usp_dit.pipelines.vae import is_parallel_vae_enabled

    with parity.cfg_pair_computations(pipe, grid, STEPS) as computations:
        yield lambda: {"vae_not_split": float(not is_parallel_vae_enabled(pipe.vae)), **computations()}


def _pipeline_cases(image_to_video: bool) -> dict[str, dict[str, float]]:
    """A tiny pipeline on each of ``PIPELINE_GRIDS`` through ``pipe.enable_usp``: latents and frames
    vs one process; at cfg 2, ``steps + 1`` computations per rank; after disable, bit-identical."""
    name = "i2v" if image_to_video else "t2v"
    return parity.pipeline_cases(
        tiny_hunyuan_video15_pipeline(image_to_video=image_to_video), lambda p: _generate(p, image_to_video),
        parity.pipeline_grids(PIPELINE_GRIDS, f"pipeline-{name}"), names=("latents", "frames"), check_enabled=False,
        after_disable=f"pipeline-{name}-after-disable", probe=_vae_split_and_computations,
    )


# The VAE splits over all 4 ranks of the replica on either grid (the same rows a rank); (4, 1, 1)
# differs only in which group carries it (the one axis's own), which tests/test_parallel_vae.py
# covers: --full only (~5 s).
VAE_GRIDS = [(2, 2, 1)] + ([(4, 1, 1)] if full_suite() else [])


def _vae_case(grid) -> dict[str, float]:
    """The parallel VAE (``enable_parallel_vae``): decode of a (1, 4, 3, 7, 5) latent and encode of a
    (1, 3, 5, 64, 32) video vs one process; each rank's first convolution sees its share of the rows."""
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae = tiny_hunyuan_video15_vae()
    z = torch.randn(1, 4, 3, 7, 5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(1, 3, 5, 64, 32, generator=torch.Generator().manual_seed(2))
    rows = []
    vae.decoder.conv_in.conv.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[-2]))
    with torch.no_grad():
        ref_dec, ref_enc = vae.decode(z).sample, vae._encode(x)
        state = enable_parallel_vae(vae, init_usp(*grid))
        try:
            rows.clear()
            dec = vae.decode(z).sample
            split_rows = max(rows)
            enc = vae._encode(x)
        finally:
            disable_parallel_vae(vae)
        again = vae.decode(z).sample
    parts = math.prod(grid)
    return {
        "decode": rel_err(dec, ref_dec), "encode": rel_err(enc, ref_enc),
        "not_split": float(state.reasons["decode"] is not None or state.reasons["encode"] is not None),
        # conv_in's input: this rank's latent rows plus the 2 halo / border rows its causal padding adds
        "rows_above_share": float(split_rows > math.ceil(7 / parts) + 2),
        "disable_not_bit_identical": float(not torch.equal(again, ref_dec)),
    }


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: gradient_errors(*_build(shape), ADAPTER, mesh),
                          GRAD_SHAPES)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    two_heads = tiny_hunyuan_video15(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "compiled-blocks", lambda: _compiled_blocks_case(init_usp(2, 2)))
    for grid in VAE_GRIDS:
        parity.record(results, f"vae-u{grid[0]}r{grid[1]}", lambda grid=grid: _vae_case(grid))
    parity.record(results, "pipeline-t2v", lambda: _pipeline_cases(False), many=True)
    parity.record(results, "pipeline-i2v", lambda: _pipeline_cases(True), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    # check_groups=False: the compiled case's torch compile caches (functional collectives' graphs)
    # keep references to the process groups past the job, as in tests/test_compile_grid.py.
    return parity.spawn_grid(_run_all, WORLD, check_groups=False)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(by_world=GRAD_SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


def test_compiled_blocks_fullgraph_equal_eager(grid_results):
    parity.assert_within(grid_results, "compiled-blocks", TOL)


@pytest.mark.parametrize("grid", VAE_GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
def test_parallel_vae_decodes_and_encodes_like_one_process(grid_results, grid):
    for rank, res in enumerate(grid_results):
        errors = res[f"vae-u{grid[0]}r{grid[1]}"]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        errors = dict(errors)
        assert errors.pop("decode") <= TOL_FRAMES and errors.pop("encode") <= TOL_FRAMES, f"rank {rank}"
        assert not any(errors.values()), f"rank {rank}: {errors}"


PIPELINE_KEYS = [f"pipeline-{n}-u{u}r{r}cfg{c}" for n in ("t2v", "i2v") for u, r, c in PIPELINE_GRIDS]


@pytest.mark.parametrize("key", PIPELINE_KEYS)
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, 0.0, {"latents": TOL, "frames": TOL_FRAMES},
                         fallback=f"pipeline-{key.split('-')[1]}")


@pytest.mark.parametrize("name", ["t2v", "i2v"])
def test_disable_usp_gives_back_the_bit_identical_video(grid_results, name: str):
    parity.assert_within(grid_results, f"pipeline-{name}-after-disable", 0.0)


# ---- single process: registration, loud failures ------------------------------------------------


def test_the_vae_is_split_not_decoded_whole():
    from usp_dit.pipelines.vae.recipes import classify, recipes

    vae = tiny_hunyuan_video15_vae()
    for region in (vae.decoder, vae.encoder):
        sites, reason = classify(region, recipes()[type(vae)])
        assert reason is None and sites.convs and sites.rebound and sites.attributes, reason


test_a_foreign_token_refiner_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_hunyuan_video15, ADAPTER, "context_embedder.token_refiner.refiner_blocks.0.attn")


def test_a_mask_over_video_tokens_is_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    attn = model.transformer_blocks[0].attn
    try:
        x, text = torch.randn(2, 5, 64), torch.randn(2, 3, 64)
        attn.processor.route.state.seq_len = 5  # as block 0's hook records it in a forward
        # the stock processor pads the stream mask with valid video keys: a 2-d mask over the joint
        # sequence has more columns than the stream, and then masks video keys
        with pytest.raises(NotImplementedError, match="masks video tokens"):
            attn(x, text, torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]] * 2, dtype=torch.bool), image_rotary_emb=None)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_hunyuan_video15, ADAPTER, hunyuan_video15, "_RoutedProcessor")


def test_a_batch_split_into_text_and_image_halves_is_refused_at_cfg_2():
    """Note [HunyuanVideo 1.5's text-to-video test]: the check runs before the cfg split."""
    model, inputs = _build(SHAPES[0])
    inputs.image_embeds[1] = 1.0  # element 0 text-to-video, element 1 image-to-video
    check = hunyuan_video15.MixedImageCheck(model, mock.Mock(mesh=mock.Mock(cfg_degree=2)))
    with pytest.raises(NotImplementedError, match="text-to-video for the whole batch"):
        check._check(model, (), inputs.kwargs())
    inputs.image_embeds[0] = 1.0
    check._check(model, (), inputs.kwargs())  # one kind: runs
