"""SANA-WM refiner adapter: sharded outputs, KV-cache captures and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``SanaWMLTX2RefinerTransformer3DModel``s (4 heads x
16, every weight perturbed; ``usp_dit.demo.tiny_sana_wm_refiner``): LTX-2.0-like (interleaved
RoPE) and LTX-2.3-like (split RoPE, per-head gated attention, perturbed-attention processors).
The refiner's four calls (``kv_cache_mode``): plain self-attention (None); "capture_pre_rope" (the
sink's pre-RoPE K/V stored in the cache); "inject" (attention over [cached sink, re-rotated with
its own shifted positions; cached history; current tokens]); "inject_and_capture_post_rope"
(the same, storing the current block's rotated K/V; "inject" alone runs in the pipeline). Video
tokens 45, 27 and 15 (none divides 2 or 4); a cached prefix of 9 sink + 18 history tokens; batch 2
with a different prompt, padded prompt mask (different valid lengths), per-token timestep and RoPE
frame positions per element.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced (in CI on one ring grid
per shape, Note [schedules in CI]). Each case: the output vs the stock output, what the call stored
in the cache (the captured K/V of every layer, which the adapter gathers to the whole sequence) vs
stock's, block 0's self-attention sees at most ceil(S / P) tokens, and after ``disable`` the output
is bit-identical. Every parameter's gradient of plain calls (loss / P on each rank, summed over the
sequence group) on 2 and 4 ranks; through an injected prefix ("inject_and_capture_post_rope",
Note [cached prefix] in usp_dit.pipelines.families.sana_wm_refiner: the merge by the LSEs'
gradients) on (2,2), every parameter's and the injected sink's and history's K/V (replicated:
each rank's part, summed over the sequence group); a batched plain call split by
``cfg_degree=2``, and a KV-cached call refused there. The tiny ``SanaWMLTX2Refiner`` (Gemma 3
encoder, text connectors; a stage-1 latent of 8 frames of 3 x 3, sink 1, blocks of 3 frames, a
window of 5 frames: the history trimmed; 3 Euler steps a block) through ``pipe.enable_usp()`` on
(2,1) and (2,2) equals one process's refined latents; its batch-1 calls are refused by
``cfg_degree=2``. The compiled case (one graph, a plain call on (1,2)): tests/test_compile_grid.py.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, captured K/V, gradients and the
pipeline's latents: sharding only reorders float32 sums (attention in blocks merged by
log-sum-exp, gradients summed over ranks; the captured K/V of layer 1 follow layer 0's merged
attention). The refusals and the run after ``disable``: exact (0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_sana_wm_refiner import refiner_inputs, tiny_sana_wm_refiner, tiny_sana_wm_refiner_pipeline
from usp_dit.pipelines.families.sana_wm_refiner import ADAPTER, STOCK, USPRefinerSelfAttnProcessor
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4
CAPTURES = ("captured_k_pre", "captured_v_pre", "captured_k_post", "captured_v_post")


@dataclass(frozen=True)
class Shape:
    variant: str  # tiny_sana_wm_refiner.VARIANTS
    mode: str | None  # kv_cache_mode
    frames: int  # latent sizes of the window (= token grid: patch 1)
    height: int
    width: int

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width

    def __str__(self) -> str:
        return f"{self.variant}-{self.mode or 'plain'}-f{self.frames}h{self.height}w{self.width}"


SHAPES = [
    Shape("2.0", None, 3, 3, 5),  # 45 tokens
    Shape("2.3", "inject_and_capture_post_rope", 3, 3, 3),  # 27, behind 9 sink + 18 history tokens
    Shape("2.0", "capture_pre_rope", 1, 3, 5),  # 15: the sink frame
]
GRAD_SHAPES = {2: [SHAPES[0], Shape("2.3", None, 3, 3, 3)], 4: [SHAPES[0]]}


def _build(shape: Shape, seed: int = 0):
    model = tiny_sana_wm_refiner(shape.variant, seed=seed)
    return model, refiner_inputs(model, shape.frames, shape.height, shape.width, shape.mode)


def _run(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and what the call stored in the cache: {"<layer>.<slot>": (B, S, inner)}."""
    out = parity.forward(model, inputs)
    stored = {}
    for i, layer in enumerate(inputs.cache.layer_caches if inputs.cache is not None else ()):
        stored.update({f"{i}.{slot}": getattr(layer, slot) for slot in CAPTURES if getattr(layer, slot) is not None})
    return out, stored


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output and captures vs stock, block 0's self-attention length vs ceil(S / P), bit-identity after disable."""
    model, inputs = _build(shape)
    ref, ref_stored = _run(model, inputs)
    lengths = []
    ADAPTER.enable(model, mesh, "auto")
    hook = model.transformer_blocks[0].attn1.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(args[0].shape[1]), with_kwargs=True)
    try:
        out, stored = _run(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)
    again, _ = _run(model, inputs)
    expects_captures = shape.mode is not None and "capture" in shape.mode
    captures = {"captures_missing": float(stored.keys() != ref_stored.keys() or expects_captures != bool(ref_stored))}
    captures.update({f"stored {k}": rel_err(stored[k], ref_stored[k]) for k in ref_stored if k in stored})
    return {
        "out": rel_err(out, ref), **captures,
        "block0_tokens_above_ceil": float(not lengths or max(lengths) > math.ceil(shape.tokens / mesh.sequence_degree)),
        "disable_not_bit_identical": float(not torch.equal(again, ref)),
    }


def _gradient_case(shape: Shape, mesh) -> dict[str, float]:
    return parity.gradient_errors(*_build(shape), ADAPTER, mesh)


def _refused(fn, exc_type: type[Exception], match: str) -> dict[str, float]:
    try:
        fn()
    except exc_type as exc:
        return {"wrong_error": float(match not in str(exc))}
    return {"did_not_raise": 1.0}


def _prefix_grads(model, inputs, divisor: int) -> dict[str, torch.Tensor]:
    """Gradients of (out * w).sum() / ``divisor`` for every parameter and the injected cache's K/V
    (leaves: the sink's and history's K and V of every layer)."""
    inputs.sink, inputs.history = ([t.detach().requires_grad_() for t in kv] for kv in (inputs.sink, inputs.history))
    out = parity.sample(model(**inputs.kwargs(), return_dict=False))
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(123))
    leaves = {**dict(model.named_parameters()), "sink.k": inputs.sink[0], "sink.v": inputs.sink[1],
              "history.k": inputs.history[0], "history.v": inputs.history[1]}
    grads = torch.autograd.grad((out * weight).sum() / divisor, list(leaves.values()), allow_unused=True)
    return {n: torch.zeros_like(t) if g is None else g for (n, t), g in zip(leaves.items(), grads)}


def _prefix_gradient_case(mesh) -> dict[str, float]:
    """Through an injected prefix on a grid: every parameter's and the cache's gradients (each
    rank's loss L / P, summed over the sequence group) vs one process's."""
    model, inputs = _build(SHAPES[1])
    ref = _prefix_grads(model, inputs, 1)
    ADAPTER.enable(model, mesh, "auto")
    try:
        grads = _prefix_grads(model, inputs, mesh.sequence_degree)
    finally:
        ADAPTER.disable(model)
    errors = {"params": 0.0}
    for name, g in grads.items():
        g = g.contiguous()  # gloo reduces contiguous buffers only
        torch.distributed.all_reduce(g, group=mesh.seq_group)
        key = name if name in ("sink.k", "sink.v", "history.k", "history.v") else "params"
        errors[key] = max(errors.get(key, 0.0), rel_err(g, ref[name]))
    return errors


def _cfg_cache_refused(mesh) -> dict[str, float]:
    """A KV-cached call under cfg_degree=2: NotImplementedError on every rank, before any split."""
    from usp_dit import disable_usp, enable_usp

    model, inputs = _build(SHAPES[1])
    enable_usp(model, mesh=mesh)
    try:
        return _refused(lambda: parity.forward(model, inputs), NotImplementedError, "use cfg_degree=1")
    finally:
        disable_usp(model)


# (U, R, cfg): the refiner runs no guidance (cfg 2 refused: batch 1)
PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1)])


def _refine(pipe) -> tuple[torch.Tensor]:
    """Refined latents of a stage-1 latent of 8 frames of 3 x 3 (9 tokens a frame; blocks of 27 and
    9 tokens), sink 1, blocks of 3, a window of 5 frames (the history trimmed to 4 frames)."""
    latent = torch.randn(1, 4, 8, 3, 3, generator=torch.Generator().manual_seed(7))
    out = pipe(latent, "a red fox", fps=24.0, block_size=3, kv_max_frames=5, output_type="latent",
               generator=torch.Generator().manual_seed(0))
    return (out,)


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_sana_wm_refiner_pipeline(variant="2.3")
    results = parity.pipeline_cases(pipe, _refine, parity.pipeline_grids(PIPELINE_GRIDS), names=("latents",))
    pipe.enable_usp(ulysses_degree=1, ring_degree=2, cfg_degree=2)
    try:
        results["pipeline-cfg2-refused"] = _refused(lambda: _refine(pipe), NotImplementedError, "the batch is 1")
    finally:
        pipe.disable_usp()
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case, GRAD_SHAPES)
    parity.record(results, "prefix-grad-u2r2", lambda: _prefix_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    parity.record(results, "cfg-cache-refused", lambda: _cfg_cache_refused(init_usp(1, 2, 2)))
    two_heads = tiny_sana_wm_refiner(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(by_world=GRAD_SHAPES), TOL,
)


def test_gradients_through_a_cached_prefix_match_one_process(grid_results):
    parity.assert_within(grid_results, "prefix-grad-u2r2", TOL)


def test_cfg_parallel_splits_a_plain_batched_call(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_cfg_parallel_refuses_a_kv_cached_call(grid_results):
    parity.assert_within(grid_results, "cfg-cache-refused", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    """SanaWMLTX2Refiner through pipe.enable_usp(): the KV cache built, injected, appended and trimmed."""
    parity.assert_within(grid_results, key, TOL, {"not_enabled_then_restored": 0.0}, fallback="pipeline")


def test_pipeline_refuses_cfg_parallel(grid_results):
    parity.assert_within(grid_results, "pipeline-cfg2-refused", 0.0, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_refinement(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0, fallback="pipeline")


# ---- single process: loud failures --------------------------------------------------------------


def test_rope_of_another_length_is_refused():
    model, inputs = _build(SHAPES[0])
    inputs.video_rotary_emb = tuple(t[:, :-1] for t in inputs.video_rotary_emb)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match=r"video_rotary_emb has 44 rows .* 45 video tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


def test_per_token_timestep_of_wrong_length_is_refused():
    model, inputs = _build(SHAPES[0])
    inputs.timestep = inputs.timestep[:, :-1]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="88 entries for a batch of 2 and 45 video tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


test_find_adapter_finds_the_refiner = family_checks.adapter_found(tiny_sana_wm_refiner, ADAPTER)
test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[1]), ADAPTER, (USPRefinerSelfAttnProcessor, *STOCK))
test_one_rank_is_bit_identical = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[1]), ADAPTER)
test_an_ltx2_processor_in_attn1_is_refused = family_checks.foreign_processor_refused(
    tiny_sana_wm_refiner, ADAPTER, "transformer_blocks.1.attn1", STOCK[0])
test_a_custom_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_sana_wm_refiner, ADAPTER, "transformer_blocks.0.attn2", torch.nn.Identity)
test_diffusers_context_parallelism_is_refused = family_checks.context_parallelism_refused(
    tiny_sana_wm_refiner, ADAPTER, "transformer_blocks.0.attn1")
test_no_blocks_is_refused = family_checks.no_blocks_refused(lambda: tiny_sana_wm_refiner(num_layers=0), ADAPTER)
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_sana_wm_refiner, ADAPTER, USPRefinerSelfAttnProcessor, "_stock_call",
    match="does not call dispatch_attention_fn, the call usp_dit routes")
test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(
    tiny_sana_wm_refiner, ADAPTER, "SANA-WM refiner")
