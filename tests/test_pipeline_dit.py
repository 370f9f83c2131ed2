"""DiT adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids;
the stock ``DiTPipeline`` through ``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny class-conditional ``DiTTransformer2DModel`` (``usp_dit.demo.tiny_dit``): 2
blocks, 4 heads x 16, 2x2 patches, learned sigma (8 output channels), every weight perturbed.
Shapes: 10 x 10 latents (5 x 5 = 25 tokens) and 6 x 6 (3 x 3 = 9); DiT folds its output as a
square, so the odd counts are squares (neither divides 2 or 4). Batch 2 with a different latent,
timestep and class per element (one of them the null class, as CFG's uncond half); the sin-cos
position table is added before the split.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
ring grids also with "stream" and "gather_merge" forced (tests/adapter_parity Note [schedules in
CI]). Each case: output vs stock, block 0's attention sees at most ceil(N / P) tokens, after
``disable`` the output is bit-identical. Every parameter's gradient on 2 and 4 ranks, and with
gradient checkpointing. The transformer enabled with cfg_degree=2 on its batch equals stock. The
fullgraph-compiled case is in tests/test_compile_grid.py (ADAPTER_CASES). Tensor parallelism
(issue 28) on a 5-head model without attention biases (uneven over 2 tensor ranks: 3 heads a rank,
one of them zero padding): T=2 alone, with U=2, with R=2 (gather_merge), outputs and the restored
parameters; every gradient on (R=2, T=2), each cut parameter's gathered back
(tests/test_tensor_parallel.py's cases, reused).

Pipeline: the tiny ``DiTPipeline`` (2x AutoencoderKL, DPM-Solver++), two class labels, 20 x 20
pixels (25 tokens), 2 steps of batched CFG on the label ([cond, null] in one call of batch 4), on
(2,1,1), (2,2,1) and (1,2,2) (the halves split over the cfg groups), equal to one process's
(the latents the VAE decodes, and the images); bit-identical after ``disable_usp``.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks); the attention's key biases, whose gradient is zero by maths (rounding noise in
stock too), against their ``to_k.weight`` gradient's scale. Decoded images: 1e-4 (an untrained
random VAE's gain).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_dit import NUM_CLASSES, dit_inputs, tiny_dit, tiny_dit_pipeline
from usp_dit.pipelines.families.dit import ADAPTER
from usp_dit.pipelines.families.pixart import USPPixArtSelfAttnProcessor

TOL = 1e-5
# Gradients under tensor parallelism (1,2,1,2): each row-parallel projection's output, and each
# column-parallel one's input gradient, is a sum of two partial products all-reduced in float32, an
# order stock never uses: 1.09e-5 measured on an AVX2 CPU (below 1e-5 on an AVX-512 one).
TOL_TP_GRAD = 2e-5
# Key biases: zero gradient by maths (softmax ignores a shift shared by a query row's keys), float32
# rounding noise (~1e-8) in stock too; measured against their ``to_k.weight`` gradient's scale.
KEY_BIASES = r"transformer_blocks\.\d+\.attn1\.to_k\.bias"
TOL_IMAGES = 1e-4
WORLD = 4
STEPS = 2


@dataclass(frozen=True)
class Shape:
    size: int  # latent side; (size / 2) ** 2 tokens
    labels: tuple[int, ...]  # one class per element (NUM_CLASSES: the null class)

    @property
    def tokens(self) -> int:
        return (self.size // 2) ** 2

    def __str__(self) -> str:
        return f"s{self.tokens}"


SHAPES = [
    Shape(10, (3, NUM_CLASSES)),  # 25 tokens; a class and the null class
    Shape(6, (7, 42)),  # 9 tokens
]


def _build(shape: Shape, seed: int = 0):
    return tiny_dit(sample_size=shape.size, seed=seed), dit_inputs(shape.size, list(shape.labels))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, shape.tokens)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    """Gradients with gradient checkpointing (the blocks recomputed on this rank's tokens)."""
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh, KEY_BIASES)


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents the VAE decodes, images) of 2 steps at 20 x 20 (25 tokens), batched CFG on the label, seed 0."""
    return parity.decoded_latents_and(pipe, class_labels=[1, 7], guidance_scale=4.0, num_inference_steps=STEPS,
                                      generator=torch.Generator().manual_seed(0), output_type="pt")


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_dit_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS))


# Tensor parallelism (issue 28), 5 heads (uneven over 2 tensor ranks): (U, R, cfg, T, schedule).
TENSOR_GRIDS = [(1, 1, 1, 2, "auto"), (2, 1, 1, 2, "auto"), (1, 2, 1, 2, "gather_merge")]


def _tensor_cases() -> dict[str, dict[str, float]]:
    """tests/test_tensor_parallel.py's cases: outputs, restored parameters, every gradient (the
    attention without biases here: its key bias's gradient is zero by maths, rounding noise)."""
    from tests import test_tensor_parallel as tp

    model = tiny_dit(num_heads=5, attention_bias=False)
    args = tp.Args(dit_inputs(10, list(SHAPES[0].labels)).kwargs())
    results = {f"tensor-{g}": tp._output_case(model, args, g) for g in TENSOR_GRIDS}
    results["grad-tensor-(1,2,1,2)"] = tp._grad_case(model, args, (1, 2, 1, 2, "stream"))
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.record(results, "tensor", _tensor_cases, many=True)
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh, KEY_BIASES))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    two_heads = tiny_dit(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL)


@pytest.mark.parametrize("key", [f"tensor-{g}" for g in TENSOR_GRIDS] + ["grad-tensor-(1,2,1,2)"])
def test_tensor_parallel_matches_one_process(grid_results, key: str):
    for rank, res in enumerate(grid_results):
        errors = res.get(key) or res.get("tensor", "no result")
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        assert errors.get("local_heads", 3.0) == 3.0 or key.startswith("grad"), errors  # ceil(5 / 2) heads a rank
        tol = TOL_TP_GRAD if key.startswith("grad") else TOL
        worst = {k: v for k, v in errors.items() if k not in ("local_heads", "single_widths") and not k.startswith("worst_is_") and not v <= tol}
        assert not worst, f"rank {rank}: above {tol}: {worst}"


def test_cfg_split_of_a_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES, "not_enabled_then_restored": 0.0},
                         fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: registration, restore exactly, loud failures ----------------------------------


test_find_adapter_finds_dit = family_checks.adapter_found(tiny_dit, ADAPTER)
test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPPixArtSelfAttnProcessor)
test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_dit, ADAPTER, "transformer_blocks.1.attn1", AttnProcessor)


def test_a_block_of_another_kind_is_refused():
    model = tiny_dit()
    model.transformer_blocks[0].norm_type = "ada_norm_single"
    with pytest.raises(NotImplementedError, match="transformer_blocks.0 has norm_type='ada_norm_single'"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


test_no_blocks_is_refused = family_checks.no_blocks_refused(lambda: tiny_dit(num_layers=0), ADAPTER)


def test_label_dropout_in_training_is_refused_at_the_call():
    """Each rank would draw its own label drops; in eval mode (or with the drops off) it runs."""
    model, inputs = _build(SHAPES[1])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        model.train()
        with pytest.raises(NotImplementedError, match="drops class labels at random in training mode"):
            parity.forward(model, inputs)
        for block in model.transformer_blocks:
            block.norm1.emb.class_embedder.dropout_prob = 0.0
        parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)

