"""Krea 2 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Model: a tiny ``Krea2Transformer2DModel``
(two blocks, one layer-wise and one refiner text-fusion block; 4 query heads and 2 K/V heads x 16
head_dim; every weight perturbed, the zero-centred RMS scales and modulation tables too;
``usp_dit.demo.tiny_krea2``). Latents of 5 x 7 patches (35 image tokens) with a prompt mask, and
3 x 5 (15) without one: neither count divides 2 or 4. Batch 2 with a different prompt and timestep
per element; the masks have holes in the middle (the pipeline's ``[prompt | padding | suffix]``)
and different valid lengths (7 and 5 of 9); real (0, h, w) positions.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced (the masked shape; the
unmasked one with the mesh's schedule). Each case: output vs the stock output, block 0's attention
sees at most T + ceil(N / P) tokens (the text is replicated: Note [Krea 2's split]), and after
``disable`` the output is bit-identical. Every parameter's gradient (loss / P on each rank, summed
over the sequence group, equals one process's) on 2 ranks (both shapes) and 4 (masked), and with
gradient checkpointing (2x2). Each rank's rotated image Q/K of block 0 equal the same rows of one
process's. Fullgraph compile: the whole enabled model in one graph on (2,2) equals eager.

Pipeline: the tiny ``Krea2Pipeline`` (Qwen3-VL text encoder, Qwen-Image VAE; 2 steps; true CFG:
two transformer calls a step, prompt and negative prompt of different lengths, each padded in the
middle) through ``pipe.enable_usp()`` on (2,1) and (2,2), and with ``cfg_degree=2`` on (1,2,2)
(the two calls of a step on the two cfg groups at once: ``steps + 1`` transformer computations per
rank instead of ``2 * steps``), equal one process's; after ``disable_usp`` bit-identical.

Tolerance: max|err| / max|ref| <= 1e-5 (float32, the issue's bar) on outputs, every parameter's
gradient, the rotated Q/K and the latents the pipeline decodes. Sharding only reorders float32 sums
(attention in blocks merged by log-sum-exp, gradients summed over ranks). Decoded images: 1e-4 (an
untrained random VAE's gain, as in tests/test_video_pipelines.py).
"""
from __future__ import annotations

import functools
import math
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_krea2

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_krea2 import krea2_inputs, tiny_krea2, tiny_krea2_pipeline
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import krea2
from usp_dit.pipelines.families.krea2 import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4  # one spawned group; the 2-rank grids run on it as two data-parallel replicas
TEXT_LEN = 9

SHAPES = ["mask-h5w7", "nomask-h3w5"]
GRAD_SHAPES = {2: SHAPES, 4: SHAPES[:1]}


def _fits(shape: str, grid: tuple) -> bool:
    """The unmasked shape runs on the grids with the mesh's own ring schedule."""
    return shape.startswith("mask") or grid[3] is None


def _build(shape: str, seed: int = 0):
    kind, hw = shape.split("-h")
    height, width = (int(n) for n in hw.split("w"))
    model = tiny_krea2(seed=seed)
    valid = krea2_inputs.__defaults__[0] if kind == "mask" else None
    return model, krea2_inputs(model, height, width, valid=valid, text_len=TEXT_LEN), height * width


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: str, mesh) -> dict[str, float]:
    """Output vs stock, block 0's token count vs T + ceil(N / P), bit-identity after disable."""
    model, inputs, num_image = _build(shape)
    ref = parity.forward(model, inputs)
    lengths = []
    ADAPTER.enable(model, mesh, "auto")
    hook = model.transformer_blocks[0].attn.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(args[0].shape[1]), with_kwargs=True)
    try:
        out = parity.forward(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)
    again = parity.forward(model, inputs)
    most = TEXT_LEN + math.ceil(num_image / mesh.sequence_degree)
    return {"out": rel_err(out, ref), "block0_tokens_above_ceil": float(not lengths or max(lengths) > most),
            "disable_not_bit_identical": float(not torch.equal(again, ref))}


def _gradient_case(shape: str, mesh) -> dict[str, float]:
    model, inputs, _ = _build(shape)
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with ``enable_gradient_checkpointing()``: the blocks recomputed in backward."""
    model, inputs, _ = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _first_attention_call(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, k) that the first attention call hands ``module.name``, rotated."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated image Q/K of block 0 equal the same rows of one process's (element 0:
    its text is padded, so the router calls usp_attention once per element). The text fusion's
    stock calls come first: the spies are set on block 0's attention only."""
    model, inputs, _ = _build(SHAPES[0])
    q_ref, k_ref = _block0_stock_qk(model, inputs, model.transformer_blocks[0].attn)
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t[:1, TEXT_LEN:], mesh)

    return {"q": rel_err(q, rows(q_ref)), "k": rel_err(k, rows(k_ref))}


def _block0_stock_qk(model, inputs, block0) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock (q, k) of block 0's attention call (the text fusion's calls skipped)."""
    seen = []
    inner = transformer_krea2.dispatch_attention_fn

    def spy(q, k, v, *args, **kwargs):
        if calling_block0:
            seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    calling_block0 = False

    def pre(module, args, kwargs):
        nonlocal calling_block0
        calling_block0 = True

    def post(module, args, kwargs, out):
        nonlocal calling_block0
        calling_block0 = False

    hooks = [block0.register_forward_pre_hook(pre, with_kwargs=True),
             block0.register_forward_hook(post, with_kwargs=True)]
    try:
        with mock.patch.object(transformer_krea2, "dispatch_attention_fn", spy):
            parity.forward(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen[0]


# ---- the pipeline -------------------------------------------------------------------------------------


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(the latents the VAE decodes, images) of 2 steps at 80 x 112 (5 x 7 = 35 image tokens), 12
    text tokens, seed 0."""
    return parity.decoded_latents_and(pipe, prompt="a red fox", negative_prompt="blurry", height=80, width=112,
                                      num_inference_steps=2, max_sequence_length=12,
                                      generator=torch.Generator().manual_seed(0), output_type="pt")


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # (U, R, cfg)
STEPS = 2


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The tiny pipeline on each of ``PIPELINE_GRIDS`` through ``pipe.enable_usp``: latents and images
    vs one process; at cfg 2, ``steps + 1`` computations per rank; after disable, bit-identical."""
    return parity.pipeline_cases(tiny_krea2_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS),
                                 check_enabled=False,
                                 probe=functools.partial(parity.cfg_pair_computations, steps=STEPS))


def _run_all() -> dict[str, dict | str]:
    """Every case, on each rank of the 4-rank group (2-rank grids run as two data-parallel replicas)."""
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case, GRAD_SHAPES, _fits)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    two_heads = tiny_krea2(num_heads=2, num_kv_heads=1, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "compiled", lambda: parity.compiled_case(*_build(SHAPES[0])[:2], init_usp(2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    # check_groups=False: the compiled case's torch compile caches (functional collectives' graphs)
    # keep references to the process groups past the job, as in tests/test_compile_grid.py.
    return parity.spawn_grid(_run_all, WORLD, check_groups=False)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES, _fits), parity.grad_keys(by_world=GRAD_SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


def test_whole_model_compiles_fullgraph_in_one_graph(grid_results):
    parity.assert_within(grid_results, "compiled", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, 0.0, {"latents": TOL, "images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: registration, loud failures ------------------------------------------------


test_a_foreign_text_fusion_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_krea2, ADAPTER, "text_fusion.refiner_blocks.0.attn")
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_krea2, ADAPTER, krea2, "_RoutedProcessor")


def test_position_ids_shorter_than_the_image_raise():
    model, inputs, _ = _build(SHAPES[1])
    inputs.position_ids = inputs.position_ids[:10]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="position_ids has 10 rows but the transformer has 15 image tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
