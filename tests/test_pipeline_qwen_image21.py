"""Qwen-Image 2.1 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case. Models: tiny 2-layer ``QwenImage21Transformer2DModel`` s
(4 heads x 16 head_dim, every weight perturbed: ``usp_dit.demo.tiny_qwen_image21``), with
``causal_condition`` (the release: prefix tokens modulated from t = 0) and without. Shapes: t2i (7
text positions, a 4 x 6 target: prefix 7 + target 24 = 31 tokens) and edit (9 positions holding
the 2 slots of a 2 x 4 condition image: prefix 7 + 8 = 15, target 24: 39 tokens). The target's
token count is a multiple of 4 by the model's construction (one vision slot is 2 x 2 tokens), so it
splits evenly over 2 and 4 ranks; the joint sequence and the prefix have odd lengths. Batch 2 with
a different prompt and timestep per element; prompt masks with different valid counts per element,
with a hole (t2i: 6 and 4 valid; edit: 9 and 5). RoPE positions are the model's own.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced. Each case: output vs stock, block 0's attention
sees at most prefix + ceil(target / P) tokens (Note [block-causal prefix, full target]: the prefix
is replicated, the target split), bit-identical output after ``disable``. Per shape, on 2 and on 4
ranks: every parameter's gradient (tests/adapter_parity.gradient_errors), and once with gradient
checkpointing. The KV cache (``"extract"`` then ``"cached"``, as QwenImage21Pipeline runs it) on
(2,2) through the adapter and on (1,2,2) through ``enable_usp`` (the batch split over cfg, each
group's cache its rows). Tensor parallel (T2) on (1,2,1,2). Ulysses above the heads raises.
The stock ``QwenImage21Pipeline`` (tiny processor, Qwen3-VL, VAE and transformer:
``tiny_qwen_image21_pipeline``) through ``pipe.enable_usp()``: its KV cache, two-call CFG (on the cfg
axis at cfg 2), no CFG, and an edit call with a condition image, on (2,1,1), (2,2,1), (1,2,2), (1,4,1);
``disable_usp`` gives the bit-identical image back.

Not compiled: the stock forward reads the image slots' mask with ``.tolist()`` to lay out its RoPE
positions (a graph break in stock too: ``torch.compile(fullgraph=True)`` of the stock model fails there).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and gradients: sharding only reorders
float32 sums (attention blocks merged by log-sum-exp, gradients summed over ranks; masked prompt
keys handled per element as separate calls).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21FlexAttnProcessor,
    QwenImage21KVCache,
)

import usp_dit
from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_qwen_image21 import qwen_image21_inputs, qwen_image21_lengths, tiny_qwen_image21
from usp_dit.pipelines.families import qwen_image21
from usp_dit.pipelines.families.qwen_image21 import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str  # "t2i" / "edit" (causal_condition) or "t2i-nocc" (without)
    images: tuple  # (1, h, w) of each condition image, then of the target
    masks: tuple  # per element: 0/1 per vision-language text position

    def __str__(self) -> str:
        return f"{self.variant}-s{sum(qwen_image21_lengths(list(self.images), len(self.masks[0])))}"


SHAPES = [
    Shape("t2i", ((1, 4, 6),), ((1, 1, 0, 1, 1, 1, 1), (1, 1, 1, 1, 0, 0, 0))),
    Shape("edit", ((1, 2, 4), (1, 4, 6)), ((1,) * 9, (1,) * 5 + (0,) * 4)),
    Shape("t2i-nocc", ((1, 4, 6),), ((1,) * 7, (1, 1, 1, 0, 0, 0, 0))),
]


def _build(shape: Shape, seed: int = 0):
    model = tiny_qwen_image21(causal_condition=not shape.variant.endswith("nocc"), seed=seed)
    return model, qwen_image21_inputs(model, list(shape.images), [list(m) for m in shape.masks])


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's attention length vs prefix + ceil(target / P), bit-identity after disable."""
    model, inputs = _build(shape)
    prefix, target = qwen_image21_lengths(list(shape.images), len(shape.masks[0]))
    ref = parity.forward(model, inputs)
    lengths = []
    hook = model.transformer_blocks[0].attn.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append((kwargs.get("hidden_states", args[0] if args else None)).shape[1]),
        with_kwargs=True)
    ADAPTER.enable(model, mesh, "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)
    return {
        "out": rel_err(out, ref),
        "block0_tokens_above": float(not lengths or max(lengths) > prefix + math.ceil(target / mesh.sequence_degree)),
        "disable_not_bit_identical": float(not torch.equal(parity.forward(model, inputs), ref)),
    }


class _Args:
    """Keyword arguments in the shape ``adapter_parity.forward`` takes."""

    def __init__(self, **kwargs) -> None:
        self._kwargs = kwargs

    def kwargs(self) -> dict:
        return dict(self._kwargs)


def _kv_calls(model, inputs) -> list[torch.Tensor]:
    """QwenImage21Pipeline's two cache modes: a prefill that extracts the prefix's K/V, then a
    decode of the target from them (at another timestep)."""
    cache = QwenImage21KVCache(len(model.transformer_blocks))
    first = parity.forward(model, _Args(**inputs.kwargs(), kv_cache=cache, kv_cache_mode="extract"))
    later = dict(inputs.kwargs(), timestep=inputs.timestep * 0.5)
    return [first, parity.forward(model, _Args(**later, kv_cache=cache, kv_cache_mode="cached"))]


def _kv_cache_case(mesh, through_enable_usp: bool) -> dict[str, float]:
    model, inputs = _build(SHAPES[1])
    refs = _kv_calls(model, inputs)
    if through_enable_usp:
        usp_dit.enable_usp(model, mesh=mesh)
    else:
        ADAPTER.enable(model, mesh, "auto")
    try:
        outs = _kv_calls(model, inputs)
    finally:
        usp_dit.disable_usp(model) if through_enable_usp else ADAPTER.disable(model)
    return {"extract": rel_err(outs[0], refs[0]), "cached": rel_err(outs[1], refs[1])}


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with gradient checkpointing (block 0's recompute re-cuts its saved full input)."""
    model, inputs = _build(SHAPES[1])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _tensor_case() -> dict[str, float]:
    """Tensor parallel (Diffusers' own _tp_plan cuts) on (U, R, cfg, T) = (1, 2, 1, 2), 5 heads (uneven)."""
    model = tiny_qwen_image21(num_heads=5)
    inputs = qwen_image21_inputs(model, list(SHAPES[0].images), [list(m) for m in SHAPES[0].masks])
    ref = parity.forward(model, inputs)
    usp_dit.enable_usp(model, mesh=init_usp(ulysses_degree=1, ring_degree=2, tensor_degree=2))
    try:
        out = parity.forward(model, inputs)
    finally:
        usp_dit.disable_usp(model)
    return {"out": rel_err(out, ref),
            "disable_not_bit_identical": float(not torch.equal(parity.forward(model, inputs), ref))}


PROMPTS = ["a red fox jumps", "a cat"]  # of different lengths: different valid prompt tokens per element
TOL_IMAGES = 1e-4  # decoded images: an untrained random VAE's gain (as tests/test_pipeline_qwen_image.py)


def _condition_image():
    """A 64 x 64 condition image (RGB noise, seeded): 4 x 4 latent tokens, 2 x 2 vision tokens."""
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(3).rand(64, 64, 3) * 255).astype("uint8"))


def _generate(pipe, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) at 64 x 96 (4 x 6 = 24 target tokens), 2 steps, seed 0; the prefix
    (the prompt's valid tokens, a condition image's 16 latent tokens) replicated, the target split."""
    return parity.latents_and(pipe, prompt=list(PROMPTS), height=64, width=96, num_inference_steps=2,
                              generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs)


_CFG = {"negative_prompt": ["blurry", "dark and dim"], "true_cfg_scale": 4.0}  # two transformer calls a step
# (pipeline arguments, grids): QwenImage21Pipeline's KV cache (extract, then cached calls) on every
# grid; two-call CFG on the cfg axis; no CFG; an edit call with a condition image (its tokens in the prefix).
PIPELINE_RUNS = {
    "pipeline": (_CFG, [(2, 1, 1), (2, 2, 1), (1, 2, 2)]),
    "pipeline-no-cfg": ({}, [(1, 4, 1)]),
    "pipeline-edit": ({"image": "condition", "output_resolution": 64}, [(2, 2, 1)]),
}
PIPELINE_KEYS = [key for prefix, (_, grids) in PIPELINE_RUNS.items() for key in parity.pipeline_grids(grids, prefix)]


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """``QwenImage21Pipeline`` (tiny: ``tiny_qwen_image21_pipeline``) through ``pipe.enable_usp()``
    on each run's grids, against the same pipeline on one process (``adapter_parity.pipeline_cases``)."""
    from usp_dit.demo.tiny_qwen_image21 import tiny_qwen_image21_pipeline

    pipe = tiny_qwen_image21_pipeline()
    results = {}
    for prefix, (kwargs, grids) in PIPELINE_RUNS.items():
        kwargs = {k: ([_condition_image()] if v == "condition" else v) for k, v in kwargs.items()}
        results.update(parity.pipeline_cases(
            pipe, lambda p, kwargs=kwargs: _generate(p, **kwargs), parity.pipeline_grids(grids, prefix),
            after_disable="pipeline-after-disable" if prefix == "pipeline" else None))
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "kv-cache", lambda: _kv_cache_case(init_usp(2, 2), False))
    parity.record(results, "kv-cache-cfg", lambda: _kv_cache_case(init_usp(1, 2, 2), True))
    parity.record(results, "tensor-t2", _tensor_case)
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    two_heads = tiny_qwen_image21(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


@pytest.mark.parametrize("key", ["kv-cache", "kv-cache-cfg"])
def test_kv_cache_prefill_and_decode_match_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


def test_tensor_parallel_matches_one_process(grid_results):
    parity.assert_within(grid_results, "tensor-t2", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: registration, refusals ---------------------------------------------------


def test_matched_by_exact_class():
    model = tiny_qwen_image21(num_layers=1)
    assert ADAPTER.matches(model)


test_flex_processor_is_refused = family_checks.foreign_processor_refused(
    lambda: tiny_qwen_image21(num_layers=1), ADAPTER, "transformer_blocks.0.attn", QwenImage21FlexAttnProcessor)
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    lambda: tiny_qwen_image21(num_layers=1), ADAPTER, qwen_image21, "_ROUTED_CALL")


def test_img_shapes_with_more_target_tokens_than_the_sequence_are_refused():
    model, inputs = _build(SHAPES[0])
    inputs.img_shapes = [[(1, 8, 8)]] * 2  # 64 target tokens in a 31-token sequence
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises((ValueError, RuntimeError)):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


@pytest.mark.parametrize("key", PIPELINE_KEYS)
def test_pipeline_matches_one_process(grid_results, key: str):
    """Latents within TOL, decoded images within TOL_IMAGES, on every rank."""
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_the_image_example_builds_and_runs_the_tiny_qwen_image21():
    """examples/generate_image.py --family qwen_image21: its tiny default pipeline on one process
    (1 step, two-call CFG with the default negative prompt), RGB in [0, 1]."""
    from tests.test_examples_cli import _example

    ex = _example("generate_image")
    args = ex.parse_args(["--family", "qwen_image21", "--steps", "1", "--height", "32", "--width", "96"])
    images = ex.generate(ex.load_pipeline(args, torch.device("cpu")), args)
    assert images.shape == (1, 32, 96, 3) and bool((images >= 0).all() and (images <= 1).all())
