"""HiDream adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (process start-up is the slow part); the 2-rank grids
run on it as two data-parallel replicas of 2 ranks each. Model: a tiny
``HiDreamImageTransformer2DModel`` (``usp_dit.demo.tiny_hidream``: 2 double-stream + 2
single-stream blocks, 4 heads x 16 head_dim, an MoE feed-forward of 4 routed experts (2 active)
and a shared one, three-axis RoPE, one Llama layer per block, every weight perturbed). Latents:
10 x 10 (square: 25 image tokens) and 10 x 14 (non-square: 35 real tokens padded by HiDream to
its max_seq of 39, with its token mask on the keys); neither count divides 2 or 4. Batch 2 with a
different prompt (T5, every Llama layer, pooled CLIP) and timestep per element; 5 T5 + 2 x 3
Llama text tokens. HiDream takes no text mask (its pipeline's padded prompts are attended whole).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced. Each case: output vs
stock, block 0's attention sees at most ceil(tokens / P) image tokens, after ``disable`` the output
is bit-identical. On 2 and 4 ranks, in training mode (the MoE's training path, whose gate computes
the sequence-level auxiliary loss that Diffusers discards): every parameter's gradient
(tests/adapter_parity.gradient_errors), and once with gradient checkpointing (the non-square
latent: the token mask re-cut on recompute). The transformer enabled with cfg_degree=2
(usp_dit.enable_usp) on a batch of 2 equals stock: the Llama states are batched on dim 1
(``cfg_batch_dims``). The tiny ``HiDreamImagePipeline`` (two CLIPs, T5, Llama, VAE; CFG batched
in one call) through ``pipe.enable_usp()`` on (U, R, cfg) = (2,1,1), (2,2,1) and (1,2,2), 2 steps,
square (25 tokens), and non-square (padded to 39) on (2,2,1), equal to one process's.

Not compiled: the stock MoE feed-forward reads its tokens per expert on the host
(``bincount().cpu().numpy()``, a graph break in stock too), as NucleusMoE-Image's does.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks); MoE routing is per token, so every token takes the same experts as in stock.
Measured (2026-12-05): 8.5e-7 at most on outputs (all grids and schedules), 2.1e-6 on the worst
parameter gradient, 1.1e-6 with the cfg split, 1.5e-6 on the pipeline's latents. Decoded
images: 1e-4 (an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.transformers import transformer_hidream_image

import usp_dit
from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_hidream import hidream_inputs, hidream_tokens, tiny_hidream, tiny_hidream_pipeline
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.families import hidream
from usp_dit.pipelines.families.hidream import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int  # latent sizes
    width: int

    def __str__(self) -> str:
        return f"h{self.height}w{self.width}"


SHAPES = [Shape(10, 10), Shape(10, 14)]  # 25 tokens; 35 padded to max_seq = 39 (the token mask)


def _build(shape: Shape, train: bool = False):
    model = tiny_hidream()
    return model.train(train), hidream_inputs(model, shape.height, shape.width)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    attention = model.double_stream_blocks[0].block.attn1
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, attention,
                                      hidream_tokens(model, shape.height, shape.width))


def _gradient_case(shape: Shape, mesh) -> dict[str, float]:
    return parity.gradient_errors(*_build(shape, train=True), ADAPTER, mesh)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[1], train=True)
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _cfg_split_case(mesh) -> dict[str, float]:
    """The transformer enabled with cfg_degree=2: its batch of 2 (the Llama states on dim 1) split
    over the cfg groups, equal to stock."""
    errors = {}
    for shape in SHAPES:
        model, inputs = _build(shape)
        ref = parity.forward(model, inputs)
        usp_dit.enable_usp(model, mesh=mesh)
        try:
            errors[str(shape)] = rel_err(parity.forward(model, inputs), ref)
        finally:
            usp_dit.disable_usp(model)
    return errors


def _generate(pipe, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps, CFG batched, seed 0; 20 x ``width`` pixels (20: 25 image
    tokens; 28: rescaled by the pipeline to 16 x 20, padded to 39 tokens); 7 T5 + 2 x 7 Llama tokens."""
    return parity.latents_and(
        pipe,
        prompt="fox", negative_prompt="dim", height=20, width=width, num_inference_steps=2, guidance_scale=4.0,
        max_sequence_length=7, generator=torch.Generator().manual_seed(0), output_type="pt",
    )


PIPELINE_RUNS = [((2, 1, 1), 20), ((2, 2, 1), 20), ((1, 2, 2), 20), ((2, 2, 1), 28)]


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_hidream_pipeline()
    pipe.set_progress_bar_config(disable=True)
    refs = {width: _generate(pipe, width) for width in {w for _, w in PIPELINE_RUNS}}
    tokens = {20: 25, 28: pipe.transformer.max_seq}
    results = {}
    for (u, r, c), width in PIPELINE_RUNS:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe.transformer)
        lengths = []
        hook = pipe.transformer.double_stream_blocks[0].block.attn1.register_forward_pre_hook(
            lambda m, args, seen=lengths: seen.append(args[0].shape[1]))
        try:
            latents, images = _generate(pipe, width)
        finally:
            hook.remove()
            pipe.disable_usp()
        results[f"pipeline-u{u}r{r}cfg{c}-w{width}"] = {
            "not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe.transformer)),
            "block0_tokens_above_ceil": float(max(lengths) > math.ceil(tokens[width] / (u * r))),
            "latents": rel_err(latents, refs[width][0]),
            "images": rel_err(images, refs[width][1]),
        }
    again_latents, again_images = _generate(pipe, 20)
    same = torch.equal(again_latents, refs[20][0]) and torch.equal(again_images, refs[20][1])
    results["pipeline-after-disable"] = {"not_bit_identical": float(not same)}
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    two_heads = tiny_hidream(num_heads=2, head_dim=32)
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


def test_cfg_split_of_the_transformer_batch_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}-w{w}" for (u, r, c), w in PIPELINE_RUNS])
def test_pipeline_matches_one_process(grid_results, key: str):
    """(2,1) and (2,2) sequence grids, cfg_degree=2 (the pipeline batches [uncond, cond] in one
    call), and a non-square image (padded tokens, the token mask)."""
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


# ---- single process: restore exactly, copies, loud failures ---------------------------------------


def test_deep_copy_of_an_enabled_transformer_runs_its_own_state():
    """An EMA-style deep copy: the copy's processors route with the copy's state, and equal stock."""
    model, inputs = _build(SHAPES[1])
    ref = parity.forward(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        clone = copy.deepcopy(model)
        original_state = model._usp_dit_patch.state
    finally:
        ADAPTER.disable(model)
    state = clone._usp_dit_patch.state
    assert state is not original_state
    blocks = [*clone.double_stream_blocks, *clone.single_stream_blocks]
    assert all(b.block.attn1.processor.route.state is state for b in blocks)
    assert rel_err(parity.forward(clone, inputs), ref) <= TOL
    ADAPTER.disable(clone)


def test_a_replaced_processor_is_refused():
    model = tiny_hidream()

    class Custom(transformer_hidream_image.HiDreamAttnProcessor):
        pass

    model.single_stream_blocks[1].block.attn1.processor = Custom()
    with pytest.raises(NotImplementedError, match="single_stream_blocks.1.block.attn1.processor is Custom"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_an_moe_that_uses_its_auxiliary_loss_is_refused(monkeypatch):
    """Note [HiDream's mixture of experts]: the gate's auxiliary loss is a mean over the whole
    sequence; Diffusers 0.42.1 discards it, and a MoE forward that reads it is refused."""
    assert hidream._aux_loss_applied(tiny_hidream()) is None
    stock = transformer_hidream_image.MOEFeedForwardSwiGLU.forward

    def forward_with_aux_loss(self, x):
        _, _, aux_loss = self.gate(x)
        return stock(self, x) + (0 if aux_loss is None else aux_loss)

    monkeypatch.setattr(transformer_hidream_image.MOEFeedForwardSwiGLU, "forward", forward_with_aux_loss)
    with pytest.raises(NotImplementedError, match="auxiliary loss, a mean over the whole sequence"):
        ADAPTER.enable(tiny_hidream(), single_rank_mesh(), "auto")


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_hidream, ADAPTER, hidream, "_routed_call", lambda route: None,
    match="does not call F.scaled_dot_product_attention")


def test_one_rank_enabled_equals_stock_on_a_padded_latent():
    """P = 1: the hooks and the routed processor leave the maths stock's (non-square: the mask path)."""
    model, inputs = _build(SHAPES[1])
    ref = parity.forward(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    assert rel_err(out, ref) <= TOL
