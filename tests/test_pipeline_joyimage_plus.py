"""JoyImage-Edit-Plus adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Models: tiny ``JoyImageEditPlusTransformer3DModel`` s (2 double-stream blocks, 4 heads x 16
head_dim, patch (1, 2, 2), every weight perturbed: ``usp_dit.demo.tiny_joyimage_plus``). Shapes (the
flat patch sequence of target and references, Note [JoyImage-Plus's one stream of items]):

- "masked": batch 2, each element a 5 x 7 target and references of 3 x 5 and 5 x 3 patches (65
  tokens), 7 text tokens under a prompt mask of 7 and 4 valid (different per element);
- "padded": batch 2 of different items per element (a 2-frame 3 x 5 target and a 3 x 7 reference:
  51 tokens; the same target and a 2 x 3 reference: 36, padded to 51), 5 text tokens, no mask (the
  padding is then attended in stock too: Note [JoyImage-Plus's padded items]); the temporal offsets
  of the items' RoPE rows differ per element.

Neither 65 nor 51 divides 2 or 4. A different prompt and timestep per element.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced (one ring grid per shape in CI: adapter_parity
Note [schedules in CI]). Each case: output vs stock, block 0's attention sees at most
ceil(tokens / P) image tokens (the text is replicated), bit-identical output after ``disable``.
Per shape, on 2 and on 4 ranks: every parameter's gradient (tests/adapter_parity.gradient_errors),
and the masked shape once with gradient checkpointing (the RoPE and mask passed positionally).
The transformer enabled with cfg_degree=2 (the "padded" batch split over cfg: each group its own
element's ``shape_list`` row) equals stock; tensor parallelism on 2 ranks (heads, fused QKV and MLP
widths cut) equals stock and leaves the weights as found. Each rank's rotated Q/K of block 0
(padded shape, (2,2)) equal the same rows of one process's.

Fullgraph compile: the masked shape on (1,2,1) in tests/test_compile_grid.py (ADAPTER_CASES).

Pipeline: the tiny ``JoyImageEditPlusPipeline`` (Qwen3-VL text encoder with its vision tower and a
real ``Qwen3VLProcessor``: two prompts of different lengths, each with two reference images of
48 x 80 and 80 x 48 inline, padded and masked; tiny Wan VAE; target 80 x 112: 35 + 15 + 15 = 65
tokens; 2 steps; batched CFG: [negative, positive] in one call) through ``pipe.enable_usp()`` on
(2,1), (2,2) and with ``cfg_degree=2`` on (1,2,2) (the batch's halves on the two cfg groups), equal
one process's.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's latents:
sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients summed over
ranks, tensor-parallel partial products all-reduced). Decoded images: 1e-4 (an untrained random
VAE's gain, as in tests/test_pipeline_joyimage.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_joyimage_edit_plus

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import disable_usp, enable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_joyimage_plus import (
    joyimage_plus_inputs,
    plus_tokens,
    tiny_joyimage_plus,
    tiny_joyimage_plus_pipeline,
)
from usp_dit.demo.tiny_video import gradient_image
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import joyimage_plus
from usp_dit.pipelines.families.joyimage_plus import ADAPTER, USPJoyImagePlusAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    name: str
    items: tuple  # per element: its items' (t, h, w) patch grids, target first
    text: int
    valid: tuple[int, ...]  # valid text tokens per element
    mask: bool

    def __str__(self) -> str:
        return self.name


SHAPES = [
    Shape("masked", (((1, 5, 7), (1, 3, 5), (1, 5, 3)),) * 2, 7, (7, 4), True),
    Shape("padded", (((2, 3, 5), (1, 3, 7)), ((2, 3, 5), (1, 2, 3))), 5, (5, 5), False),
]


def _build(shape: Shape, seed: int = 0, **model):
    m = tiny_joyimage_plus(seed=seed, **model)
    return m, joyimage_plus_inputs(m, [list(i) for i in shape.items], list(shape.valid), shape.text, shape.mask, seed)


def _tokens(shape: Shape) -> int:
    return plus_tokens(shape.items)


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.double_blocks[0].attn, _tokens(shape))


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


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
    """Each rank's rotated image Q/K (target, reference and padding patches; items at per-element
    temporal offsets) equal the same rows of one process's (stock hands ``dispatch_attention_fn``
    the joint [image; text]). The unmasked shape: a prompt mask splits the routed call per element."""
    shape = SHAPES[1]
    model, inputs = _build(shape)
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_joyimage_edit_plus, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t[:, :_tokens(shape)], mesh)

    return {"q": rel_err(q, rows(q_ref)), "k": rel_err(k, rows(k_ref))}


def _tensor_case(mesh) -> dict[str, float]:
    """The transformer enabled with ``tensor_degree=2`` (heads, fused QKV and MLP widths cut): equal
    to stock, its weights left as found."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    enable_usp(model, mesh=mesh)
    try:
        out = parity.forward(model, inputs)
    finally:
        disable_usp(model)
    after = model.state_dict()
    return {"out": rel_err(out, ref),
            "weights_not_restored": float(not all(torch.equal(after[k], v) for k, v in before.items()))}


# ---- the stock pipeline -------------------------------------------------------------------------


STEPS = 2
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # (U, R, cfg)


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents (B, 65, C, 1, 2, 2), images) of a two-reference edit to 80 x 112 under CFG, seed 1."""
    refs = [gradient_image(48, 80), gradient_image(80, 48)]
    return parity.latents_and(
        pipe, images=[refs, refs[::-1]], prompt=["a red fox", "make the sky a deep blue"], height=80, width=112,
        num_inference_steps=STEPS, guidance_scale=4.0, output_type="pt", generator=torch.Generator().manual_seed(1),
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_joyimage_plus_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS))


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[1]), init_usp(1, 2, 2)))
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_joyimage_plus(num_heads=2, head_dim=32), ADAPTER,
                                                          init_usp(ulysses_degree=4)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "tensor-t2", lambda: _tensor_case(init_usp(tensor_degree=2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_cfg_split_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_tensor_parallel_matches_stock_and_restores_weights(grid_results):
    parity.assert_within(grid_results, "tensor-t2", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", list(parity.pipeline_grids(PIPELINE_GRIDS)))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, 0.0, {"latents": TOL, "images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: registration, what disable gives back, refusals ---------------------------


test_the_adapter_is_found_for_the_class = family_checks.adapter_found(tiny_joyimage_plus, ADAPTER)
test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPJoyImagePlusAttnProcessor)
test_one_rank_is_bit_identical = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[0]), ADAPTER)
test_a_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_joyimage_plus, ADAPTER, "double_blocks.1.attn")
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_joyimage_plus, ADAPTER, joyimage_plus, "_RoutedPlusProcessor")


def test_a_mask_over_padded_items_is_refused():
    """Elements of different patch counts under a prompt mask: the model masks the padding keys,
    which usp_dit cannot (Note [JoyImage-Plus's padded items]): NotImplementedError, not a wrong result."""
    model, inputs = _build(Shape("padded-masked", SHAPES[1].items, 5, (5, 3), True))
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask masks image tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_an_image_table_unlike_the_tokens_is_refused():
    """A block given a RoPE table of a length other than the call's token count raises, rather
    than rotating tokens by other tokens' rows."""
    model, inputs = _build(SHAPES[0])
    tokens = _tokens(SHAPES[0])
    shorten = model.double_blocks[0].register_forward_pre_hook(
        lambda m, args, kwargs: (args, {**kwargs, "image_rotary_emb": tuple(
            t[:, :-1] for t in kwargs["image_rotary_emb"])}), with_kwargs=True)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match=f"has \\[{tokens - 1}, {tokens - 1}\\] rows but the image sequence "
                                             f"has {tokens} tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
        shorten.remove()


def test_the_shapes_are_odd_and_padded_as_stated():
    """The token counts divide neither 2 nor 4; the padded shape's elements differ in patch count."""
    assert all(_tokens(s) % 2 for s in SHAPES)
    counts = [sum(math.prod(g) for g in items) for items in SHAPES[1].items]
    assert counts[0] != counts[1]
