"""Kandinsky 6 SR adapter: sharded NABLA block-sparse outputs and gradients equal one process's, on CPU gloo grids without ring.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``Kandinsky6SRTransformer3DModel`` (``usp_dit.demo.tiny_kandinsky6_sr``): 2
blocks, 4 heads x 16, every weight perturbed (``pooled_bias`` and the modulations, zero at init,
too), NABLA threshold 0.5 and a 1 x 1 x 1 sliding-tile window so the mask drops blocks. Latents
3 x 8 x 16: 384 tokens in six 64-token NABLA blocks, which the shards of 2 and 4 ranks cut
mid-block; a NABLA sequence is a multiple of 64 by construction (the model refuses a token grid
not divisible by 8), so no token count dividing neither 2 nor 4 exists for this class. Batch 2
with a different latent, anchor mask and timestep per element; the RoPE table is the model's own
(positions are its grid's, not an input).

Grids (U, R, cfg): (2,1,1), (4,1,1) and (2,1,2) (the batch split over the cfg groups); a ring
(1,2,1) is refused at enable naming ``ring_degree=1``. Each Ulysses case: output vs the stock
output on one process, block 0's self-attention sees at most ceil(384 / P) tokens, after
``disable`` the output is bit-identical. Every parameter's gradient on (2,1) and (4,1) (loss / P a
rank, summed over the sequence group, equals one process's). With 5 heads (which neither 2 nor 4
divides: uneven Ulysses head splits, each rank's estimate over its own head range) on (2,1) and
(4,1): outputs vs one process, and the gradients on (4,1). The mask is not vacuous: an all-true
sliding-tile prior (nothing masked) changes the output by more than 1e-3. The fullgraph-compiled
case (2,1,1) is in tests/test_compile_grid.py (ADAPTER_CASES). A Ulysses degree above the head
count (4 on 2 heads) is refused at enable.

Pipeline: the stock ``Kandinsky6SRPipeline``, built tiny (``tiny_kandinsky6_sr_pipeline``: a tiny
``Kandinsky6SRVAE``, one 128 x 256 tile size), a 5-frame 64 x 128 video at ``resolution_scale=2``
(one tile, 2 latent frames x 8 x 16 = 256 tokens), 2 steps, through ``pipe.enable_usp`` on (2,1,1)
and (4,1,1): the latents its VAE decodes and the frames equal one process's; after ``disable_usp``
bit-identical. cfg_degree=2 is not run on the pipeline: it calls the transformer on a batch of one
tile (``tiles_batch_size=1``), which a cfg split refuses; the transformer case (2,1,2) covers it.

Flex on CPU: eager ``flex_attention`` ignores a BlockMask's sparsity (its math fallback reads
mask_mod alone), so every case attends through ``usp_dit.testing.flex.flex_honouring_blocks`` (the
BlockMask's blocks expanded to a dense sdpa mask: what compiled flex computes on a GPU), patched in
for the stock model and the sharded one alike.

Tolerance: float32 max|err| / max|ref| <= 1e-5 on outputs, gradients and the pipeline's latents
(decoded frames 1e-4: an untrained random VAE's gain). The stock processor
keeps the model's dtype (its RoPE casts back to Q's dtype: no bfloat16 round trip, unlike Kandinsky
5's), so sharding only reorders float32 sums (GEMMs over a shard's rows; the same per-head estimate
over the same gathered rows). The discrete block choice could in principle flip on a last-bit
change of a pooled score at the threshold; it does not here. Measured: outputs 0 on (2,1) and
(4,1) (a row's float32 GEMM does not depend on the shard here), 3.2e-7 on (2,1,2) (batch 1 a
group); gradients 1.0e-6; the pipeline's latents and frames 0.
"""
from __future__ import annotations

import pytest
import torch

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_kandinsky6_sr import (
    kandinsky6_sr_inputs,
    kandinsky6_sr_video,
    tiny_kandinsky6_sr,
    tiny_kandinsky6_sr_pipeline,
)
from usp_dit.pipelines.families import kandinsky6_sr
from usp_dit.pipelines.families.kandinsky6_sr import ADAPTER, USPKandinsky6SRAttnProcessor
from usp_dit.testing import rel_err
from usp_dit.testing.flex import honoured_flex

TOL = 1e-5
TOL_FRAMES = 1e-4  # decoded frames: an untrained random VAE's gain
MASK_MIN = 1e-3  # the NABLA mask's effect on the output must exceed this
WORLD = 4
SHAPE = (3, 8, 16)  # latent (frames, height, width): 384 tokens, six 64-token blocks
SHAPES = [SHAPE]  # tests/test_compile_grid.py builds its case with _build(SHAPES[0])
TOKENS = 384
GRIDS = [(2, 1, 1), (4, 1, 1), (2, 1, 2)]  # (U, R, cfg); a ring is refused
GRAD_GRIDS = [(2, 1), (4, 1)]
# 5 heads, which neither 2 nor 4 divides: Ulysses gives the ranks 3 + 2 or 2 + 1 + 1 + 1 heads, and
# each rank's estimate runs over its own uneven head range.
UNEVEN_HEADS = 5
UNEVEN_GRIDS = [(2, 1), (4, 1)]
PIPELINE_GRIDS = parity.ci_grids(parity.pipeline_grids([(2, 1, 1), (4, 1, 1)]))  # batch-1 tiles: cfg_degree=2 refused


def _build(shape: tuple[int, int, int] = SHAPE, window: tuple[int, int, int] = (1, 1, 1), num_heads: int = 4):
    return tiny_kandinsky6_sr(num_heads=num_heads, window=window), kandinsky6_sr_inputs(*shape)


def _key(grid: tuple[int, ...]) -> str:
    return "u{}r{}cfg{}".format(*grid)


# ---- what each rank runs ---------------------------------------------------------------------------


def _grid_case(grid: tuple[int, int, int]) -> dict[str, float]:
    model, inputs = _build()
    mesh = init_usp(*grid)
    if grid[2] > 1:
        return parity.cfg_split_case(model, inputs, mesh)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.visual_transformer_blocks[0].self_attention,
                                      TOKENS)


def _uneven_heads_case(u: int, r: int) -> dict[str, float]:
    """``UNEVEN_HEADS`` heads on (u, r): output vs one process, block 0 seeing ceil(384 / P) tokens."""
    model, inputs = _build(num_heads=UNEVEN_HEADS)
    return parity.sharded_output_case(model, inputs, ADAPTER, init_usp(u, r),
                                      model.visual_transformer_blocks[0].self_attention, TOKENS)


def _mask_case() -> dict[str, float]:
    """1.0 if an all-true sliding-tile prior (window over every block: nothing masked) leaves the output."""
    model, inputs = _build()
    dense, _ = _build(window=(99, 99, 99))
    return {"no_effect": float(rel_err(parity.forward(model, inputs), parity.forward(dense, inputs)) < MASK_MIN)}


def _ring_case() -> dict[str, float]:
    """1.0 unless enable on a ring grid raises NotImplementedError naming ring_degree=1."""
    model, _ = _build()
    try:
        ADAPTER.enable(model, init_usp(1, 2), "auto")
    except NotImplementedError as exc:
        return {"not_refused": float("ring_degree=1 works" not in str(exc) or "NABLA" not in str(exc))}
    ADAPTER.disable(model)
    return {"not_refused": 1.0}


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(the latents the VAE decodes, the frames): one 128 x 256 tile, 2 latent frames, 2 steps."""
    return parity.decoded_latents_and(pipe, "frames", video=kandinsky6_sr_video(), resolution_scale=2,
                                      num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(0))


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_kandinsky6_sr_pipeline(), _generate, PIPELINE_GRIDS, names=("latents", "frames"))


def _run_all() -> dict[str, dict | str]:
    results = {}
    with honoured_flex():
        for grid in GRIDS:
            parity.record(results, _key(grid), lambda grid=grid: _grid_case(grid))
        for u, r in GRAD_GRIDS:
            parity.record(results, f"grad-u{u}r{r}",
                          lambda u=u, r=r: parity.gradient_errors(*_build(), ADAPTER, init_usp(u, r)))
        for u, r in UNEVEN_GRIDS:
            parity.record(results, f"h{UNEVEN_HEADS}-u{u}r{r}", lambda u=u, r=r: _uneven_heads_case(u, r))
        parity.record(results, f"grad-h{UNEVEN_HEADS}-u4r1", lambda: parity.gradient_errors(
            *_build(num_heads=UNEVEN_HEADS), ADAPTER, init_usp(4, 1)))
        parity.record(results, "mask-masks", _mask_case)
        parity.record(results, "ring-refused", _ring_case)
        parity.record(results, "pipeline", _pipeline_cases, many=True)
        parity.record(results, "ulysses-above-heads", lambda: parity.ulysses_above_heads_case(
            tiny_kandinsky6_sr(num_heads=2, head_dim=32), ADAPTER, init_usp(ulysses_degree=4)))
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


@pytest.mark.parametrize("grid", GRIDS, ids=_key)
def test_sharded_output_matches_one_process(grid_results, grid):
    parity.assert_within(grid_results, _key(grid), TOL)


@pytest.mark.parametrize("grid", GRAD_GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
def test_parameter_gradients_match_one_process(grid_results, grid):
    parity.assert_within(grid_results, "grad-u{}r{}".format(*grid), TOL)


@pytest.mark.parametrize("grid", UNEVEN_GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
def test_uneven_ulysses_heads_match_one_process(grid_results, grid):
    parity.assert_within(grid_results, f"h{UNEVEN_HEADS}-u{grid[0]}r{grid[1]}", TOL)


def test_uneven_ulysses_heads_gradients_match_one_process(grid_results):
    parity.assert_within(grid_results, f"grad-h{UNEVEN_HEADS}-u4r1", TOL)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_pipeline_after_disable_usp_is_bit_identical(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0, fallback="pipeline")


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


def test_nabla_mask_is_not_vacuous(grid_results):
    parity.assert_within(grid_results, "mask-masks", 0.0)


def test_a_ring_grid_is_refused_naming_ring_degree_1(grid_results):
    parity.assert_within(grid_results, "ring-refused", 0.0)


# ---- single process: registration, restore exactly, loud failures ----------------------------------


test_find_adapter_finds_kandinsky6_sr = family_checks.adapter_found(tiny_kandinsky6_sr, ADAPTER)
test_disable_restores_processors_and_hooks = family_checks.disable_restores(_build, ADAPTER, USPKandinsky6SRAttnProcessor)
test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_kandinsky6_sr, ADAPTER, "visual_transformer_blocks.1.self_attention")
test_diffusers_context_parallelism_is_refused = family_checks.context_parallelism_refused(
    tiny_kandinsky6_sr, ADAPTER, "visual_transformer_blocks.0.self_attention")
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_kandinsky6_sr, ADAPTER, kandinsky6_sr, "_NABLA_CALL")
test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(
    tiny_kandinsky6_sr, ADAPTER, "Kandinsky6SR")


def test_one_rank_gives_stock_output():
    """Enabled on one rank (the deferred estimate, the whole-sequence call on a degree-1 grid) the
    output is stock's, under the block-honouring flex."""
    model, inputs = _build()
    with honoured_flex():
        ref = parity.forward(model, inputs)
        ADAPTER.enable(model, single_rank_mesh(), "auto")
        try:
            out = parity.forward(model, inputs)
        finally:
            ADAPTER.disable(model)
    assert rel_err(out, ref) <= TOL


def test_a_model_without_blocks_is_refused():
    with pytest.raises(NotImplementedError, match=r"num_visual_blocks=0|no transformer blocks"):
        ADAPTER.enable(tiny_kandinsky6_sr(num_visual_blocks=0), single_rank_mesh(), "auto")


def test_tiny_inputs_refuse_a_grid_the_nabla_blocks_cannot_tile():
    with pytest.raises(ValueError, match="multiples of 8"):
        kandinsky6_sr_inputs(1, 8, 12)
    assert kandinsky6_sr_inputs(*SHAPE).hidden_states.shape == (2, *SHAPE, 9)
    assert torch.is_tensor(kandinsky6_sr_inputs(*SHAPE).timestep)
