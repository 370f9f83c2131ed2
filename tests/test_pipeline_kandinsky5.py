"""Kandinsky 5 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks. Models: tiny ``Kandinsky5Transformer3DModel`` s (2 text blocks, 2 visual
blocks, 4 heads x 16, every weight perturbed, the zero-initialised modulations too;
``usp_dit.demo.tiny_kandinsky5``): T2V (latents 3 x 6 x 10: 45 tokens), I2V (visual_cond: the
condition latent and mask on channels; 3 x 6 x 6: 27 tokens) and an image (1 x 6 x 14: 21 tokens,
the T2I layout); none divides 2 or 4. Batch 2 with a different prompt, pooled embedding and
timestep per element; random RoPE positions and a non-unit RoPE scale factor.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced. Each case: output vs the stock output, block 0's
self-attention sees at most ceil(tokens / P) tokens, and after ``disable`` the output is
bit-identical. On 2 and 4 ranks every parameter's gradient (loss / P a rank, summed over the
sequence group, equals one process's: tests/adapter_parity.gradient_errors), and once with
gradient checkpointing (the gather at the last block sits inside its recompute). Each rank's
rotated Q/K of visual block 0 equal the same rows of one process's. The stock
``Kandinsky5T2VPipeline``, built tiny (HunyuanVideo's VAE class), through ``pipe.enable_usp()`` on
(2,1) and (2,2) and with ``cfg_degree=2`` (its two guidance calls a step on the two cfg groups,
prompt and negative prompt of different lengths); the tiny ``Kandinsky5T2IPipeline`` (Flux's VAE
class) on (2,2). NABLA sparse attention (a tiny "nabla" config, the stock pipeline's own
``sparse_params``, 384 tokens in six 64-token blocks that the shards cut mid-block; a NABLA
sequence is a multiple of 64 by construction, so it divides 2 and 4) on (2,1) and (4,1) vs one
process, with 4 heads and with 5 (which neither 2 nor 4 divides: uneven Ulysses head splits, each
head with an STA prior of its own so that a rank's head range must be cut right), under a flex
backend that honours the BlockMask's blocks (eager flex ignores them: ``usp_dit.testing.flex``),
the mask checked to change the output; on a ring (1,2) refused.
Refused: a model without visual blocks.

Tolerances. The transformer cases run a float64 model (``tiny_kandinsky5(dtype=torch.float64)``:
Note [Kandinsky 5's bfloat16 RoPE] there: the stock processor rounds rotated Q/K, and their
gradients in backward, to bfloat16, so a float32 model does not reproduce even itself: batch 1
instead of 2 moves its output by 6e-5). Outputs and each rank's rotated Q/K: 1e-10 (measured 0:
float64 noise never crosses a bfloat16 or float32 rounding boundary here). Gradients: the stock
blocks cast the modulation to float32, so the backward sums of each per-element shift / scale /
gate over the tokens run in float32, per rank over its shard: 1e-5 (float32's bar; measured
5.3e-7). The text stream's parameters (text blocks, text embedding, and the time / pooled
embeddings the text modulations feed): the text is replicated, each rank's text gradient is its
shard's part, and the stock backward rounds each part to bfloat16 in the text RoPE before the parts
are summed (one process rounds the sum): 1e-2 (bfloat16's resolution compounded over two text
blocks; measured 6.7e-3). Exact training of the text stream would need its gradient summed over
the sequence group before the text blocks; not done. The float32 pipelines' final latents: 1e-5
(measured 5.3e-7); decoded frames / images: 1e-4 (an untrained random VAE's gain, as in
tests/test_video_pipelines.py; measured 2.0e-6).
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from diffusers import Kandinsky5T2VPipeline
from diffusers.models.transformers import transformer_kandinsky

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_kandinsky5 import (
    Kandinsky5Inputs,
    kandinsky5_inputs,
    kandinsky5_tokens,
    tiny_kandinsky5,
    tiny_kandinsky5_pipeline,
)
from usp_dit.pipelines import _routing, is_usp_enabled
from usp_dit.pipelines.families.kandinsky5 import ADAPTER
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err
from usp_dit.testing.flex import honoured_flex

TOL = 1e-10  # float64 transformer outputs and rotated Q/K
TOL_F32 = 1e-5  # the float32 pipelines' latents; gradients outside the text stream (stock's float32 casts)
TOL_TEXT_GRAD = 1e-2  # the text stream's gradients: bfloat16-rounded by the stock backward (docstring)
TOL_FRAMES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    frames: int  # latent sizes
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.variant}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("t2v", 3, 6, 10),  # 3 x 3 x 5 = 45 tokens
    Shape("i2v", 3, 6, 6),  # 27 tokens, visual_cond channels
    Shape("t2v", 1, 6, 14),  # an image: 1 x 3 x 7 = 21 tokens
]


def _fits(shape: Shape, grid: tuple) -> bool:
    """The image shape on the grids at their default schedule (the forced schedules' paths are
    the video shapes' too: CI time)."""
    return shape.frames > 1 or grid[3] is None


def _build(shape: Shape, seed: int = 0, dtype: torch.dtype = torch.float64):
    model = tiny_kandinsky5(shape.variant, seed=seed, dtype=dtype)
    return model, kandinsky5_inputs(model, shape.frames, shape.height, shape.width)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    tokens = kandinsky5_tokens(model, shape.frames, shape.height, shape.width)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.visual_transformer_blocks[0].self_attention,
                                      tokens)


# Parameters whose gradient comes through the text stream (the module docstring's "gradients"):
# the text blocks, the text embedding, and the time / pooled embeddings (the text modulations').
_TEXT_STREAM = ("text_embeddings.", "text_transformer_blocks.", "time_embeddings.", "pooled_text_embeddings.")


def _gradient_case(model, inputs, mesh) -> dict[str, float]:
    """tests/adapter_parity.gradient_errors (loss / P a rank, gradients summed over the sequence
    group), the worst error of the text stream's parameters (``text``) apart from every other
    parameter's (``grad``)."""
    ref = parity._param_grads(model, inputs, 1)
    ADAPTER.enable(model, mesh, "auto")
    try:
        grads = parity._param_grads(model, inputs, mesh.sequence_degree)
    finally:
        ADAPTER.disable(model)
    worst = {"grad": 0.0, "text": 0.0}
    for name, g in grads.items():
        g = g.contiguous()
        dist.all_reduce(g, group=mesh.seq_group)
        key = "text" if name.startswith(_TEXT_STREAM) else "grad"
        worst[key] = max(worst[key], rel_err(g, ref[name]))
    return worst


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return _gradient_case(model, inputs, mesh)


def _attention_calls(model, inputs, module, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (q, k) of every call of ``module.name`` in one forward, each (B, S or S_local, H, D)."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated Q/K of visual block 0 equal the same rows of one process's. The stock
    run's calls: the text blocks' self-attention first (2), then visual block 0's; the sharded
    run's first ``usp_attention`` call is visual block 0's (the text blocks' run stock)."""
    model, inputs = _build(SHAPES[0])
    q_ref, k_ref = _attention_calls(model, inputs, transformer_kandinsky, "dispatch_attention_fn")[2]
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _attention_calls(model, inputs, _routing, "usp_attention")[0]
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


def _run_pipeline(pipe, image: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames or image) of 2 guided steps, a prompt and a shorter negative prompt
    (the two calls of a step differ in text length), 48 x 80 (x 9 frames): 45 video tokens or 15
    image tokens, seed 0."""
    last = {}

    def keep_latents(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"].clone()
        return {}

    kwargs = dict(prompt="a red fox jumps over a log", negative_prompt="blurry", height=48, width=80,
                  num_inference_steps=2, guidance_scale=3.0, max_sequence_length=64, output_type="pt",
                  generator=torch.Generator().manual_seed(0), callback_on_step_end=keep_latents)
    out = pipe(**kwargs).image if image else pipe(num_frames=9, **kwargs).frames
    return last["latents"], out


PIPELINE_CASES = [("t2v", 2, 1, 1), ("t2v", 2, 2, 1), ("t2v", 2, 1, 2), ("t2i", 2, 2, 1)]  # (kind, U, R, cfg)


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The tiny T2V pipeline on (2,1), (2,2) and (2,1) x cfg 2; the tiny T2I pipeline on (2,2);
    after each ``disable_usp`` the output is bit-identical to the stock run's."""
    results = {}
    for kind in ("t2v", "t2i"):
        pipe = tiny_kandinsky5_pipeline(image=kind == "t2i")
        pipe.set_progress_bar_config(disable=True)
        ref_latents, ref_out = _run_pipeline(pipe, kind == "t2i")
        for k, u, r, c in PIPELINE_CASES:
            if k != kind:
                continue
            pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
            enabled = is_usp_enabled(pipe.transformer)
            try:
                latents, out = _run_pipeline(pipe, kind == "t2i")
            finally:
                pipe.disable_usp()
            results[f"pipeline-{kind}-u{u}r{r}cfg{c}"] = {
                "not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe.transformer)),
                "latents": rel_err(latents, ref_latents), "frames": rel_err(out, ref_out),
            }
        again_latents, again_out = _run_pipeline(pipe, kind == "t2i")
        same = torch.equal(again_latents, ref_latents) and torch.equal(again_out, ref_out)
        results[f"pipeline-{kind}-after-disable"] = {"not_bit_identical": float(not same)}
    return results


# ---- NABLA sparse attention on Ulysses grids (Note [Kandinsky 5's sparse attention]) ---------------


@dataclass
class _NablaInputs(Kandinsky5Inputs):
    sparse_params: dict | None = None


NABLA_SHAPE = (3, 16, 32)  # latent (frames, height, width): 3 x 8 x 16 = 384 tokens, six 64-token blocks
NABLA_GRIDS = [(2, 1), (4, 1)]  # (U, R); a ring is refused
# 5 heads, which neither 2 nor 4 divides: Ulysses gives the ranks 3 + 2 or 2 + 1 + 1 + 1 heads, and
# each rank's estimate runs over its own uneven head range with that range's slice of a per-head STA
# prior (``heads`` of ``deferred_nabla_call``, ``_nabla_block_mask``).
NABLA_UNEVEN_HEADS = 5


def _nabla_build(keep_all: bool = False, num_heads: int = 4, per_head_sta: bool = False, flex: str = "model"):
    """A tiny ``nabla`` config (P = 0.3: each query block keeps its top 70 % of the softmax mass;
    a 1 x 1 x 1 STA window: the diagonal) in float64, ``num_heads`` x 16, and its inputs with the
    stock pipeline's own ``sparse_params`` (``get_sparse_params``). ``keep_all``: an all-true STA
    mask (nothing masked). ``per_head_sta``: the diagonal OR a seeded random block pattern of each
    head's own, (1, H, blocks, blocks) (stock's estimate broadcasts it over the batch): a rank that
    took another head range's prior would attend differently. ``flex``: where flex is set, "model"
    (``transformer.set_attention_backend``: every processor, and Diffusers' process-wide active
    backend) or "visual" (each visual self-attention's ``set_attention_backend``, nothing else)."""
    model = tiny_kandinsky5(num_heads=num_heads, dtype=torch.float64)
    model.register_to_config(attention_type="nabla", attention_P=0.3, attention_wT=1, attention_wH=1,
                             attention_wW=1, attention_add_sta=True, attention_method="topcdf")
    frames, height, width = NABLA_SHAPE
    inputs = kandinsky5_inputs(model, frames, height, width)
    pipe = types.SimpleNamespace(transformer=model, fast_sta_nabla=Kandinsky5T2VPipeline.fast_sta_nabla)
    sparse = Kandinsky5T2VPipeline.get_sparse_params(pipe, inputs.hidden_states, "cpu")
    if keep_all:
        sparse["sta_mask"] = torch.ones_like(sparse["sta_mask"])
    if per_head_sta:
        sta = sparse["sta_mask"]  # (1, 1, blocks, blocks)
        noise = torch.rand(1, num_heads, *sta.shape[2:], generator=torch.Generator().manual_seed(7))
        sparse["sta_mask"] = sta | (noise < 0.3)
    if flex == "model":
        model.set_attention_backend("flex")  # what stock's BlockMask needs
    else:
        for block in model.visual_transformer_blocks:
            block.self_attention.set_attention_backend("flex")
    return model, _NablaInputs(**inputs.kwargs(), sparse_params=sparse)


def _nabla_cases() -> dict[str, dict[str, float]]:
    """The NABLA config on (2,1) and (4,1) vs one process, block 0 seeing ceil(384 / P) tokens, bit
    identical after disable, with 4 heads and with 5 (uneven Ulysses head splits); the mask is not
    vacuous (all-kept STA changes the output); a ring refused."""
    tokens = 384
    results = {}
    with honoured_flex():
        model, inputs = _nabla_build()
        dense = parity.forward(*_nabla_build(keep_all=True))
        results["nabla-mask-masks"] = {"no_effect": float(rel_err(parity.forward(model, inputs), dense) < 1e-3)}
        for u, r in NABLA_GRIDS:
            mesh = init_usp(u, r)
            results[f"nabla-u{u}r{r}"] = parity.sharded_output_case(
                model, inputs, ADAPTER, mesh, model.visual_transformer_blocks[0].self_attention, tokens)
        uneven, uneven_inputs = _nabla_build(num_heads=NABLA_UNEVEN_HEADS, per_head_sta=True)
        for u, r in NABLA_GRIDS:
            results[f"nabla-h{NABLA_UNEVEN_HEADS}-u{u}r{r}"] = parity.sharded_output_case(
                uneven, uneven_inputs, ADAPTER, init_usp(u, r), uneven.visual_transformer_blocks[0].self_attention,
                tokens)
        ADAPTER.enable(model, init_usp(1, 2), "auto")
        try:
            model(**inputs.kwargs())
            results["nabla-ring-refused"] = {"not_refused": 1.0}
        except NotImplementedError as exc:
            results["nabla-ring-refused"] = {"not_refused": float("ring_degree=1" not in str(exc))}
        finally:
            ADAPTER.disable(model)
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: _gradient_case(*_build(shape), mesh), fits=_fits)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    two_heads = tiny_kandinsky5(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    parity.record(results, "nabla", _nabla_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


@pytest.mark.parametrize("key", parity.output_keys(SHAPES, _fits))
def test_sharded_output_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


GRAD_KEYS = parity.grad_keys(SHAPES)


@pytest.mark.parametrize("key", GRAD_KEYS + ["grad-ckpt-p4"])
def test_parameter_gradients_match_one_process(grid_results, key: str):
    for rank, res in enumerate(grid_results):
        errors = res[key]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        assert errors["grad"] <= TOL_F32 and errors["text"] <= TOL_TEXT_GRAD, f"rank {rank}: {errors}"


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=lambda c: f"{c[0]}-u{c[1]}r{c[2]}cfg{c[3]}")
def test_pipeline_matches_one_process(grid_results, case):
    key = "pipeline-{}-u{}r{}cfg{}".format(*case)
    parity.assert_within(grid_results, key, TOL_F32, {"frames": TOL_FRAMES}, fallback="pipeline")


@pytest.mark.parametrize("kind", ["t2v", "t2i"])
def test_disable_usp_gives_back_the_bit_identical_output(grid_results, kind):
    parity.assert_within(grid_results, f"pipeline-{kind}-after-disable", 0.0)


# ---- single process: refusals ---------------------------------------------------------------------


@pytest.mark.parametrize("grid", NABLA_GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
def test_nabla_sparse_attention_matches_one_process_on_ulysses_grids(grid_results, grid):
    parity.assert_within(grid_results, "nabla-u{}r{}".format(*grid), TOL, fallback="nabla")


@pytest.mark.parametrize("grid", NABLA_GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
def test_nabla_sparse_attention_matches_one_process_with_uneven_heads(grid_results, grid):
    parity.assert_within(grid_results, f"nabla-h{NABLA_UNEVEN_HEADS}-u{grid[0]}r{grid[1]}", TOL, fallback="nabla")


def test_nabla_mask_is_not_vacuous_and_a_ring_is_refused(grid_results):
    parity.assert_within(grid_results, "nabla-mask-masks", 0.0, fallback="nabla")
    parity.assert_within(grid_results, "nabla-ring-refused", 0.0, fallback="nabla")


def test_nabla_dispatches_on_the_backend_set_on_the_visual_self_attentions_alone():
    """Flex set on the visual self-attentions only (Diffusers' process-wide active backend left
    native): the enabled model's NABLA call runs on flex as stock's does (the swapped-in processor
    takes its stock processors' backend: ``carry_stock_backend``; it used to keep none and fall to
    the active SDPA backend, which refuses a BlockMask), equal to stock (float64, 1e-10); visual
    self-attentions set to different backends are refused by name at enable."""
    with honoured_flex():
        model, inputs = _nabla_build(flex="visual")
        ref = parity.forward(model, inputs)
        ADAPTER.enable(model, single_rank_mesh(), "auto")
        try:
            out = parity.forward(model, inputs)
        finally:
            ADAPTER.disable(model)
        assert rel_err(out, ref) <= TOL
        model.visual_transformer_blocks[1].self_attention.set_attention_backend("native")
        with pytest.raises(NotImplementedError, match="different attention backends"):
            ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_a_model_without_visual_blocks_is_refused():
    model, _ = _build(SHAPES[0])
    model.visual_transformer_blocks = torch.nn.ModuleList()
    with pytest.raises(NotImplementedError, match="num_visual_blocks=0"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


# ---- the video example's Kandinsky 5 option (argument checks only: nothing loads) -----------------


def test_video_example_kandinsky5_defaults_and_refusals(monkeypatch):
    from tests.test_examples_cli import _example
    from usp_dit.cli.launch import UsageError

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    example = _example("generate_video")
    args = example.parse_args(["--model", "kandinsky5"])
    assert (args.frames, args.height, args.width, args.degrees) == (9, 96, 144, (1, 1, 1))
    with pytest.raises(UsageError, match="--frames 11 must be 4k [+] 1"):
        example.parse_args(["--model", "kandinsky5", "--frames", "11"])
    with pytest.raises(UsageError, match="the planner has no cost model for this family"):
        example.parse_args(["--model", "kandinsky5", "--degrees", "auto"])
