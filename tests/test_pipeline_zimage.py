"""Z-Image adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``ZImageTransformer2DModel`` (``usp_dit.demo.tiny_zimage``): **6 heads**
x 16 (4 Ulysses ranks split them 2, 2, 1, 1, as 4 splits the released 30 heads unevenly), 2
refiner and 2 main layers, every weight perturbed (the pad tokens included). Batch 2 with a
different latent, prompt and timestep per element. Shapes:

* ``masked``: a 5 x 7 patch grid (35 patches, 64 image tokens once the model pads them) and
  prompts of 7 and 40 tokens (padded by the model to 32 and 64): the unified sequences
  [image; prompt] have 96 and 128 valid tokens, so the main layers take a key mask with
  different valid lengths per element, and the context refiner its own.
* ``unmasked``: 3 x 5 patches (32 tokens), prompts of 20 and 30 (both padded to 32): no mask.

Token counts: the model pads every image to a multiple of 32 tokens (``SEQ_MULTI_OF``), so image
token counts that divide neither 2 nor 4 cannot occur; the odd patch counts (35, 15) are what
``unpatchify`` cuts back. RoPE positions are the model's own 3-D (text index, h, w), nonzero: a
prompt token i at (1 + i, 0, 0), an image patch at (padded prompt length + 1, h, w): in ``masked``
the two elements' image tables differ (33 and 65 on the first axis).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, noise_refiner.0's attention sees at most ceil(image tokens / P) tokens (the text is
replicated, not split), after ``disable`` the output is bit-identical. Every parameter's gradient
on 2 and 4 ranks, and once with gradient checkpointing (the tables re-cut on recompute). Each
rank's rotated Q/K (refiner and main layer, per element with the mask) equal the same rows of one
process's. The transformer enabled with ``cfg_degree=2`` (its lists split over cfg). The tiny
``ZImagePipeline`` (a Qwen3 text encoder, a character tokenizer, two prompts of different lengths
and negative prompts: one call of 4 a step, [cond, cond, uncond, uncond]) through
``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2) (the cfg axis splits [cond; uncond]), Turbo's
``guidance_scale=0`` on (1,2,2) (the batch of 2 prompts split), and ``ZImageImg2ImgPipeline`` on
(2,2,1): equal to one process, bit-identical after ``disable_usp``. Fullgraph compile on (2,2):
tests/test_compile_grid.py.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients, rotated Q/K and the
pipelines' final latents: sharding only reorders float32 sums (attention blocks merged by
log-sum-exp, gradients summed over ranks, the masked text attended per element). Decoded images:
1e-4 (an untrained random VAE's gain, as in tests/test_pipeline_qwen_image.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_z_image

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_zimage import tiny_zimage, tiny_zimage_pipeline, zimage_inputs, zimage_tokens
from usp_dit.pipelines import _routing, is_usp_enabled
from usp_dit.pipelines.families import zimage
from usp_dit.pipelines.families.zimage import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    name: str
    patches: tuple[int, int]
    text_lens: tuple[int, int]

    def __str__(self) -> str:
        return f"{self.name}-s{zimage_tokens(self.patches)}"


SHAPES = [Shape("masked", (5, 7), (7, 40)), Shape("unmasked", (3, 5), (20, 30))]


def _build(shape: Shape, seed: int = 0):
    return tiny_zimage(seed=seed), zimage_inputs(shape.patches, shape.text_lens, seed=seed)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    tokens = zimage_tokens(shape.patches)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.noise_refiner[0].attention, tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _attention_calls(model, inputs, module, name: str) -> list[dict]:
    """Q, K (and joint Q/K) of every call of ``module.name`` in one forward."""
    seen, inner = [], getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append({"q": q.clone(), "k": k.clone(), **{n: kwargs.get(n) for n in ("joint_q", "joint_k")}})
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated Q/K equal the same rows of one process's: noise_refiner.0 (image
    shard) and layers.0 (per element, masked: the image shard and that element's valid text)."""
    shape = SHAPES[0]
    model, inputs = _build(shape)
    image = zimage_tokens(shape.patches)
    valid_text = [n + (-n) % 32 for n in shape.text_lens]
    ref = _attention_calls(model, inputs, transformer_z_image, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        got = _attention_calls(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    # stock: refiners 0-1, context refiners 2-3, layers 4-5; ours: refiners 0-1, layer 0 per element 2-3
    errors = {n: rel_err(got[0][n], shard_sequence(ref[0][n], mesh)) for n in ("q", "k")}
    for b, text in enumerate(valid_text):
        call, stock = got[2 + b], ref[4]
        for n in ("q", "k"):
            errors[f"layer0-b{b}-{n}"] = rel_err(call[n], shard_sequence(stock[n][b:b + 1, :image], mesh))
            errors[f"layer0-b{b}-text-{n}"] = rel_err(call[f"joint_{n}"], stock[n][b:b + 1, image:image + text])
    return errors


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2: its lists of latents and prompts split over cfg."""
    return parity.cfg_split_case(*_build(SHAPES[0]), mesh)


PROMPTS = ["a red fox jumps", "a cat"]  # of different lengths: different embedding lengths


def _generate(pipe, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) at 20 x 28 (5 x 7 patches), 2 steps unless ``kwargs`` say otherwise, seed 0."""
    # Fresh lists: the Z-Image pipelines write the chat-templated prompts into the lists they are given.
    kwargs = {"num_inference_steps": 2, **{k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}}
    return parity.latents_and(
        pipe,
        prompt=list(PROMPTS), height=20, width=28, generator=torch.Generator().manual_seed(0), output_type="pt",
        max_sequence_length=64, **kwargs,
    )


# (U, R, cfg, pipeline arguments): CFG batched [cond; uncond] (split by cfg 2), Turbo's no-CFG call
PIPELINE_RUNS = {
    "u2r1cfg1": (2, 1, 1, {"guidance_scale": 4.0, "negative_prompt": ["blurry", "dark and dim"]}),
    "u2r2cfg1": (2, 2, 1, {"guidance_scale": 4.0, "negative_prompt": ["blurry", "dark and dim"]}),
    "u1r2cfg2": (1, 2, 2, {"guidance_scale": 4.0, "negative_prompt": ["blurry", "dark and dim"]}),
    "turbo-u1r2cfg2": (1, 2, 2, {"guidance_scale": 0.0}),
}


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_zimage_pipeline()
    pipe.set_progress_bar_config(disable=True)
    results, refs = {}, {}
    for key, (u, r, c, kwargs) in PIPELINE_RUNS.items():
        ref_key = str(sorted(kwargs.items()))
        if ref_key not in refs:
            refs[ref_key] = _generate(pipe, **kwargs)
        ref_latents, ref_images = refs[ref_key]
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe.transformer)
        try:
            latents, images = _generate(pipe, **kwargs)
        finally:
            pipe.disable_usp()
        results[f"pipeline-{key}"] = {
            "not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe.transformer)),
            "latents": rel_err(latents, ref_latents),
            "images": rel_err(images, ref_images),
        }
    again_latents, again_images = _generate(pipe, **PIPELINE_RUNS["u2r1cfg1"][3])
    ref_latents, ref_images = refs[str(sorted(PIPELINE_RUNS["u2r1cfg1"][3].items()))]
    same = torch.equal(again_latents, ref_latents) and torch.equal(again_images, ref_images)
    results["pipeline-after-disable"] = {"not_bit_identical": float(not same)}
    return results


def _img2img_case() -> dict[str, float]:
    """``ZImageImg2ImgPipeline`` (the same transformer call after a VAE-encoded start) on (2, 2, 1), with CFG."""
    pipe = tiny_zimage_pipeline(pipeline="ZImageImg2ImgPipeline")
    pipe.set_progress_bar_config(disable=True)
    image = torch.rand(2, 3, 20, 28, generator=torch.Generator().manual_seed(5))
    kwargs = {"image": image, "strength": 0.8, "guidance_scale": 4.0, "num_inference_steps": 3}
    ref_latents, ref_images = _generate(pipe, **kwargs)
    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    try:
        latents, images = _generate(pipe, **kwargs)
    finally:
        pipe.disable_usp()
    return {"latents": rel_err(latents, ref_latents), "images": rel_err(images, ref_images)}


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh),
                          grad_shapes={2: SHAPES[:1]})
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    two_heads = tiny_zimage(num_heads=2, head_dim=16)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    parity.record(results, "img2img", _img2img_case)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(by_world={2: SHAPES[:1], 4: SHAPES}) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_cfg_split_of_the_lists_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def _assert_pipeline(grid_results: list[dict], key: str) -> None:
    """Latents within TOL, decoded images within TOL_IMAGES, on every rank."""
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


@pytest.mark.parametrize("key", list(PIPELINE_RUNS))
def test_pipeline_matches_one_process(grid_results, key: str):
    _assert_pipeline(grid_results, f"pipeline-{key}")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_img2img_pipeline_matches_one_process(grid_results):
    _assert_pipeline(grid_results, "img2img")


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: refusals -------------------------------------------------------------------


def _enabled_call(model, **kwargs):
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        return model(**kwargs)
    finally:
        ADAPTER.disable(model)


def test_controlnet_and_omni_arguments_are_refused():
    model, inputs = _build(SHAPES[1])
    for name, value in (("controlnet_block_samples", {0: torch.zeros(1)}), ("siglip_feats", [[None], [None]]),
                        ("image_noise_mask", [[1], [1]])):
        with pytest.raises(NotImplementedError, match=name):
            _enabled_call(model, **inputs.kwargs(), **{name: value})


def test_omni_mode_and_images_of_different_sizes_are_refused():
    model, inputs = _build(SHAPES[1])
    with pytest.raises(NotImplementedError, match="omni mode"):
        _enabled_call(model, x=[[x] for x in inputs.x], t=inputs.t, cap_feats=[[c] for c in inputs.cap_feats])
    other = zimage_inputs((3, 4), (20, 30))
    with pytest.raises(NotImplementedError, match="the same size"):
        _enabled_call(model, x=[inputs.x[0], other.x[1]], t=inputs.t, cap_feats=inputs.cap_feats)


def test_models_the_plan_cannot_split_are_refused():
    with pytest.raises(NotImplementedError, match="n_refiner_layers=0"):
        ADAPTER.enable(tiny_zimage(num_refiner_layers=0), single_rank_mesh(), "auto")
    from diffusers import ZImageTransformer2DModel

    two_patches = ZImageTransformer2DModel(all_patch_size=(2, 1), all_f_patch_size=(1, 1), in_channels=4, dim=32,
                                           n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=8,
                                           axes_dims=[4, 6, 6], axes_lens=[64, 16, 16])
    with pytest.raises(NotImplementedError, match="patch sizes"):
        ADAPTER.enable(two_patches, single_rank_mesh(), "auto")


test_diffusers_context_parallelism_is_refused = family_checks.context_parallelism_refused(
    tiny_zimage, ADAPTER, "layers.0.attention")
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_zimage, ADAPTER, zimage, "_RoutedZImageProcessor")
