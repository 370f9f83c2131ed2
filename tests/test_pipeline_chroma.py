"""Chroma adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Model: a tiny ``ChromaTransformer2DModel``
(2 double + 2 single blocks, 4 heads x 16 head_dim, every weight perturbed; ``usp_dit.demo.tiny_chroma``).
The text is split with the image (``usp_dit.pipelines.families.chroma``): shapes 6 text + 15 image = 21
tokens with the pipeline's float mask (prompts of 2 and 5 tokens: 3 and 6 unmasked text tokens),
6 + 21 = 27 with prompts of 1 and 4 tokens, and 8 + 25 = 33 without a mask; no joint count
divides 2 or 4; on 4 ranks rank 0 of the first holds the 6 text tokens and no image token. Batch 2
with different prompts, latents and timesteps; RoPE from Flux's real (0, h, w) image ids.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil((T + N) / P) tokens (text + image), after ``disable``
the output is bit-identical. Per shape, on 2 and 4 ranks: every parameter's gradient
(tests/adapter_parity.gradient_errors), and once with gradient checkpointing. Each rank's rotated
Q/K of block 0 equal the same rows of one process's. The transformer enabled with cfg_degree=2 on
a masked batch of 2 equals stock. Stock's float mask is additive (Note [Chroma's mask]): the
"masked" text tokens still count (e^-1), so the test also checks the output is not the one
without a mask (the mask path is exercised, not skipped).

Pipeline: the tiny ``ChromaPipeline`` (character T5 tokenizer and a 2-layer T5, all built in
code) with two prompts of different lengths and negative prompts (true CFG: **two** transformer
calls of batch 2 per step, each with its own mask), 12 text tokens, through ``pipe.enable_usp()``
on (U, R, cfg) = (2,1,1), (2,2,1) and (1,2,2), 2 steps, equal to one process's. On (1,2,2) the
first step's two calls each split their batch of two prompts over the cfg groups (masks included)
and the second step's two calls run on the two cfg groups at once (the family's
``cfg_branch_args``: ``usp_dit.pipelines.cfg_pair`` Note [two calls a step]). One prompt at
``cfg_degree=2`` (batch 1, nothing to split; the two calls paired): tests/test_cfg_pair.py.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients, rotated Q/K and the
pipeline's final latents: sharding only reorders float32 sums (attention blocks merged by
log-sum-exp, gradients summed over ranks; the mask's bias enters as one more product in the
scores). Decoded images: 1e-4 (an untrained random VAE's gain). Measured (2026-12-03): 5.4e-7 at most on outputs (all
grids and schedules), 2.5e-6 on the worst parameter gradient, 3.3e-7 with the cfg split, 1.2e-6 on
the pipeline's latents (1.4e-6 on its images), 2.4e-7 on the rotated Q/K (the projections' float32
sums over pieces of another length).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_flux

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_chroma import chroma_inputs, tiny_chroma, tiny_chroma_pipeline
from usp_dit.pipelines.families import chroma  # noqa: F401  (registers the adapter)
from usp_dit.pipelines.families.chroma import ADAPTER, USPChromaAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int
    width: int
    text_len: int
    prompts: tuple | None  # per element: prompt tokens (mask as the pipeline makes it), None: no mask

    @property
    def tokens(self) -> int:
        return self.text_len + self.height * self.width

    def __str__(self) -> str:
        return f"s{self.tokens}-" + ("nomask" if self.prompts is None else "mask" + "-".join(map(str, self.prompts)))


SHAPES = [
    Shape(3, 5, 6, (2, 5)),  # 6 + 15 = 21; 3 and 6 unmasked text tokens
    Shape(3, 7, 6, (1, 4)),  # 6 + 21 = 27
    Shape(5, 5, 8, None),  # 8 + 25 = 33, no mask
]


def _build(shape: Shape, seed: int = 0):
    model = tiny_chroma(seed=seed)
    prompts = list(shape.prompts) if shape.prompts else None
    return model, chroma_inputs(shape.height, shape.width, prompts, shape.text_len)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's attention length (text + image) vs ceil((T + N) / P), bit-identity after disable."""
    model, inputs = _build(shape)
    return parity.joint_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with gradient checkpointing (the blocks recomputed on this rank's pieces)."""
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _first_attention_call(model, inputs, module, name: str) -> dict:
    """Q and K of the first call of ``module.name`` in a forward (block 0's attention)."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append({"q": q.clone(), "k": k.clone()})
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated Q/K of block 0 (its first head_dim columns: Note [Chroma's mask] extends
    them) equal rows [lo, hi) of one process's joint [text; image] Q/K."""
    model, inputs = _build(SHAPES[1])
    ref = _first_attention_call(model, inputs, transformer_flux, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        got = _first_attention_call(model, inputs, chroma, "usp_attention")
    finally:
        ADAPTER.disable(model)
    head_dim = ref["q"].shape[-1]
    return {
        "q": rel_err(got["q"][..., :head_dim], shard_sequence(ref["q"], mesh)),
        "k": rel_err(got["k"][..., :head_dim], shard_sequence(ref["k"], mesh)),
    }


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2 (usp_dit.enable_usp on the model): its masked
    batch of 2 split over the cfg groups, equal to stock."""
    return parity.cfg_split_case(*_build(SHAPES[0]), mesh)


PROMPTS = (["a red fox", "cat"], ["blurry", "dark dim"])  # of different lengths: padded, masked


def _generate(pipe, prompts: tuple = PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 12 x 20 (3 x 5 = 15 image tokens), 12 text tokens,
    true CFG (two transformer calls per step), seed 0."""
    prompt, negative_prompt = prompts
    return parity.latents_and(
        pipe,
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.0, max_sequence_length=12, height=12,
        width=20, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt",
    )


# the last: cfg split (step 1), then the calls paired
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_chroma_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS))


def _run_all() -> dict[str, dict | str]:
    warnings.filterwarnings("ignore", category=FutureWarning)  # FluxPosEmbed's deprecation, once per forward
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    two_heads = tiny_chroma(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_cfg_split_of_a_masked_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: registration, the mask's effect, restore exactly, loud failures ---------------


test_find_adapter_finds_chroma = family_checks.adapter_found(tiny_chroma, ADAPTER)


def test_the_float_mask_changes_the_output_and_is_kept():
    """Stock's float mask is additive (Note [Chroma's mask]): the output differs from the unmasked
    one, and the enabled model (one rank, the extended Q/K path) gives stock's masked output."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    unmasked = parity.forward(model, chroma_inputs(3, 5, None, 6))
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    assert rel_err(unmasked, ref) > 1e-2
    assert rel_err(out, ref) <= TOL


test_disable_restores_processors_forward_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPChromaAttnProcessor)


def test_enable_twice_and_disable_unpatched_raise():
    model = tiny_chroma()
    with pytest.raises(ValueError, match="not sequence-parallel"):
        ADAPTER.disable(model)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    with pytest.raises(ValueError, match="already sequence-parallel"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")
    ADAPTER.disable(model)


test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_chroma, ADAPTER, "single_transformer_blocks.1.attn")
test_diffusers_context_parallelism_is_refused = family_checks.context_parallelism_refused(
    tiny_chroma, ADAPTER, "transformer_blocks.0.attn")


def test_unsupported_diffusers_cache_is_refused():
    from diffusers import FasterCacheConfig  # (the supported caches: tests/test_caches.py)

    model = tiny_chroma()
    model.enable_cache(FasterCacheConfig(current_timestep_callback=lambda: 500))
    with pytest.raises(NotImplementedError, match="diffusers cache"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


test_no_layers_is_refused = family_checks.no_blocks_refused(
    lambda: tiny_chroma(num_layers=0, num_single_layers=0), ADAPTER)


def _refused_call(change: dict, error: type, match: str) -> None:
    model, inputs = _build(SHAPES[0])
    kwargs = {**inputs.kwargs(), **change}
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(error, match=match):
            model(**kwargs)
    finally:
        ADAPTER.disable(model)


def test_a_bool_mask_with_masked_tokens_is_refused():
    mask = chroma_inputs(3, 5, [2, 5], 6).attention_mask.bool()
    _refused_call({"attention_mask": mask}, NotImplementedError, "bool attention_mask with masked tokens")


def test_mask_values_other_than_0_and_1_are_refused():
    mask = chroma_inputs(3, 5, [2, 5], 6).attention_mask * 0.5
    _refused_call({"attention_mask": mask}, NotImplementedError, "values 0 and 1 only")


def test_a_mask_of_another_length_is_refused():
    mask = chroma_inputs(3, 5, [2, 5], 6).attention_mask[:, :-1]
    _refused_call({"attention_mask": mask}, ValueError, r"attention_mask must be \(batch, text \+ image tokens\)")


def test_controlnet_residuals_are_refused():
    residual = torch.zeros(2, 15, 64)
    _refused_call({"controlnet_block_samples": [residual]}, NotImplementedError, "controlnet_block_samples")


def test_ip_adapter_is_refused():
    _refused_call({"joint_attention_kwargs": {"ip_adapter_image_embeds": [torch.zeros(2, 8)]}}, NotImplementedError,
                  "IP-Adapter")


def test_processor_swapped_after_enable_is_refused_at_the_call():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        model.transformer_blocks[1].attn.set_processor(FluxAttnProcessor())
        with pytest.raises(NotImplementedError, match="became FluxAttnProcessor after enable_usp"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_chroma, ADAPTER, chroma, "_ROUTED_CALL")
