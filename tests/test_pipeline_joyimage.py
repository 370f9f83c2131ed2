"""JoyImage-Edit adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Models: tiny ``JoyImageEditTransformer3DModel`` s (2 double-stream blocks, 4 heads x 16
head_dim, patch (1, 2, 2), every weight perturbed: ``usp_dit.demo.tiny_joyimage``). Shapes:
generation (a 5-D call, one frame of 5 x 7 patches: 35 tokens, 7 text tokens, ``rope_type="rope"``)
and editing (a 6-D call of 3 items, two references and the target, each 5 x 7: 105 tokens, split
together, Note [JoyImage's reference frames]; 5 text tokens rotated too, ``rope_type="mrope"``).
Neither count divides 2 or 4. Batch 2 with a different prompt and timestep per element; the model
takes no prompt mask (its pipeline passes none), so there is no mask case.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced (one ring grid per shape in CI: adapter_parity
Note [schedules in CI]). Each case: output vs stock, block 0's attention sees at most
ceil(tokens / P) image tokens (the text is replicated), bit-identical output after ``disable``.
Per shape, on 2 and on 4 ranks: every parameter's gradient (tests/adapter_parity.gradient_errors),
and the edit shape once with gradient checkpointing. The transformer enabled with cfg_degree=2 (the
batch split over cfg) equals stock; tensor parallelism on
2 ranks (the edit shape: heads, fused QKV and MLP widths cut) equals stock and leaves the weights
as found. Each rank's rotated Q/K of block 0 (edit shape, (2,2)) equal the same rows of one process's.

Fullgraph compile: the generation shape on (1,2,1) in tests/test_compile_grid.py (ADAPTER_CASES;
the edit shape's ``mrope`` reads a ``.item()`` in the stock forward).

Pipeline: the tiny ``JoyImageEditPipeline`` (tiny Wan VAE, no text encoder: prompt embeddings of 7
and negative ones of 5 tokens given, different per element; a reference image of 80 x 112: 2 items
of 5 x 7 patches, 70 tokens; 2 steps; CFG: two transformer calls a step) through
``pipe.enable_usp()`` on (2,1), (2,2) and with ``cfg_degree=2`` on (1,2,2) (the two calls of a step on
the two cfg groups at once: ``steps + 1`` computations a rank), equal one process's.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's latents:
sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients summed over
ranks, tensor-parallel partial products all-reduced). Decoded images: 1e-4 (an untrained random VAE's gain, as in tests/test_video_pipelines.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_joyimage

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import disable_usp, enable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_joyimage import TEXT_DIM, joyimage_inputs, joyimage_tokens, tiny_joyimage, tiny_joyimage_pipeline
from usp_dit.demo.tiny_video import gradient_image
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import joyimage
from usp_dit.pipelines.families.joyimage import ADAPTER, USPJoyImageAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4
H, W = 5, 7


@dataclass(frozen=True)
class Shape:
    items: int | None  # None: the 5-D generation call
    text: int
    rope: str

    def __str__(self) -> str:
        return f"{'gen' if self.items is None else f'edit{self.items}'}-t{self.text}-{self.rope}"


SHAPES = [Shape(None, 7, "rope"), Shape(3, 5, "mrope")]


def _build(shape: Shape, seed: int = 0):
    model = tiny_joyimage(rope_type=shape.rope, seed=seed)
    return model, joyimage_inputs(model, 2, H, W, shape.text, items=shape.items, seed=seed)


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.double_blocks[0].attn,
                                      joyimage_tokens(shape.items, 1, H, W))


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[1])
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
    """Each rank's rotated image Q/K (the edit shape: target and reference frames) equal the same
    rows of one process's (stock hands ``dispatch_attention_fn`` the joint [image; text])."""
    shape = SHAPES[1]
    model, inputs = _build(shape)
    tokens = joyimage_tokens(shape.items, 1, H, W)
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_joyimage, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t[:, :tokens], mesh)

    return {"q": rel_err(q, rows(q_ref)), "k": rel_err(k, rows(k_ref))}


def _tensor_case(mesh) -> dict[str, float]:
    """The transformer enabled with ``tensor_degree=2`` (heads, fused QKV and MLP widths cut): equal
    to stock, its weights left as found."""
    model, inputs = _build(SHAPES[1])
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
    """(final latents (B, items, C, 1, h, w), images) of an edit of 80 x 112 under CFG, seed 1.

    The global seed too: the pipeline samples the reference's VAE posterior without its generator."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    prompt, negative = torch.randn(2, 7, TEXT_DIM, generator=g), torch.randn(2, 5, TEXT_DIM, generator=g)
    return parity.latents_and(
        pipe, image=gradient_image(80, 112), prompt_embeds=prompt,
        prompt_embeds_mask=torch.ones(2, 7, dtype=torch.long), negative_prompt_embeds=negative,
        negative_prompt_embeds_mask=torch.ones(2, 5, dtype=torch.long), height=80, width=112,
        num_inference_steps=STEPS, guidance_scale=4.0, output_type="pt", generator=torch.Generator().manual_seed(1),
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(
        tiny_joyimage_pipeline(text_encoder=False), _generate, parity.pipeline_grids(PIPELINE_GRIDS),
        probe=functools.partial(parity.cfg_pair_computations, steps=STEPS, blocks="double_blocks"),
    )


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[1]), init_usp(1, 2, 2)))
    two_heads = tiny_joyimage(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
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


test_the_adapter_is_found_for_the_class = family_checks.adapter_found(tiny_joyimage, ADAPTER)
test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[1]), ADAPTER, USPJoyImageAttnProcessor)
test_one_rank_is_bit_identical = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[1]), ADAPTER)
test_a_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_joyimage, ADAPTER, "double_blocks.1.attn")
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_joyimage, ADAPTER, joyimage, "_RoutedJoyImageProcessor")


def test_an_image_table_unlike_the_tokens_is_refused():
    """A block given an image RoPE table of a length other than the call's token count raises,
    rather than rotating tokens by other tokens' rows."""
    model, inputs = _build(SHAPES[0])
    block = model.double_blocks[0]
    shorten = block.register_forward_pre_hook(
        lambda m, args, kwargs: (args, {**kwargs, "image_rotary_emb": (
            tuple(t[:-1] for t in kwargs["image_rotary_emb"][0]), kwargs["image_rotary_emb"][1])}),
        with_kwargs=True)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match=f"has \\[{math.prod((H, W)) - 1}, {H * W - 1}\\] rows but the image "
                                             f"sequence has {H * W} tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
        shorten.remove()
