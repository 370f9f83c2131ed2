"""Flux.2 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Models: tiny ``Flux2Transformer2DModel`` s
(2 double + 2 single blocks, 4 heads x 16 head_dim, every weight perturbed; ``usp_dit.demo.tiny_flux2``):
FLUX.2-dev (guidance embedded) text-to-image (6 text + 15 image tokens = 21) and image editing
(a 3 x 5 target and a 3 x 4 reference image at t = 10: 6 + 27 = 33), and FLUX.2-klein (no
guidance) with the KV processors ``Flux2KleinKVPipeline`` installs, run without KV modes (6 + 21 =
27). The text is split with the image (Note [Flux.2 token split]): no joint count divides 2 or 4;
on 4 ranks rank 0 of t2i holds the 6 text tokens and no image token (6, 5, 5, 5), on 2 ranks text
and image are mixed. Batch 2 with different prompts, latents, timesteps and guidance; RoPE from the
pipeline's real 4-axis position ids (h, w; the reference's t = 10; the text's l), never zeros.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil((T + N) / P) tokens (text + image: the text is split),
after ``disable`` the output is bit-identical. Per variant, on 2 and 4 ranks: every parameter's
gradient (tests/adapter_parity.gradient_errors), and once with gradient checkpointing. Each rank's
rotated Q/K of block 0 equal the same rows of one process's joint [text; image] Q/K. The
transformer enabled with cfg_degree=2 on a batch of 2 equals stock.

Pipeline: ``Flux2Pipeline`` is guidance-distilled: **one** transformer call per step, batch = the
prompts. Built tiny in code (``usp_dit.demo.tiny_flux2``): a 3-layer Mistral-3 text encoder and a
character tokenizer with a Mistral-like chat template standing in for the Pixtral processor (the
pipeline calls only its ``apply_chat_template``; PixtralProcessor needs torchvision). Two prompts
of different lengths, padded to 192 text tokens (the system message is ~170: the transformer sees
192 + 15 = 207 tokens; on 4 ranks three hold text only). Through ``pipe.enable_usp()`` on
(U, R, cfg) = (2,1,1), (2,2,1) and (1,2,2) (the cfg split halves the batch of two prompts),
2 steps, equal to one process's; with one prompt on (1,2,2) each call runs whole on both cfg
groups (batch 1: nothing to split, and one call a step: nothing to pair), equal to one process's,
one computation a step and none speculated. ``Flux2KleinPipeline``'s two calls a step at
``cfg_degree=2`` (``cfg_branch_args``): tests/test_cfg_pair.py.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients, rotated Q/K and the
pipeline's final latents: sharding only reorders float32 sums (attention blocks merged by
log-sum-exp, gradients summed over ranks). Decoded images: 1e-4 (an untrained random VAE's gain,
as in tests/test_pipeline_qwen_image.py). Measured (2026-12-03): 5.5e-7 at most on outputs (all grids
and schedules), 1.4e-6 on the worst parameter gradient, 5.0e-7 with the cfg split, 3.2e-7 on the
pipeline's latents (8.6e-7 on its images), 0 on the rotated Q/K.
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_flux2
from diffusers.models.transformers.transformer_flux2 import Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_flux2 import MISTRAL_LAYERS, flux2_inputs, tiny_flux2, tiny_flux2_pipeline
from usp_dit.pipelines import _routing
from usp_dit.pipelines.base import find_adapter
from usp_dit.pipelines.families import flux2  # noqa: F401  (registers the adapter)
from usp_dit.pipelines.families.flux2 import ADAPTER, USPFlux2AttnProcessor, USPFlux2SelfAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4
TEXT_LEN = 6


@dataclass(frozen=True)
class Shape:
    variant: str  # "dev", or "klein-kv": klein with Flux2KleinKVPipeline's KV processors
    images: tuple  # (h, w) patch grids: the target, then reference images

    @property
    def tokens(self) -> int:
        return TEXT_LEN + sum(h * w for h, w in self.images)

    def __str__(self) -> str:
        return f"{self.variant}-{len(self.images)}img-s{self.tokens}"


SHAPES = [
    Shape("dev", ((3, 5),)),  # 6 + 15 = 21
    Shape("dev", ((3, 5), (3, 4))),  # 6 + 27 = 33: a reference image at t = 10
    Shape("klein-kv", ((3, 7),)),  # 6 + 21 = 27
]


def _build(shape: Shape, seed: int = 0):
    model = tiny_flux2("klein" if shape.variant == "klein-kv" else "dev", seed=seed)
    if shape.variant == "klein-kv":  # what Flux2KleinKVPipeline._set_kv_attn_processors does
        for block in model.transformer_blocks:
            block.attn.set_processor(Flux2KVAttnProcessor())
        for block in model.single_transformer_blocks:
            block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    return model, flux2_inputs(model, list(shape.images), TEXT_LEN)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, block 0's attention length (text + image) vs ceil((T + N) / P), bit-identity after disable."""
    model, inputs = _build(shape)
    return parity.joint_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with gradient checkpointing (the blocks recomputed on this rank's pieces)."""
    model, inputs = _build(SHAPES[1])
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
    """Each rank's rotated Q/K of block 0 equal rows [lo, hi) of one process's joint [text; image]
    Q/K (editing: the reference image's t = 10 ids rotate its rows)."""
    model, inputs = _build(SHAPES[1])
    ref = _first_attention_call(model, inputs, transformer_flux2, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        got = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {name: rel_err(got[name], shard_sequence(ref[name], mesh)) for name in ("q", "k")}


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2 (usp_dit.enable_usp on the model): its batch of 2
    split over the cfg groups (ids whole), equal to stock."""
    return parity.cfg_split_case(*_build(SHAPES[1]), mesh)


PROMPTS = ["a red fox jumps", "a cat"]


def _generate(pipe, prompts: list[str] = PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 12 x 20 (3 x 5 = 15 image tokens), 192 text tokens,
    guidance 3.5, seed 0."""
    return parity.latents_and(
        pipe,
        prompt=prompts, text_encoder_out_layers=MISTRAL_LAYERS, max_sequence_length=192, guidance_scale=3.5,
        height=12, width=20, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt",
    )


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last splits the batch of 2 prompts over cfg


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_flux2_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS))


def _pipeline_cfg_case() -> dict[str, float]:
    """cfg_degree=2 on Flux2Pipeline with one prompt: one transformer call of batch 1 per step (the
    guidance is embedded, not batched), nothing to split and no second guidance call to pair (the
    family declares cfg_branch_args for Flux2KleinPipeline's two calls: tests/test_cfg_pair.py).
    Each call runs whole on both cfg groups: equal to one process, 2 computations in 2 steps, none
    speculated."""
    pipe = tiny_flux2_pipeline()
    pipe.set_progress_bar_config(disable=True)
    ref_latents, ref_images = _generate(pipe, ["a red fox"])
    pipe.enable_usp(ring_degree=2, cfg_degree=2)
    pair = pipe.transformer._usp_dit_state.cfg_pair
    try:
        latents, images = _generate(pipe, ["a red fox"])
        stats = dict(pair.stats)
    finally:
        pipe.disable_usp()
    return {
        "latents": rel_err(latents, ref_latents), "images": rel_err(images, ref_images),
        "not_whole_on_both_groups": float(stats != dict(computed=2, speculated=0, served=0, dropped=0)),
    }


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    two_heads = tiny_flux2(num_heads=2, head_dim=32)
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


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_cfg_split_of_a_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_cfg_parallel_with_one_prompt_runs_whole_on_both_cfg_groups(grid_results):
    for rank, res in enumerate(grid_results):
        errors = res["pipeline-cfg2"]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        tols = {"latents": TOL, "images": TOL_IMAGES, "not_whole_on_both_groups": 0.0}
        worst = {name: v for name, v in errors.items() if not v <= tols[name]}
        assert not worst, f"rank {rank}: above {tols}: {worst}"


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: registration, restore exactly, loud failures --------------------------------


@pytest.mark.parametrize("variant", ["dev", "klein"])
def test_find_adapter_finds_flux2(variant: str):
    assert find_adapter(tiny_flux2(variant)) is ADAPTER


def test_disable_restores_processors_forward_and_hooks():
    model, inputs = _build(SHAPES[2])
    before = [m.processor for m in model.modules() if hasattr(m, "processor")]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    assert all(isinstance(b.attn.processor, USPFlux2AttnProcessor) for b in model.transformer_blocks)
    assert all(isinstance(b.attn.processor, USPFlux2SelfAttnProcessor) for b in model.single_transformer_blocks)
    parity.forward(model, inputs)
    ADAPTER.disable(model)
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == before
    assert "forward" not in model.__dict__
    hooked = [type(m).__name__ for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not hooked, f"hooks left on {hooked}"


def test_enable_twice_and_disable_unpatched_raise():
    model = tiny_flux2()
    with pytest.raises(ValueError, match="not sequence-parallel"):
        ADAPTER.disable(model)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    with pytest.raises(ValueError, match="already sequence-parallel"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")
    ADAPTER.disable(model)


test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_flux2, ADAPTER, "single_transformer_blocks.1.attn")
test_diffusers_context_parallelism_is_refused = family_checks.context_parallelism_refused(
    tiny_flux2, ADAPTER, "transformer_blocks.0.attn")


def test_unsupported_diffusers_cache_is_refused():
    from diffusers import FasterCacheConfig  # (the supported caches: tests/test_caches.py)

    model = tiny_flux2()
    model.enable_cache(FasterCacheConfig(current_timestep_callback=lambda: 500))
    with pytest.raises(NotImplementedError, match="diffusers cache"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


test_no_layers_is_refused = family_checks.no_blocks_refused(
    lambda: tiny_flux2(num_layers=0, num_single_layers=0), ADAPTER)


@pytest.mark.parametrize("layers", [(0, 2), (2, 0)])
def test_one_kind_of_block_alone_matches_stock(layers):
    """num_layers=0 or num_single_layers=0: the split is at the forward's arguments, not at a block."""
    model = tiny_flux2(num_layers=layers[0], num_single_layers=layers[1])
    inputs = flux2_inputs(model, [(3, 5)], TEXT_LEN)
    ref = parity.forward(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kv", [
    dict(kv_cache_mode="extract", num_ref_tokens=12),
    dict(joint_attention_kwargs={"kv_cache_mode": "cached"}),
])
def test_kv_cache_modes_are_refused(kv):
    model, inputs = _build(Shape("klein-kv", ((3, 5), (3, 4))))
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="KV-cache modes"):
            model(**inputs.kwargs(), **kv)
    finally:
        ADAPTER.disable(model)


def test_processor_swapped_after_enable_is_refused_at_the_call():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        model.transformer_blocks[1].attn.set_processor(Flux2KVAttnProcessor())
        with pytest.raises(NotImplementedError, match="became Flux2KVAttnProcessor after enable_usp"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_ids_unlike_the_tokens_are_refused():
    model, inputs = _build(SHAPES[0])
    inputs.img_ids = inputs.img_ids[:, :12]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="img_ids has 12 rows but hidden_states has 15 tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_flux2, ADAPTER, flux2, "_RoutedFlux2SelfAttn")
