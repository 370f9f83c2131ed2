"""Sana adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``SanaTransformer2DModel`` s (4 heads x 16 of linear
self-attention, 2 x 32 of cross-attention, every weight perturbed; ``usp_dit.demo.tiny_sana``) in two
variants: Sana (no QK norm, timestep only) on a 5 x 7 token grid, and Sana-Sprint (RMS QK norm across
heads, embedded guidance, a sin-cos position table) on a 3 x 9 grid, where a rank's tokens are
shorter than a row, so its conv's halo comes from ranks two away too. Neither 35 nor 27 divides 2
or 4. Batch 2 with a different latent, prompt, timestep (and guidance) per element; 6 text tokens
with masks of different valid lengths per element (3 and 6; 2 and 5).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced (Sana has no ring: the
linear attention's summaries are all-reduced over the sequence group, the schedules must not
matter). Each case: output vs stock, block 0's self-attention sees at most ceil(tokens / P) tokens,
after ``disable`` the output is bit-identical. Per variant, on 2 and on 4 ranks: every parameter's
gradient (as tests/adapter_parity.gradient_errors, against the exact maths: below), and once with
gradient checkpointing. Each rank's
Mix-FFN depthwise-conv output equals the same tokens of one process's (the halo exchange alone).
The transformer enabled with cfg_degree=2 on a batch of 2 (the mask split too) equals stock; a grid
with fewer tokens than ranks raises on every rank. The tiny ``SanaPipeline`` (Gemma-2, DC-AE; two
prompts of different lengths, batched CFG [uncond, cond] in one call) through ``pipe.enable_usp()``
on (2,1,1), (2,2,1) and (1,2,2) (the cfg split of the batched halves), 2 steps, equal to one process's.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, conv outputs and the pipeline's
final latents: sharding only reorders float32 sums (each rank's part of the [V; 1] @ K summary, then
their all-reduced sum); the conv's products are the same. Gradients are measured against the exact
maths (the model in float64, its linear-attention core in float64 too: ``_Float64LinearAttention``,
the stock processor's maths without its float32 upcast), each parameter's error allowed
max(GRAD_TOL = 2e-5, 2 x the error of the stock float32 model there) -- the design's rule for a
reordered kernel, because the stock gradient itself is not within 1e-5 everywhere: the linear
attention's division by the summed keys amplifies float32 rounding (stock's own error on block 1's
``attn1.to_q.weight`` is 5.5e-6 on an AVX-512 CPU, 2.5e-6 on an AVX2 one, whose 4-rank sum of
partial gradients lands at 1.05e-5: the floor is 2e-5, not 1e-5, for that reason), and the
cross-attention's key bias has an analytically zero gradient (softmax is shift-invariant) whose
float32 values are pure rounding noise (measured against its weight gradient's scale instead). Decoded images: 1e-4
(an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.attention_processor import PAGCFGSanaLinearAttnProcessor2_0

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_sana import sana_inputs, tiny_sana, tiny_sana_pipeline
from usp_dit.pipelines._grid_conv import GridShards
from usp_dit.pipelines.families.sana import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
GRAD_TOL = 2e-5  # the gradients' floor (module docstring: linear attention's amplified rounding)
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    height: int  # token rows
    width: int  # token columns
    prompt_lengths: tuple[int, int]

    def __str__(self) -> str:
        return f"{self.variant}-{self.height}x{self.width}"


SHAPES = [Shape("sana", 5, 7, (3, 6)), Shape("sprint", 3, 9, (2, 5))]


def _build(shape: Shape, seed: int = 0):
    model = tiny_sana(shape.variant, seed=seed)
    return model, sana_inputs(model, shape.height, shape.width, list(shape.prompt_lengths))


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    tokens = shape.height * shape.width
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.transformer_blocks[0].attn1, tokens)


class _Float64LinearAttention:
    """Diffusers' ``SanaLinearAttnProcessor2_0`` maths without the float32 upcast: the exact
    reference in a float64 model."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        q = torch.relu(q.transpose(1, 2).unflatten(1, (attn.heads, -1)))  # (B, H, D, S)
        k = torch.relu(k.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3))  # (B, H, S, D)
        v = torch.nn.functional.pad(v.transpose(1, 2).unflatten(1, (attn.heads, -1)), (0, 0, 0, 1), value=1.0)
        h = torch.matmul(torch.matmul(v, k), q)
        h = (h[:, :, :-1] / (h[:, :, -1:] + 1e-15)).flatten(1, 2).transpose(1, 2)
        return attn.to_out[1](attn.to_out[0](h))


@functools.cache  # per shape: the 2- and 4-rank cases share the references
def _reference_grads(shape: Shape) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(exact gradients, the stock float32 model's gradients) of one process."""
    model, inputs = _build(shape)
    return _exact_grads(shape), parity._param_grads(model, inputs, 1)


def _exact_grads(shape: Shape) -> dict[str, torch.Tensor]:
    model, inputs = _build(shape)
    model.double()
    for block in model.transformer_blocks:
        block.attn1.processor = _Float64LinearAttention()
    for name, value in inputs.__dict__.items():
        if torch.is_tensor(value) and value.is_floating_point():
            setattr(inputs, name, value.double())
    return parity._param_grads(model, inputs, 1)


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    """Every parameter's gradient, summed over the sequence group (each rank's loss L / P), against
    the exact one: its error over max(GRAD_TOL, 2 x the stock float32 model's error there) (at most 1)."""
    exact, stock = _reference_grads(shape)
    model, inputs = _build(shape)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return parity.allowance_gradient_errors(model, inputs, ADAPTER, mesh, exact, stock, GRAD_TOL)


def _conv_outputs(model, inputs) -> list[torch.Tensor]:
    """Every block's ``ff.conv_depth`` output as (B, C, tokens) (flattened grid)."""
    seen = []
    hooks = [b.ff.conv_depth.register_forward_hook(lambda m, a, out: seen.append(out.flatten(2)))
             for b in model.transformer_blocks]
    try:
        parity.forward(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _conv_case(mesh) -> dict[str, float]:
    """Each rank's depthwise-conv outputs equal the same tokens of one process's (3 x 9: halos from two ranks away)."""
    shape = SHAPES[1]
    model, inputs = _build(shape)
    refs = _conv_outputs(model, inputs)
    ADAPTER.enable(model, mesh, "auto")
    try:
        outs = _conv_outputs(model, inputs)  # the hooks registered after ours see this rank's tokens
    finally:
        ADAPTER.disable(model)
    a, b = GridShards(shape.height, shape.width, mesh.sequence_degree, 1).span(mesh.seq_rank)
    return {f"block{i}": rel_err(o, r[..., a:b]) for i, (o, r) in enumerate(zip(outs, refs))}




def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2: its batch of 2 (masks of 3 and 6 tokens) split."""
    return parity.cfg_split_case(*_build(SHAPES[0]), mesh)


def _too_few_tokens_case(mesh) -> dict[str, float]:
    """A 1 x 3 grid on 4 sequence ranks: NotImplementedError on every rank, naming the grid."""
    model = tiny_sana()
    inputs = sana_inputs(model, 1, 3, [2, 6])
    ADAPTER.enable(model, mesh, "auto")
    try:
        parity.forward(model, inputs)
    except NotImplementedError as exc:
        return {"wrong_error": float("1 x 3 token grid on 4 sequence ranks" not in str(exc))}
    finally:
        ADAPTER.disable(model)
    return {"did_not_raise": 1.0}


PROMPTS = (["a red fox jumps", "a cat"], ["blurry", "dark and dim"])  # of different lengths: padded, masked


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 160 x 224 (5 x 7 = 35 tokens), batched CFG, seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(
        pipe,
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.5, height=160, width=224,
        num_inference_steps=2, max_sequence_length=16, complex_human_instruction=None,
        use_resolution_binning=False, generator=torch.Generator().manual_seed(0), output_type="pt",
    )


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last splits [uncond, cond] over cfg


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_sana_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS))


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    # Checkpointing: block 0's recompute re-shards, every block's sets its grid and fetches its halo again.
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[1], init_usp(2, 2), checkpointing=True))
    parity.record(results, "conv-halo", lambda: _conv_case(init_usp(1, 4)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    parity.record(results, "too-few-tokens", lambda: _too_few_tokens_case(init_usp(2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
    grad_tol=1.0,  # each parameter's error over its allowance (module docstring)
)


def test_mix_ffn_conv_equals_the_same_tokens_of_one_process(grid_results):
    parity.assert_within(grid_results, "conv-halo", TOL)


def test_cfg_split_of_a_masked_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_a_grid_with_fewer_tokens_than_ranks_is_refused_on_every_rank(grid_results):
    parity.assert_within(grid_results, "too-few-tokens", 0.0)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: the window arithmetic, restore exactly, loud failures ------------------------


def test_grid_windows_cover_whole_rows_and_pieces_tile_them():
    """Every rank's window is whole rows around its tokens, and its own tokens plus the pieces the
    other ranks send are exactly that window (3 x 9 on 4: pieces from two ranks away; 1 x 7 on 3)."""
    for grid in (GridShards(3, 9, 4, 1), GridShards(5, 7, 4, 1), GridShards(1, 7, 3, 1), GridShards(6, 2, 4, 1)):
        for dst in range(grid.parts):
            lo, hi = grid.window(dst)
            a, b = grid.span(dst)
            assert lo % grid.width == 0 and hi % grid.width == 0 and lo <= a <= b <= hi
            got = sorted(t for src in range(grid.parts) for t in range(*grid.piece(src, dst))) + list(range(a, b))
            assert sorted(got) == list(range(lo, hi)), (grid, dst)


test_one_rank_is_bit_identical_to_stock = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[1]), ADAPTER)


def test_controlnet_residuals_are_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="controlnet_block_samples"):
            model(**inputs.kwargs(), controlnet_block_samples=(torch.zeros(2, 35, 64),))
    finally:
        ADAPTER.disable(model)


def test_a_conv_the_halo_is_not_sized_for_is_refused():
    model = tiny_sana()
    conv = model.transformer_blocks[1].ff.conv_depth
    model.transformer_blocks[1].ff.conv_depth = torch.nn.Conv2d(
        conv.in_channels, conv.out_channels, 5, 1, 2, groups=conv.groups)
    with pytest.raises(NotImplementedError, match=r"transformer_blocks.1.ff.conv_depth has .*\(5, 5\)"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


test_pag_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_sana, ADAPTER, "transformer_blocks.0.attn1", PAGCFGSanaLinearAttnProcessor2_0)
