"""HunyuanImage 2.1 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Models: tiny ``HunyuanImageTransformer2DModel``s
(two dual-stream blocks, one single-stream block, one token-refiner block; 4 heads x 16 head_dim;
every weight perturbed; ``usp_dit.demo.tiny_hunyuan_image``) in three variants: the base model
(Qwen prompt and ByT5 glyph tokens, 2-d latents), the distilled one (guidance embedded, MeanFlow)
and the refiner (5-d latents of one frame, 3-d RoPE, no glyph encoder). Latents of 5 x 7 and 3 x 5
patches (35 and 15 tokens: neither divides 2 or 4), batch 2 with a different prompt and timestep
per element and different valid lengths: element 0's prompt mask has a hole and it has no glyph
tokens, element 1 has 4 of each, so the joined text (valid glyph, valid prompt, padding) differs
per element.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced (the base model; the
refiner with the mesh's schedule). Each case: output vs the stock output, block 0's attention sees
at most ceil(tokens / P) image tokens (the text is replicated), and after ``disable`` the output
is bit-identical. Every parameter's gradient (loss / P on each rank, summed over the sequence
group, equals one process's; the token refiner's key bias, zero by maths, is measured against its
weight's scale) for the three variants on 2 ranks, the base on 4. No gradient-checkpointing case:
in Diffusers 0.42.1 the stock forward passes keyword arguments to ``_gradient_checkpointing_func``,
which raises TypeError on one process. Each rank's rotated Q/K of block 0 equal the same rows of
one process's. Fullgraph compile: each dual-stream block compiled (Diffusers' regional
compilation, ``_repeated_blocks``) on (2,2) equals eager (the whole model indexes its text by the
masks when it joins the glyph tokens: a data-dependent shape).

Pipelines: the tiny ``HunyuanImagePipeline`` and ``HunyuanImageRefinerPipeline`` (Qwen2.5-VL and
ByT5 text encoders, their VAEs; 2 steps; the ``AdaptiveProjectedMixGuidance`` guider: two
transformer calls of batch 1 a step, prompt and negative prompt of different lengths, the prompt
with quoted text, hence glyph tokens, the negative without) through ``pipe.enable_usp()`` on (2,1)
and (2,2), and with ``cfg_degree=2`` on (1,2,2) (the two calls of a step on the two cfg groups at
once: ``steps + 1`` transformer computations per rank instead of ``2 * steps``), equal one process's.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the latents the pipelines decode. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks). Decoded images: 1e-4 (an
untrained random VAE's gain, as in tests/test_video_pipelines.py).
"""
from __future__ import annotations

import functools
from unittest import mock

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.models.transformers import transformer_hunyuanimage

from tests import adapter_parity as parity
from tests import family_checks
from tests.test_pipeline_hunyuan_video import gradient_errors
from usp_dit import enable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_hunyuan_image import (
    hunyuan_image_inputs,
    hunyuan_image_tokens,
    tiny_hunyuan_image,
    tiny_hunyuan_image_pipeline,
)
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import hunyuan_image
from usp_dit.pipelines.families.hunyuan_image import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas

SHAPES = [("base", 5, 7), ("refiner", 3, 5)]  # (variant, latent height, width): 35 and 15 tokens
SHAPE_IDS = [f"{v}-h{h}w{w}" for v, h, w in SHAPES]
DISTILLED = ("distilled", 3, 5)
# The distilled variant adds embedders, not attention paths: its gradients on 2 ranks suffice.
GRAD_SHAPES = {2: SHAPE_IDS + ["distilled-h3w5"], 4: SHAPE_IDS[:1]}


def _fits(shape_id: str, grid: tuple) -> bool:
    """The refiner differs from the base in its latents' rank and RoPE axes, not in attention: it
    runs on the grids with the mesh's own ring schedule (the base runs with each forced too)."""
    return shape_id.startswith("base") or grid[3] is None


def _build(shape_id: str, seed: int = 0):
    variant, hw = shape_id.split("-h")
    height, width = (int(n) for n in hw.split("w"))
    model = tiny_hunyuan_image(variant, seed=seed)
    return model, hunyuan_image_inputs(model, height, width), hunyuan_image_tokens(height, width)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape_id: str, mesh) -> dict[str, float]:
    """Output vs stock, block 0's image token count vs ceil(S / P), bit-identity after disable."""
    model, inputs, tokens = _build(shape_id)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, tokens)


def _gradient_case(shape_id: str, mesh) -> dict[str, float]:
    model, inputs, _ = _build(shape_id)
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
    """Each rank's rotated image Q/K equal the same rows of one process's (element 0: its text is
    padded, so the router calls usp_attention once per element)."""
    model, inputs, tokens = _build(SHAPE_IDS[0])
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_hunyuanimage, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t[:1, :tokens], mesh)

    return {"q": rel_err(q, rows(q_ref)), "k": rel_err(k, rows(k_ref))}


def _compiled_blocks_case(mesh) -> dict[str, float]:
    """The enabled model with each dual-stream block ``torch.compile(fullgraph=True)`` (``parity.compile_backend()``: "aot_eager" under --full, Dynamo alone in CI)
    vs the enabled eager model (the routed attention, the RoPE table's rows and the key mask traced)."""
    model, inputs, _ = _build(SHAPE_IDS[1])
    enable_usp(model, mesh=mesh)
    ref = parity.forward(model, inputs)
    torch._dynamo.reset()
    for block in model.transformer_blocks:
        block.compile(backend=parity.compile_backend(), fullgraph=True)
    got = parity.forward(model, inputs)
    return {"err": rel_err(got, ref)}


# ---- pipelines ----------------------------------------------------------------------------------------


def _generate(pipe, refiner: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the latents the VAE decodes, images) of 2 steps, seed 0: the base at 40 x 56 (5 x 7 = 35
    tokens), the refiner at 48 x 80 (3 x 5 = 15 tokens) from a random image."""
    args = dict(prompt='a red fox and the sign "open"', negative_prompt="blurry", num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), output_type="pt")
    if refiner:
        pixels = np.random.default_rng(0).integers(0, 256, size=(48, 80, 3), dtype=np.uint8)
        args.update(image=PIL.Image.fromarray(pixels), height=48, width=80)
    else:
        args.update(height=40, width=56)
    return parity.decoded_latents_and(pipe, **args)


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # (U, R, cfg)
STEPS = 2


def _pipeline_cases(refiner: bool) -> dict[str, dict[str, float]]:
    """A tiny pipeline on each of ``PIPELINE_GRIDS`` through ``pipe.enable_usp``: latents and images
    vs one process; at cfg 2, ``steps + 1`` computations per rank; after disable, bit-identical."""
    name = "refiner" if refiner else "base"
    return parity.pipeline_cases(
        tiny_hunyuan_image_pipeline(refiner=refiner), lambda p: _generate(p, refiner),
        parity.pipeline_grids(PIPELINE_GRIDS, f"pipeline-{name}"), check_enabled=False,
        after_disable=f"pipeline-{name}-after-disable",
        probe=functools.partial(parity.cfg_pair_computations, steps=STEPS),
    )


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPE_IDS, _output_case, _gradient_case, GRAD_SHAPES, _fits)
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    two_heads = tiny_hunyuan_image(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "compiled-blocks", lambda: _compiled_blocks_case(init_usp(2, 2)))
    parity.record(results, "pipeline-base", lambda: _pipeline_cases(False), many=True)
    parity.record(results, "pipeline-refiner", lambda: _pipeline_cases(True), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    # check_groups=False: the compiled case's torch compile caches (functional collectives' graphs)
    # keep references to the process groups past the job, as in tests/test_compile_grid.py.
    return parity.spawn_grid(_run_all, WORLD, check_groups=False)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPE_IDS, _fits), parity.grad_keys(by_world=GRAD_SHAPES), TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


def test_compiled_blocks_fullgraph_equal_eager(grid_results):
    parity.assert_within(grid_results, "compiled-blocks", TOL)


PIPELINE_KEYS = [f"pipeline-{n}-u{u}r{r}cfg{c}" for n in ("base", "refiner") for u, r, c in PIPELINE_GRIDS]


@pytest.mark.parametrize("key", PIPELINE_KEYS)
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, 0.0, {"latents": TOL, "images": TOL_IMAGES},
                         fallback=f"pipeline-{key.split('-')[1]}")


@pytest.mark.parametrize("name", ["base", "refiner"])
def test_disable_usp_gives_back_the_bit_identical_image(grid_results, name: str):
    parity.assert_within(grid_results, f"pipeline-{name}-after-disable", 0.0)


# ---- single process: registration, loud failures ------------------------------------------------


test_a_foreign_token_refiner_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_hunyuan_image, ADAPTER, "context_embedder.token_refiner.refiner_blocks.0.attn")


def test_a_mask_over_image_tokens_is_refused():
    model = tiny_hunyuan_image()
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    attn = model.transformer_blocks[0].attn
    try:
        x, text = torch.randn(2, 5, 64), torch.randn(2, 3, 64)
        attn.processor.route.state.seq_len = 5  # as block 0's hook records it in a forward
        mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
        mask[:, :, :, 0] = False  # the first image key
        with pytest.raises(NotImplementedError, match="masks video tokens"):
            attn(x, text, mask, image_rotary_emb=None)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_hunyuan_image, ADAPTER, hunyuan_image, "_RoutedProcessor")


def test_a_model_without_dual_stream_blocks_is_refused():
    model = tiny_hunyuan_image()
    model.transformer_blocks = torch.nn.ModuleList()
    with pytest.raises(NotImplementedError, match="num_layers=0"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")
