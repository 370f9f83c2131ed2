"""FLUX.3 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case. Models: tiny ``Flux3Transformer2DModel`` s (1 per-mode
block per mode, 2 single blocks, 4 heads x 16 head_dim, every weight perturbed:
``usp_dit.demo.tiny_flux3``). Shapes (Note [FLUX.3's per-mode split]: each mode split on its own):
t2i (a 5 x 7 image: 35 tokens, 7 text tokens) and image-to-image with the step-distilled flow map
(``target_timestep``; 35 image + a 3 x 3 reference: 9, 5 text tokens). No count divides 2 or 4. Batch 2 with a different prompt and
timestep per element; the position ids are the pipeline's layout (image grid at t = 0, references
at t = 1, text along l). FLUX.3 takes no prompt mask.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced. Each case: output vs stock, block 0 of the
single blocks sees at most ceil(T / P) + ceil(N / P) + ceil(M / P) tokens, bit-identical output
after ``disable``. Per shape, on 2 and on 4 ranks: every parameter's gradient
(tests/adapter_parity.gradient_errors), and once with gradient checkpointing. The transformer
enabled with cfg_degree=2 (the batch split over cfg) equals stock.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and gradients: sharding only reorders
float32 sums (attention blocks merged by log-sum-exp, gradients summed over ranks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_flux3 import flux3_inputs, tiny_flux3
from usp_dit.pipelines.families import flux3
from usp_dit.pipelines.families.flux3 import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str  # "t2i", "i2i" or "flow-map"
    text: int
    reference: tuple | None  # (h, w) of the reference image

    def __str__(self) -> str:
        return f"{self.variant}-t{self.text}"


SHAPES = [Shape("t2i", 7, None), Shape("flow-map", 5, (3, 3))]
H, W = 5, 7


def _build(shape: Shape, seed: int = 0):
    model = tiny_flux3(flow_map=shape.variant == "flow-map", seed=seed)
    return model, flux3_inputs(model, 2, H, W, shape.text, shape.reference, seed=seed)


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, single block 0's attention length vs the per-mode ceilings, bit-identity after disable."""
    model, inputs = _build(shape)
    ref = parity.forward(model, inputs)
    p = mesh.sequence_degree
    counts = [shape.text, H * W] + ([math.prod(shape.reference)] if shape.reference else [])
    bound = sum(math.ceil(n / p) for n in counts)
    lengths = []
    hook = model.single_transformer_blocks[0].attn.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(kwargs.get("hidden_states", args[0] if args else None).shape[1]),
        with_kwargs=True)
    ADAPTER.enable(model, mesh, "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)
    return {
        "out": rel_err(out, ref),
        "single0_tokens_above": float(not lengths or max(lengths) > bound),
        "disable_not_bit_identical": float(not torch.equal(parity.forward(model, inputs), ref)),
    }


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[1])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _cfg_split_case(mesh) -> dict[str, float]:
    return parity.cfg_split_case(*_build(SHAPES[1]), mesh)


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    two_heads = tiny_flux3(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_cfg_split_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: registration, refusals ---------------------------------------------------


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_flux3, ADAPTER, flux3, "_ROUTED_CALL")


def test_ids_unlike_the_tokens_are_refused():
    model, inputs = _build(SHAPES[0])
    inputs.img_ids = inputs.img_ids[:-1]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="img_ids has 34 rows but hidden_states has 35 tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)

