"""NucleusMoE-Image adapter: sharded transformer outputs and gradients equal one process's, on CPU
gloo grids; the stock ``NucleusMoEImagePipeline`` through ``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``NucleusMoEImageTransformer2DModel`` (``usp_dit.demo.tiny_nucleus_moe``):
2 blocks, 4 query heads and 2 K/V heads x 16 (grouped-query attention), block 0 dense and block 1
an expert-choice MoE (4 experts, capacity factor 2: each expert takes half of a sample's tokens);
every weight perturbed, the packed experts drawn first. Shapes: 3 x 5 = 15 and 5 x 7 = 35 image
tokens (neither divides 2 or 4); batch 2 with a different prompt and timestep per element; 9 text
tokens with masks that have holes and differ per element (15), and no mask (35); RoPE from the
model's own (centred) positions.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
ring grids also with "stream" and "gather_merge" forced (tests/adapter_parity Note [schedules in
CI]). Each case: output vs stock, block 0's attention sees at most ceil(N / P) image queries, after
``disable`` the output is bit-identical; each rank's rotated image Q/K equal the same rows of one
process's (the text K all of them). Every parameter's gradient (the router's and the experts'
included) on 2 and 4 ranks, and with gradient checkpointing. The expert-choice routing couples
tokens: the same enabled model with the stock MoE forward on each shard (each expert's top-k over
the shard alone) is far from stock, so the cases above do see the routing (Note [expert-choice
routing on a shard]). The transformer enabled with cfg_degree=2 on the masked batch equals stock.
The fullgraph-compiled case (the all-dense variant: the MoE's expert loop reads counts on the host,
in stock too) is in tests/test_compile_grid.py (ADAPTER_CASES).

Pipeline: the tiny ``NucleusMoEImagePipeline`` (Qwen3-VL text encoder, character tokenizer with a
chat template, Qwen-Image VAE), two prompts and two negative prompts of different lengths (padded,
masked), 48 x 80 (15 image tokens), 2 steps, two transformer calls a step, on (2,1,1), (2,2,1) and
(1,2,2) (the first step's calls split over the cfg groups, then each step's two calls run on the two
groups: ``steps + 1`` computations per rank), equal to one process's; bit-identical after
``disable_usp``.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks, the router on fewer rows). Decoded images: 1e-4 (an untrained random VAE's
gain). The naive per-shard routing must be off by more than 1e-3.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_nucleusmoe_image

import usp_dit
from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_nucleus_moe import nucleus_moe_inputs, tiny_nucleus_moe, tiny_nucleus_moe_pipeline
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import nucleus_moe
from usp_dit.pipelines.families.nucleus_moe import ADAPTER, USPNucleusMoEAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
NAIVE_MIN = 1e-3  # the per-shard routing's error must exceed this (it is O(1) here)
WORLD = 4
STEPS = 2


@dataclass(frozen=True)
class Shape:
    variant: str
    height: int
    width: int
    masks: tuple | None  # per element: 0/1 per text token (holes allowed), or None

    @property
    def tokens(self) -> int:
        return self.height * self.width

    def __str__(self) -> str:
        return f"{self.variant}-{self.height}x{self.width}-{'mask' if self.masks else 'nomask'}"


_HOLES = ((1, 1, 0, 1, 1, 1, 0, 0, 0), (0, 1, 1, 1, 1, 1, 1, 1, 1))  # 5 and 8 valid, holes inside
SHAPES = [
    Shape("moe", 3, 5, _HOLES),  # 15 image tokens, masked prompts
    Shape("moe", 5, 7, None),  # 35 image tokens, no mask
    Shape("dense", 3, 5, _HOLES),  # every block dense: tests/test_compile_grid.py's fullgraph case
]
GRID_SHAPES = SHAPES[:2]


def _build(shape: Shape, seed: int = 0):
    model = tiny_nucleus_moe(shape.variant, seed=seed)
    masks = [list(m) for m in shape.masks] if shape.masks else None
    return model, nucleus_moe_inputs(model, shape.height, shape.width, masks)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with gradient checkpointing: the MoE's gather and top-k run again in the recompute."""
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _naive_routing_case(mesh) -> dict[str, float]:
    """Note [expert-choice routing on a shard]: with the stock MoE forward on each shard (its own
    top-k and capacity), the output is far from stock: 1.0 unless the error exceeds NAIVE_MIN."""
    model, inputs = _build(SHAPES[1])
    ref = parity.forward(model, inputs)
    ADAPTER.enable(model, mesh, "auto")
    try:
        moe = [b.img_mlp for b in model.transformer_blocks if b.moe_enabled]
        for layer in moe:
            del layer.forward  # the class's (stock) forward on this rank's tokens
        out = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    return {"naive_not_off": float(not rel_err(out, ref) > NAIVE_MIN), "no_moe_layer": float(not moe)}


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
    all of them (the 35-token shape, no mask: one usp_attention call a block)."""
    model, inputs = _build(SHAPES[1])
    q_ref, k_ref, _ = _first_call(model, inputs, transformer_nucleusmoe_image, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k, text_k = _first_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    image = SHAPES[1].tokens
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref[:, :image], mesh)),
            "text_k": rel_err(text_k, k_ref[:, image:])}


PROMPTS = (["a red fox jumps", "a cat"], ["blurry", "dark and dim"])  # of different lengths: padded, masked


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 48 x 80 (3 x 5 = 15 image tokens), two calls a step, seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(pipe, prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.0, height=48,
                              width=80, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0),
                              output_type="pt")


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_nucleus_moe_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS),
                                 probe=functools.partial(parity.cfg_pair_computations, steps=STEPS))


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, GRID_SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "naive-routing", lambda: _naive_routing_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    two_heads = tiny_nucleus_moe(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(GRID_SHAPES), parity.grad_keys(GRID_SHAPES) + ["grad-ckpt-p4"], TOL)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_per_shard_routing_would_be_wrong(grid_results):
    parity.assert_within(grid_results, "naive-routing", 0.0)


def test_cfg_split_of_a_masked_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES, "not_enabled_then_restored": 0.0,
                                                  "computations_not_steps_plus_1": 0.0}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: registration, restore exactly, loud failures ---------------------------------


test_find_adapter_finds_nucleus_moe = family_checks.adapter_found(tiny_nucleus_moe, ADAPTER)


def test_disable_restores_processors_moe_forwards_and_hooks():
    model, inputs = _build(SHAPES[0])
    parity.assert_disable_restores(model, inputs, ADAPTER, USPNucleusMoEAttnProcessor)
    assert not [m for m in model.modules() if "forward" in m.__dict__]


test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_nucleus_moe, ADAPTER, "transformer_blocks.1.attn")


def test_a_changed_moe_forward_is_refused(monkeypatch):
    monkeypatch.setattr(nucleus_moe, "_MOE_FORWARD_SHA256", "0" * 64)
    with pytest.raises(NotImplementedError, match="NucleusMoELayer.forward differs from the expert-choice routing"):
        ADAPTER.enable(tiny_nucleus_moe(), single_rank_mesh(), "auto")
    dense = tiny_nucleus_moe("dense")
    ADAPTER.enable(dense, single_rank_mesh(), "auto")  # no MoE layer: nothing to check
    ADAPTER.disable(dense)


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_nucleus_moe, ADAPTER, nucleus_moe, "_ROUTED_CALL")


def test_the_text_kv_cache_is_refused():
    from diffusers.hooks import TextKVCacheConfig

    model = tiny_nucleus_moe()
    model.enable_cache(TextKVCacheConfig())
    with pytest.raises(NotImplementedError, match="TextKVCacheConfig"):
        usp_dit.enable_usp(model, mesh=single_rank_mesh())


test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(
    tiny_nucleus_moe, ADAPTER, "NucleusMoE")
