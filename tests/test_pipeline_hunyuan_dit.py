"""HunyuanDiT adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Model: a tiny 6-layer ``HunyuanDiT2DModel`` (4 heads x 16, patch 2, QK
norms, learned sigma, style and size conditions; blocks 4 and 5 take the long skips of blocks 1
and 0; every weight perturbed; ``usp_dit.demo.tiny_hunyuan_dit``) on a 5 x 7 and a 3 x 9 token grid
(neither 35 nor 27 divides 2 or 4), the 2D RoPE table as the pipeline makes it, cropped at an offset.
Batch 2 with a different latent, prompt, timestep and image size per element; 5 Bert-side and 7
mT5-side text tokens with prompt masks of different valid lengths per element (2 and 5; 4 and 7),
which HunyuanDiT applies by replacing the padding with learned rows before the blocks.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's self-attention sees at most ceil(tokens / P) tokens, after ``disable`` the output
is bit-identical. On 2 and on 4 ranks: every parameter's gradient (against the exact maths:
below). The transformer enabled with cfg_degree=2 on a batch of 2 (the masks, sizes and styles
split, the RoPE table whole) equals stock. Each rank's rotated queries of block 0's
cross-attention equal the same rows of one process's (the RoPE table cut like the tokens). The tiny
``HunyuanDiTPipeline`` (Bert + T5 encoders, an 8x VAE, DPM-Solver++, 77 + 256 text tokens; two prompts of
different lengths, batched CFG [uncond, cond] in one call) through ``pipe.enable_usp()`` on (2,1,1),
(2,2,1) and (1,2,2), 2 steps, equal to one process's (final latents 1e-5, decoded images 1e-4: an
untrained random VAE's gain, as in tests/test_pipeline_wan.py); after ``disable_usp`` bit-identical.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs: sharding only reorders float32 sums
(attention merged by log-sum-exp over blocks of keys; the cross-attention and the skips are the
stock arithmetic per token). Gradients are measured against the exact maths (the model in float64),
each parameter's error allowed max(1e-5, 4 x the error of the stock float32 model there): the key
biases of both attentions have an analytically zero gradient (softmax is shift-invariant) whose
float32 values are rounding noise, and the query-side gradients of the QK-normed self-attention are
ill-conditioned here (stock's own float32 error 4.7e-6 to 8.2e-6 on block 1's attn1 to_q / to_k /
norm_q). The ring's backward re-accumulates dQ over blocks of keys in another order: measured
1.5e-5 on block 1's ``attn1.to_q.bias`` on (1,2,1), 3.2 x stock's error there (Ulysses (2,1,1):
at most 0.52 x 2 x stock's). Twice stock's error, the design's usual rule, fails that one
parameter; four times holds with margin and still fails any misplaced token (errors of order 1).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_hunyuan_dit import hunyuan_dit_inputs, tiny_hunyuan_dit, tiny_hunyuan_dit_pipeline
from usp_dit.pipelines.families.hunyuan_dit import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
GRAD_FACTOR = 4  # the module docstring: the ring's backward on QK-normed, ill-conditioned attention gradients
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int  # token rows
    width: int  # token columns

    def __str__(self) -> str:
        return f"{self.height}x{self.width}"


SHAPES = [Shape(5, 7), Shape(3, 9)]


def _build(shape: Shape, seed: int = 0):
    model = tiny_hunyuan_dit(seed=seed)
    return model, hunyuan_dit_inputs(model, shape.height, shape.width, [2, 5], [4, 7])


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    tokens = shape.height * shape.width
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.blocks[0].attn1, tokens)


def _float64(value):
    if torch.is_tensor(value) and value.is_floating_point():
        return value.double()
    if isinstance(value, tuple):
        return tuple(_float64(v) for v in value)
    return value


@functools.cache  # per shape: the 2- and 4-rank cases share the references
def _reference_grads(shape: Shape) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(exact gradients: the model and inputs in float64, the stock float32 model's gradients) of one process."""
    model, inputs = _build(shape)
    stock = parity._param_grads(model, inputs, 1)
    model.double()
    for name, value in inputs.__dict__.items():
        setattr(inputs, name, _float64(value))
    return parity._param_grads(model, inputs, 1), stock


def _gradient_case(shape: Shape, mesh) -> dict[str, float]:
    """Every parameter's gradient, summed over the sequence group (each rank's loss L / P), against
    the exact one: its error over max(TOL, GRAD_FACTOR x the stock float32 model's error there) (at most 1)."""
    exact, stock = _reference_grads(shape)
    model, inputs = _build(shape)
    return parity.allowance_gradient_errors(model, inputs, ADAPTER, mesh, exact, stock, TOL, GRAD_FACTOR)


class _KeepQueries:
    """The stock processor, keeping its rotated queries (its own signature: ``Attention.forward``
    passes a processor only the keywords its ``__call__`` names)."""

    def __init__(self, stock) -> None:
        self.stock, self.seen = stock, []

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        q = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1)).transpose(1, 2))
        self.seen.append(apply_rotary_emb(q, image_rotary_emb))
        return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, temb, image_rotary_emb)


def _cross_attention_queries(model, inputs) -> torch.Tensor:
    """Block 0's cross-attention queries after RoPE, (B, heads, S or S_local, head_dim)."""
    attn = model.blocks[0].attn2
    keep = _KeepQueries(attn.processor)
    attn.processor = keep
    try:
        parity.forward(model, inputs)
    finally:
        attn.processor = keep.stock
    return keep.seen[0]


def _rope_rows_case(mesh) -> dict[str, float]:
    """Each rank's rotated cross-attention queries equal the same rows of one process's."""
    model, inputs = _build(SHAPES[0])
    ref = _cross_attention_queries(model, inputs)
    ADAPTER.enable(model, mesh, "auto")
    try:
        got = _cross_attention_queries(model, inputs)
    finally:
        ADAPTER.disable(model)
    return {"queries": rel_err(got, shard_sequence(ref, mesh, dim=2))}


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2: its batch of 2 split, the RoPE table whole."""
    return parity.cfg_split_case(*_build(SHAPES[1]), mesh)


PROMPTS = (["a red fox jumps", "a cat"], ["blurry", "dark and dim"])  # of different lengths: padded, masked
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last splits [uncond, cond] over cfg


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 80 x 112 (5 x 7 = 35 tokens), batched CFG, seed 0."""
    prompt, negative_prompt = PROMPTS
    return parity.latents_and(
        pipe,
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=5.0, height=80, width=112,
        num_inference_steps=2, use_resolution_binning=False, generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )


def _pipeline_cases() -> dict[str, dict[str, float]]:
    return parity.pipeline_cases(tiny_hunyuan_dit_pipeline(), _generate, parity.pipeline_grids(PIPELINE_GRIDS))


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "rope-rows", lambda: _rope_rows_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES), TOL,
    grad_tol=1.0,  # each parameter's error over its allowance (module docstring)
)


def test_rope_rows_of_each_rank_match_one_process(grid_results):
    parity.assert_within(grid_results, "rope-rows", TOL)


def test_cfg_split_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: restore exactly, loud failures ----------------------------------------------


test_one_rank_is_bit_identical_to_stock = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[1]), ADAPTER)


def test_prompt_masks_and_skips_change_the_output():
    """What the grid cases cover matters: unmasked padding, or a skip block's other input, gives another output."""
    model, inputs = _build(SHAPES[0])
    ref = parity.forward(model, inputs)
    inputs.text_embedding_mask = torch.ones_like(inputs.text_embedding_mask)
    assert rel_err(parity.forward(model, inputs), ref) > 1e-3
    model, inputs = _build(SHAPES[0])
    with torch.no_grad():
        # Block 5's skip half (block 0's output) of skip_linear's input: random, not a constant that
        # norm_out's LayerNorm would remove.
        weight = model.blocks[5].skip_linear.weight[:, model.inner_dim:]
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    assert rel_err(parity.forward(model, inputs), ref) > 1e-3


def test_controlnet_residuals_are_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="controlnet_block_samples"):
            model(**inputs.kwargs(), controlnet_block_samples=[torch.zeros(2, 35, 64)] * 2)
    finally:
        ADAPTER.disable(model)


def test_a_rope_table_of_the_wrong_length_is_refused():
    model, inputs = _build(SHAPES[0])
    inputs.image_rotary_emb = tuple(t[:-1] for t in inputs.image_rotary_emb)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="image_rotary_emb has 34 rows but the transformer has 35"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_fused_qkv_is_refused():
    model = tiny_hunyuan_dit()
    model.fuse_qkv_projections()
    with pytest.raises(NotImplementedError, match="FusedHunyuanAttnProcessor2_0"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")
