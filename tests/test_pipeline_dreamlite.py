"""DreamLite adapter: sharded outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids as two data-parallel replicas).
Models: tiny ``DreamLiteTransformer2DModel`` s (2 layers, 4 query heads and 2 kv heads of 8, RMS QK
norm, feed-forward x6, every weight perturbed; ``DreamLiteAttnProcessor2_0`` everywhere, as
``DreamLiteUNetModel`` installs it; ``usp_dit.demo.tiny_dreamlite``) in two variants: with
self-attention and 1x1-conv projections on a 5 x 7 map, and DreamLite's "remove self-attention"
blocks with linear projections on 3 x 3. Neither 35 nor 9 divides 2 or 4; batch 2 with different
maps and prompts; text masks of different valid lengths per element (3 and 6; 7 and 2 of 7). The
GroupNorm before the split takes its statistics over the whole map (it runs whole on every rank).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with the
"stream" and "gather_merge" schedules forced (tests/adapter_parity.kept_in_ci). Each case: output vs
stock, block 0's attention sees at most ceil(tokens / P) tokens, after ``disable`` the output is
bit-identical; on (2,2,1) the routed self-attention gets K/V with the 2 kv heads (GQA: not the 4
repeated ones). Every parameter's gradient on 2 and 4 ranks per variant, and with gradient
checkpointing; the block through ``enable_usp`` with cfg_degree=2 (its batch split). The U-Net
(Note [DreamLite's pipelines]): a tiny 2-level ``DreamLiteUNetModel`` on a 10 x 14 latent (140 and
35 tokens at its levels, 7 DreamLite blocks, with and without self-attention, one kv head) with
every block enabled on one mesh, (2,2,1) and (4,1,1), equals one process's; after ``disable_usp``
bit-identical. The fullgraph-compiled case is in tests/test_compile_grid.py (ADAPTER_CASES).
``DreamLitePipeline`` itself (Qwen3-VL text encoder) is not run: ``pipe.enable_usp`` refuses U-Net
pipelines, and the U-Net is what it would call.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and gradients: sharding only reorders
float32 sums (attention merged by log-sum-exp over blocks of keys; the cross-attention is the stock
arithmetic per query row; gradients summed over ranks).
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import disable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_dreamlite import (
    dreamlite_inputs,
    dreamlite_unet_inputs,
    enable_usp_on_unet_blocks,
    tiny_dreamlite,
    tiny_dreamlite_unet,
)
from usp_dit.pipelines.families.dreamlite import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int  # tokens (positions of the map)
    width: int
    valid: tuple  # real text tokens per element (of 7)
    self_attention: bool  # DreamLite's "remove self-attention" blocks when False
    linear: bool  # use_linear_projection

    def __str__(self) -> str:
        return f"{'attn' if self.self_attention else 'noattn'}-s{self.height * self.width}"


SHAPES = [Shape(5, 7, (3, 6), True, False), Shape(3, 3, (7, 2), False, True)]


def _build(shape: Shape, seed: int = 0):
    model = tiny_dreamlite(use_self_attention=shape.self_attention, use_linear_projection=shape.linear, seed=seed)
    return model, dreamlite_inputs(shape.height, shape.width, list(shape.valid))


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    block = model.transformer_blocks[0]
    seen = block.attn1 if shape.self_attention else block.attn2  # attn2's hidden_states: the shard's queries
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, seen, shape.height * shape.width)


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    model, inputs = _build(shape)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _kv_heads_case() -> dict[str, float]:
    """(2,2,1): the routed attn1 calls get K/V with the model's 2 kv heads (not its 4 repeated
    heads) and the output still equals stock's."""
    import usp_dit.pipelines.families.dreamlite as family

    heads = []

    def spy(query, key, value, *args, **kwargs):
        heads.append((query.shape[2], key.shape[2], value.shape[2]))
        return route(query, key, value, *args, **kwargs)

    route = family.route_attention
    with mock.patch.object(family, "route_attention", spy):
        errors = _output_case(SHAPES[0], init_usp(2, 2))
    return {**errors, "kv_heads_not_moved": float(not heads or set(heads) != {(4, 2, 2)})}


UNET_GRIDS = [(2, 2, 1), (4, 1, 1)]


def _unet_cases() -> dict[str, dict[str, float]]:
    """Every DreamLite block of the tiny U-Net enabled on each grid vs one process; then disabled."""
    unet, inputs = tiny_dreamlite_unet(), dreamlite_unet_inputs(10, 14, [3, 6])
    with torch.no_grad():
        ref = unet(**inputs, return_dict=False)[0]
    results = {}
    for grid in UNET_GRIDS:
        blocks = enable_usp_on_unet_blocks(unet, init_usp(*grid))
        try:
            with torch.no_grad():
                out = unet(**inputs, return_dict=False)[0]
        finally:
            for block in blocks:
                disable_usp(block)
        results["unet-u{}r{}cfg{}".format(*grid)] = {"out": rel_err(out, ref), "blocks_not_7": float(len(blocks) != 7)}
    with torch.no_grad():
        again = unet(**inputs, return_dict=False)[0]
    results["unet-after-disable"] = {"not_bit_identical": float(not torch.equal(again, ref))}
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[0], init_usp(2, 2), checkpointing=True))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    parity.record(results, "kv-heads", _kv_heads_case)
    parity.record(results, "unet", _unet_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES) + ["cfg-split", "kv-heads"], parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


@pytest.mark.parametrize("key", ["unet-u{}r{}cfg{}".format(*g) for g in UNET_GRIDS] + ["unet-after-disable"])
def test_unet_with_every_block_enabled_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"not_bit_identical": 0.0, "blocks_not_7": 0.0}, fallback="unet")


# ---- single process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_one_rank_is_bit_identical_to_stock(shape: Shape):
    parity.assert_one_rank_bit_identical(*_build(shape), ADAPTER)


def test_a_self_attention_mask_is_refused_at_the_call():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model(**inputs.kwargs(), attention_mask=torch.ones(2, 35))
    finally:
        ADAPTER.disable(model)


# ``DreamLiteTransformer2DModel`` alone installs ``AttnProcessor2_0`` (which mishandles GQA);
# the U-Net replaces it with ``DreamLiteAttnProcessor2_0``, the one the plan routes.
test_the_class_default_processor_on_attn1_is_refused = family_checks.foreign_processor_refused(
    lambda: _build(SHAPES[0])[0], ADAPTER, "transformer_blocks.1.attn1", AttnProcessor2_0)


def test_only_cross_attention_is_refused():
    model, _ = _build(SHAPES[0])
    model.register_to_config(only_cross_attention=True)
    with pytest.raises(NotImplementedError, match="only_cross_attention=True"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_the_unet_itself_is_refused_with_its_reason():
    """``enable_usp`` on the U-Net (what ``pipe.enable_usp`` would reach through a DreamLite pipeline):
    no adapter; its blocks are enabled one by one instead (Note [DreamLite's pipelines])."""
    from usp_dit import enable_usp

    with pytest.raises(NotImplementedError):
        enable_usp(tiny_dreamlite_unet(), mesh=single_rank_mesh())
