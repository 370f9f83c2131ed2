"""PRX adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids;
the stock ``PRXPipeline`` through ``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``PRXTransformer2DModel`` (``usp_dit.demo.tiny_prx``): 2 blocks, 4 heads x
16, every weight perturbed (stock zero-initialises the modulation). Shapes: the "prx" variant at
5 x 7 = 35 image tokens with 8 text tokens masked to 3 and 6 real ones (padding at the end, as the
pipeline's tokenizer pads); the "pixel" variant (PRX-7B's bottleneck patch embedding and resolution
conditioning) at 3 x 5 = 15 image tokens, no mask; neither count divides 2 or 4. Batch 2 with a
different latent, prompt and timestep per element; RoPE from the model's own (row, col) ids.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
ring grids also with "stream" and "gather_merge" forced (tests/adapter_parity Note [schedules in
CI]). Each case: output vs stock, block 0's attention sees at most ceil(N / P) image queries, after
``disable`` the output is bit-identical. Every parameter's gradient on 2 and 4 ranks, and with
gradient checkpointing. Each rank's rotated image Q/K of block 0 equal the same rows of one
process's, its text K all of them. The transformer enabled with cfg_degree=2 on the masked batch
equals stock. The fullgraph-compiled case is in tests/test_compile_grid.py (ADAPTER_CASES).

Pipeline: the tiny ``PRXPipeline`` (character T5 tokenizer, T5Gemma encoder, 2x AutoencoderKL), one
prompt and a negative prompt of different lengths padded to 16 tokens and masked, 12 x 20 pixels
(3 x 5 = 15 image tokens), 2 steps of batched CFG ([uncond, cond] in one call; stock's timestep is
batch 2 only for one prompt), on (2,1,1), (2,2,1) and (1,2,2) (the CFG halves split over the cfg
groups), equal to one process's; bit-identical after ``disable_usp``. ``PRXPixelPipeline`` (the "pixel"
transformer, no VAE) at 6 x 10 pixels (15 tokens), prompt embeddings of 5 and 11 real tokens of 16
(its cleaner needs ftfy, not installed here), on (2,2,1) and (1,2,2); its pixels after ``disable_usp``
bit-identical.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients, rotated Q/K and the
pipeline's final latents: sharding only reorders float32 sums (attention blocks merged by
log-sum-exp, gradients summed over ranks). Decoded images: 1e-4 (an untrained random VAE's gain).
The mask must change the output by more than 1e-3 (the masked path is exercised).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_prx

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_prx import TEXT_DIM, prx_inputs, tiny_prx, tiny_prx_pipeline, tiny_prx_pixel_pipeline
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import prx
from usp_dit.pipelines.families.prx import ADAPTER, USPPRXAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
MASK_MIN = 1e-3  # the mask's effect on the output must exceed this
WORLD = 4
STEPS = 2
TEXT_LEN = 8


@dataclass(frozen=True)
class Shape:
    variant: str
    height: int
    width: int
    prompts: tuple | None  # per element: real prompt tokens (the rest padding, masked), or None: no mask

    @property
    def tokens(self) -> int:
        return self.height * self.width

    def __str__(self) -> str:
        return f"{self.variant}-{self.height}x{self.width}-{'mask' if self.prompts else 'nomask'}"


SHAPES = [
    Shape("prx", 5, 7, (3, 6)),  # 35 image tokens, masked prompts of different lengths
    Shape("pixel", 3, 5, None),  # 15 image tokens, no mask
]


def _build(shape: Shape, seed: int = 0):
    model = tiny_prx(shape.variant, seed=seed)
    prompts = list(shape.prompts) if shape.prompts else None
    return model, prx_inputs(shape.height, shape.width, prompts, TEXT_LEN, channels=model.config.in_channels)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.blocks[0].attention, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with gradient checkpointing (the blocks recomputed on this rank's tokens)."""
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _first_call(model, inputs, module, name: str) -> tuple[torch.Tensor, ...]:
    """(q, k, joint_k) of the first call of ``module.name`` in a forward (joint_k None for stock's)."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone(), kwargs.get("joint_k")))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated image Q/K of block 0 equal the same rows of one process's, its text K
    all of them (the unmasked shape: one usp_attention call a block)."""
    model, inputs = _build(SHAPES[1])
    q_ref, k_ref, _ = _first_call(model, inputs, transformer_prx, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k, text_k = _first_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref[:, TEXT_LEN:], mesh)),
            "text_k": rel_err(text_k, k_ref[:, :TEXT_LEN])}


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 12 x 20 (3 x 5 = 15 image tokens), batched CFG, seed 0."""
    return parity.latents_and(pipe, prompt="a red fox", negative_prompt="dim", guidance_scale=4.0, height=12, width=20,
                              num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="pt",
                              use_resolution_binning=False)


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_prx_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS))


def _generate_pixel(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final pixels, images) of PRXPixelPipeline, 2 steps at 6 x 10 (15 tokens), batched CFG over
    seeded prompt embeddings of 5 and 11 real tokens of 16 (its cleaner needs ftfy: no prompts)."""
    g = torch.Generator().manual_seed(3)
    embeds = [torch.randn(1, 16, TEXT_DIM, generator=g) for _ in range(2)]
    masks = [torch.arange(16)[None] < n for n in (5, 11)]
    return parity.latents_and(pipe, prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1],
                              prompt_attention_mask=masks[0],
                              negative_prompt_attention_mask=masks[1], guidance_scale=4.0, height=6, width=10,
                              num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="pt",
                              use_resolution_binning=False)


PIXEL_GRIDS = [(2, 2, 1), (1, 2, 2)]


def _pixel_pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_prx_pixel_pipeline(), _generate_pixel,
                                 parity.pipeline_grids(PIXEL_GRIDS, "pixel"),
                                 after_disable="pixel-after-disable")


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    two_heads = tiny_prx(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    parity.record(results, "pixel", _pixel_pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_cfg_split_of_a_masked_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES, "not_enabled_then_restored": 0.0},
                         fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


@pytest.mark.parametrize("key", [f"pixel-u{u}r{r}cfg{c}" for u, r, c in PIXEL_GRIDS] + ["pixel-after-disable"])
def test_pixel_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"not_enabled_then_restored": 0.0, "not_bit_identical": 0.0},
                         fallback="pixel")


# ---- single process: registration, the mask's effect, restore exactly, loud failures ---------------


test_find_adapter_finds_prx = family_checks.adapter_found(tiny_prx, ADAPTER)


def test_the_mask_changes_the_output_and_is_kept():
    """The padded prompts' mask matters (so the grid cases exercise it), and the enabled model on
    one rank (the routed call, per-element masked text keys) gives stock's masked output."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    unmasked = parity.forward(model, prx_inputs(5, 7, None, TEXT_LEN, channels=model.config.in_channels))
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    assert rel_err(unmasked, ref) > MASK_MIN
    assert rel_err(out, ref) <= TOL


test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPPRXAttnProcessor)
test_foreign_processor_is_refused = family_checks.foreign_processor_refused(tiny_prx, ADAPTER, "blocks.1.attention")
test_diffusers_context_parallelism_is_refused = family_checks.context_parallelism_refused(
    tiny_prx, ADAPTER, "blocks.0.attention")
test_no_blocks_is_refused = family_checks.no_blocks_refused(lambda: tiny_prx(depth=0), ADAPTER)
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_prx, ADAPTER, prx, "_ROUTED_CALL")
test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(tiny_prx, ADAPTER, "PRX")
