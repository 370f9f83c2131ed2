"""Qwen-Image adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Models: tiny 2-layer
``QwenImageTransformer2DModel`` s (4 heads x 16 head_dim, every weight perturbed;
``usp_dit.demo.tiny_qwen_image``) in three variants: Qwen-Image (t2i, 15 image tokens), Edit-2511
(``zero_cond_t``: a target image and a condition image, 15 + 12 = 27 tokens, a per-token modulation
index) and Layered (layer-aware 3D RoPE, an additional timestep condition, 3 images: 39 tokens).
No token count divides 2 or 4; batch 2 with a different prompt and timestep per element; 9 text
tokens with masks whose valid counts differ per element and that have **holes** (t2i: tokens
2, 6-8 and 0, 8 masked; Edit: prefixes of 4 and 9), and no mask (Layered). RoPE positions are the
model's own (centred height / width, scale_rope), never zeros.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil(tokens / P) image tokens (the text is replicated, not
split), after ``disable`` the output is bit-identical. Per variant, on 2 and on 4 ranks: every
parameter's gradient (tests/adapter_parity.gradient_errors), and once with gradient checkpointing
(Edit-2511: modulate_index re-sliced on recompute). The text stream's valid rows after each block
equal stock's (Note [padded text rows]: the padded ones are the only rows that differ, and nothing
reads them). Each rank's rotated Q/K (image rows, and the whole text) equal one process's.
The tiny ``QwenImagePipeline`` (a Qwen2.5-VL-like text encoder and a character tokenizer; two
prompts of different lengths, so padded and masked, and true CFG with negative prompts: two
transformer calls of batch 2 per step) through ``pipe.enable_usp()`` on (U, R, cfg) = (2,1,1),
(2,2,1) and (1,2,2) (the first step's cfg split halves each call's batch of two prompts, masks
included; the second runs its two calls on the two cfg groups, ``usp_dit.pipelines.cfg_pair``),
2 steps, equal to one process's; with one prompt, ``cfg_degree=2`` runs the two transformer calls
of batch 1 of a step on the two cfg groups, equal to one process's. The
transformer enabled directly with cfg_degree=2 on a batch of 2 (the cfg split of the mask) equals
stock; with ``zero_cond_t`` it raises (img_shapes cannot be split).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients, text-stream rows, rotated
Q/K and the pipeline's final latents: sharding only reorders float32 sums (attention blocks merged by
log-sum-exp, gradients summed over ranks; masked text handled per element as separate calls).
Measured (2026-12-03): 4.1e-7 at most on outputs (all grids and schedules), 1.9e-6 on the worst
parameter gradient, 8.8e-7 on the pipeline's latents, 0 on the rotated Q/K. Decoded images: 1e-4
(an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage

import usp_dit
from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_qwen_image import (
    qwen_image_inputs,
    qwen_image_tokens,
    tiny_qwen_image,
    tiny_qwen_image_pipeline,
)
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import qwen_image  # noqa: F401  (registers the adapter)
from usp_dit.pipelines.families.qwen_image import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    images: tuple  # per sample: (frames, h, w) patch grids of the target, then condition images / layers
    masks: tuple | None  # per element: 0/1 per text token (holes allowed), or None: no mask

    def __str__(self) -> str:
        return f"{self.variant}-s{qwen_image_tokens(list(self.images))}"


_HOLES = ((1, 1, 0, 1, 1, 1, 0, 0, 0), (0, 1, 1, 1, 1, 1, 1, 1, 0))  # 5 and 7 valid, holes inside
_PREFIXES = ((1, 1, 1, 1, 0, 0, 0, 0, 0), (1,) * 9)  # 4 and 9 valid
SHAPES = [
    Shape("t2i", ((1, 3, 5),), _HOLES),  # 15 tokens
    Shape("edit-2511", ((1, 3, 5), (1, 3, 4)), _PREFIXES),  # 27 tokens: target, then a condition image
    Shape("layered", ((1, 3, 5), (1, 3, 5), (1, 3, 3)), None),  # 39 tokens: two layers, the condition image
]


def _build(shape: Shape, seed: int = 0):
    model = tiny_qwen_image(shape.variant, seed=seed)
    masks = [list(m) for m in shape.masks] if shape.masks else None
    inputs = qwen_image_inputs(model, list(shape.images), masks)
    if shape.masks is None:
        inputs.encoder_hidden_states_mask = None
    return model, inputs


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's attention length vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    tokens = qwen_image_tokens(list(shape.images))
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, tokens)


def _text_streams(model, inputs) -> list[torch.Tensor]:
    """Each block's text-stream output (B, T, C) (None for none: the model has no context_pre_only block)."""
    seen = []
    hooks = [b.register_forward_hook(lambda m, a, out: seen.append(out[0])) for b in model.transformer_blocks]
    try:
        parity.forward(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _text_stream_case(mesh) -> dict[str, float]:
    """Note [padded text rows]: the valid text rows after every block equal stock's (t2i, mask with holes)."""
    model, inputs = _build(SHAPES[0])
    refs = _text_streams(model, inputs)
    ADAPTER.enable(model, mesh, "auto")
    try:
        outs = _text_streams(model, inputs)
    finally:
        ADAPTER.disable(model)
    valid = inputs.encoder_hidden_states_mask
    return {f"block{i}_valid_text_rows": rel_err(o[valid], r[valid]) for i, (o, r) in enumerate(zip(outs, refs))}


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with gradient checkpointing (Edit-2511: block 0's recompute re-shards its saved full
    input, every block's recompute re-slices the full modulate_index)."""
    model, inputs = _build(SHAPES[1])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _first_attention_call(model, inputs, module, name: str) -> dict:
    """The keyword and positional tensors of the first call of ``module.name`` in a forward."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append({"q": q.clone(), "k": k.clone(), **{n: kwargs.get(n) for n in ("joint_q", "joint_k")}})
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated image Q/K equal the same rows of one process's, the text Q/K all rows
    (Layered: 3D layer RoPE; no mask, so one usp_attention call per block)."""
    model, inputs = _build(SHAPES[2])
    text_len = inputs.encoder_hidden_states.shape[1]
    ref = _first_attention_call(model, inputs, transformer_qwenimage, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        got = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {
        "q": rel_err(got["q"], shard_sequence(ref["q"][:, text_len:], mesh)),
        "k": rel_err(got["k"], shard_sequence(ref["k"][:, text_len:], mesh)),
        "text_q": rel_err(got["joint_q"], ref["q"][:, :text_len]),
        "text_k": rel_err(got["joint_k"], ref["k"][:, :text_len]),
    }


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2 (usp_dit.enable_usp on the model): its batch of 2
    (and the mask with holes) split over the cfg groups, equal to stock."""
    return parity.cfg_split_case(*_build(SHAPES[0]), mesh)


def _cfg_split_zero_cond_case(mesh) -> dict[str, float]:
    """cfg_degree=2 with zero_cond_t: img_shapes stays whole, so modulate_index has the full batch's
    rows: NotImplementedError at the call, not a silently broadcast batch."""
    model, inputs = _build(SHAPES[1])
    usp_dit.enable_usp(model, mesh=mesh)
    try:
        parity.forward(model, inputs)
    except NotImplementedError as exc:
        return {"wrong_error": float("use cfg_degree=1 with zero_cond_t" not in str(exc))}
    finally:
        usp_dit.disable_usp(model)
    return {"did_not_raise": 1.0}


PROMPTS = (["a red fox jumps", "a cat"], ["blurry", "dark and dim"])  # of different lengths: padded, masked


def _generate(pipe, prompts: tuple = PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 48 x 80 (3 x 5 = 15 image tokens), true CFG (a negative
    prompt: two transformer calls per step), seed 0."""
    prompt, negative_prompt = prompts
    return parity.latents_and(
        pipe,
        prompt=prompt, negative_prompt=negative_prompt, true_cfg_scale=4.0, height=48, width=80,
        num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt",
    )


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last splits the batch of 2 prompts over cfg


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_qwen_image_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS))


def _pipeline_cfg_case() -> dict[str, float]:
    """cfg_degree=2 on QwenImagePipeline with one prompt: two transformer calls of batch 1 per step
    (its true CFG), run on the two cfg groups (usp_dit.pipelines.cfg_pair): equal to one process."""
    pipe = tiny_qwen_image_pipeline()
    pipe.set_progress_bar_config(disable=True)
    prompts = ("a red fox", "blurry")
    ref_latents, ref_images = _generate(pipe, prompts)
    pipe.enable_usp(cfg_degree=2)
    try:
        latents, images = _generate(pipe, prompts)
    finally:
        pipe.disable_usp()
    return {"latents": rel_err(latents, ref_latents), "images": rel_err(images, ref_images)}


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "text-stream", lambda: _text_stream_case(init_usp(1, 2, 1, "gather_merge")))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    parity.record(results, "cfg-split-zero-cond", lambda: _cfg_split_zero_cond_case(init_usp(1, 2, 2)))
    two_heads = tiny_qwen_image(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    parity.record(results, "pipeline-cfg2", _pipeline_cfg_case)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_valid_text_rows_match_stock_after_every_block(grid_results):
    parity.assert_within(grid_results, "text-stream", TOL)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_cfg_split_of_a_masked_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_cfg_split_with_zero_cond_t_is_refused(grid_results):
    parity.assert_within(grid_results, "cfg-split-zero-cond", 0.0)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_cfg_parallel_runs_the_two_guidance_calls_of_the_qwen_image_pipeline(grid_results):
    parity.assert_within(grid_results, "pipeline-cfg2", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: registration, restore exactly, loud failures --------------------------------


def test_qwen_image_21_is_not_matched():
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel

    model = QwenImage21Transformer2DModel(
        num_layers=1, attention_head_dim=16, num_attention_heads=2, in_channels=4, out_channels=4,
        context_in_dim=8, axes_dims_rope=(4, 6, 6),
    )
    assert not ADAPTER.matches(model)


test_diffusers_context_parallelism_is_refused = family_checks.context_parallelism_refused(
    tiny_qwen_image, ADAPTER, "transformer_blocks.0.attn")


def test_controlnet_residuals_are_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        residual = torch.zeros(2, 15, model.inner_dim)
        with pytest.raises(NotImplementedError, match="controlnet_block_samples"):
            model(**inputs.kwargs(), controlnet_block_samples=[residual])
    finally:
        ADAPTER.disable(model)


def test_img_shapes_unlike_the_tokens_are_refused():
    model, inputs = _build(SHAPES[0])
    inputs.img_shapes = [[(1, 3, 4)]] * 2  # 12 rows of RoPE for 15 tokens
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="table of this call has 12 rows but the transformer has 15 tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_qwen_image, ADAPTER, qwen_image, "_RoutedQwenProcessor")


