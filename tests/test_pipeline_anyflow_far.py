"""AnyFlow FAR adapter: the inference calls (cache call and cached calls) on CPU gloo grids equal one process's.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``AnyFlowFARTransformer3DModel`` s (4 heads x 16,
every weight perturbed, the delta-embedding gate 0.3; ``usp_dit.demo.tiny_anyflow_far``). A case is
a whole rollout as the pipeline makes it (``far_rollout``: per chunk a cached call, then the cache
call over every chunk so far), batch 2 with a different prompt and a random ``t`` and ``r <= t`` per
latent frame and element:

  * "t2v", full_chunk_limit 2, chunks (1, 2, 1, 3) of 6 x 14 latents (21 full, 3 compressed tokens a
    frame): cached calls of 21, 42, 21 and 63 tokens behind caches of 0, 21, 3 + 42 and 9 + 21
    rows; cache calls over 21, 3 + 42 and 9 + 21 tokens (chunks of unequal token counts; on 4
    ranks shards straddle the compressed / full seam and the chunk seams);
  * "t-r" (``deltatime_type``), full_chunk_limit 3 (the release's), chunks (2, 1, 1, 2) of 10 x 6
    latents (15 and 2 tokens a frame): cached calls of 30, 15, 15, 30 tokens; cache calls over 30,
    45 and 4 + 30 tokens.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS),
the forced ring schedules on one ring grid per shape (Note [schedules in CI]). Each case: every
cached call's sample and the final KV cache (every rank holds it whole) vs one process's, block 0's
attention sees at most ceil(tokens / P) of every call's tokens; once, after ``disable`` the rollout
is bit-identical. ``enable_usp`` on (1,2,2) splits the batch over the cfg groups (each group's cache
rows gathered over "cfg" in the cache calls). Refused on a grid, on every rank: a gradient through
an inference call, the training rollout. The tiny ``AnyFlowFARPipeline`` (T5 stand-in, Wan VAE,
flow-map Euler, 13 frames of 48 x 112 = chunks (1, 2, 1) of 21 tokens a frame, the first a given
latent frame (image-to-video: a context chunk), 2 steps a chunk, guidance 2.0: [negative; positive]
batched, a KV cache of batch 2) through ``pipe.enable_usp()`` on
(2,1,1), (2,2,1) and (1,2,2) equals one process, then is bit-identical after ``disable_usp``.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on samples, caches and the pipeline's latents:
sharding only reorders float32 sums (attention in parts merged by log-sum-exp, Notes in
usp_dit.pipelines.families.anyflow_far; stock's flex kernel against usp_dit's). The decoded frames:
1e-4 (an untrained random VAE's gain, as in tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from diffusers.models.transformers import transformer_anyflow_far

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import disable_usp, enable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_anyflow_far import (
    far_kv_cache,
    far_rollout,
    far_rollout_inputs,
    far_tokens_per_frame,
    tiny_anyflow_far,
    tiny_anyflow_far_pipeline,
)
from usp_dit.pipelines.families.anyflow_far import ADAPTER, USPFARSelfAttnProcessor
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    limit: int  # full_chunk_limit
    chunks: tuple[int, ...]
    height: int  # latent sizes
    width: int

    def __str__(self) -> str:
        return f"{self.variant}-L{self.limit}-c{''.join(map(str, self.chunks))}h{self.height}w{self.width}"


SHAPES = [Shape("t2v", 2, (1, 2, 1, 3), 6, 14), Shape("t-r", 3, (2, 1, 1, 2), 10, 6)]


def _build(shape: Shape, seed: int = 0):
    model = tiny_anyflow_far(shape.variant, full_chunk_limit=shape.limit, chunk_partition=shape.chunks, seed=seed)
    return model, far_rollout_inputs(model, shape.height, shape.width)


def _errors(got, ref) -> dict[str, float]:
    """Each cached call's sample and each cache tensor of the final cache vs one process's."""
    (samples, cache), (ref_samples, ref_cache) = got, ref
    errors = {f"chunk{c}": rel_err(s, r) for c, (s, r) in enumerate(zip(samples, ref_samples, strict=True))}
    errors.update({f"cache{layer}.{name}": rel_err(cache[layer][name], ref_cache[layer][name])
                   for layer in ref_cache for name in ref_cache[layer]})
    return errors


def _call_tokens(shape: Shape) -> list[int]:
    """Every call's token count in the rollout's order (cached call of chunk 0, cache call over 1
    chunk, cached call of chunk 1, ...), as block 0 would get it whole."""
    model, _ = _build(shape)
    full, compressed = far_tokens_per_frame(model, shape.height, shape.width)
    cp, tokens = list(shape.chunks), []
    for c in range(len(cp)):
        tokens.append(cp[c] * full)
        if c < len(cp) - 1:
            demoted = max(c + 1 - (shape.limit - 1), 0)  # _forward_cache: the last limit - 1 chunks stay full
            tokens.append(sum(cp[:demoted]) * compressed + sum(cp[demoted:c + 1]) * full)
    return tokens


# ---- what each rank runs ---------------------------------------------------------------------------

_REFERENCES: dict[Shape, tuple] = {}


def _reference(shape: Shape):
    """One process's rollout (computed once per rank and shape, shared by the grids)."""
    if shape not in _REFERENCES:
        model, inputs = _build(shape)
        _REFERENCES[shape] = far_rollout(model, inputs)
    return _REFERENCES[shape]


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """The rollout vs one process's, and block 0's attention lengths vs ceil(S / P) of each call."""
    model, inputs = _build(shape)
    ref = _reference(shape)
    lengths = []
    ADAPTER.enable(model, mesh, "auto")
    hook = model.blocks[0].attn1.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    try:
        got = far_rollout(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)
    most = [math.ceil(n / mesh.sequence_degree) for n in _call_tokens(shape)]
    return {
        **_errors(got, ref),
        "block0_tokens_above_ceil": float(len(lengths) != len(most) or any(a > b for a, b in zip(lengths, most))),
    }


def _disable_case(mesh) -> dict[str, float]:
    """After a rollout on ``mesh`` and ``disable``, stock's rollout bit for bit (once: a stock
    rollout's flex calls cost more than the sharded one)."""
    shape = SHAPES[0]
    model, inputs = _build(shape)
    ADAPTER.enable(model, mesh, "auto")
    try:
        far_rollout(model, inputs)
    finally:
        ADAPTER.disable(model)
    samples, cache = far_rollout(model, inputs)
    ref_samples, ref_cache = _reference(shape)
    same = all(map(torch.equal, samples, ref_samples)) and all(
        torch.equal(cache[layer][name], ref_cache[layer][name]) for layer in cache for name in cache[layer])
    return {"not_bit_identical": float(not same)}


def _cfg_split_case(mesh) -> dict[str, float]:
    """``enable_usp`` on a cfg mesh: each cfg group runs one batch row; the cache calls gather both
    groups' rows, so every rank's cache is one process's whole."""
    shape = SHAPES[0]
    model, inputs = _build(shape)
    enable_usp(model, mesh=mesh)
    try:
        got = far_rollout(model, inputs)
    finally:
        disable_usp(model)
    return _errors(got, _reference(shape))


def _refused(fn, match: str) -> dict[str, float]:
    try:
        fn()
    except NotImplementedError as exc:
        return {"wrong_error": float(match not in str(exc))}
    return {"did_not_raise": 1.0}


def _gradient_refused(mesh) -> dict[str, float]:
    """A cached call under autograd: NotImplementedError on every rank (the merges are forward only)."""
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, mesh, "auto")
    try:
        kwargs = inputs.kwargs()
        return _refused(lambda: model(**kwargs), "forward only")
    finally:
        ADAPTER.disable(model)


def _training_refused(mesh) -> dict[str, float]:
    """The training rollout (no KV cache): NotImplementedError on every rank, before any token is split."""
    model, inputs = _build(SHAPES[0])
    kwargs = {**inputs.kwargs(), "kv_cache": None, "kv_cache_flag": None}
    ADAPTER.enable(model, mesh, "auto")
    try:
        with torch.no_grad():
            return _refused(lambda: model(**kwargs), "training rollout (kv_cache=None, _forward_train) is refused")
    finally:
        ADAPTER.disable(model)


def _clean_mask_kwargs(model, inputs) -> dict:
    """The cache call over chunks (2, 1, 1) of SHAPES[1] (4 compressed + 30 full tokens) with
    ``build_attention_mask(has_clean_context=True)``: rows of the first full chunk still see a prefix
    of the keys, the second's do not (its noise sees its own chunk only, and earlier chunks' clean
    copies)."""
    kwargs = inputs.kwargs(cache_call=3)
    kwargs["attention_mask"] = model.build_attention_mask(
        chunk_partition=kwargs["chunk_partition"], height=10, width=6, mode="cache", has_clean_context=True)
    return kwargs


def _clean_mask_refused(mesh) -> dict[str, float]:
    """On (1,4) ranks 0 and 1 hold rows whose keys are prefixes, ranks 2 and 3 rows whose keys are
    not: NotImplementedError on every rank all the same (the verdict agreed), before any transfer."""
    model, inputs = _build(SHAPES[1])
    kwargs = _clean_mask_kwargs(model, inputs)
    ADAPTER.enable(model, mesh, "auto")
    try:
        with torch.no_grad():
            return _refused(lambda: model(**kwargs), "prefix of the keys")
    finally:
        ADAPTER.disable(model)


def _cached_step_kwargs(inputs, chunk: int, step: int) -> dict:
    """Denoising step ``step`` of chunk ``chunk``'s cached call, as the pipeline makes it (a fresh
    copy of the flag each call; contiguous latents and timesteps): the step's latents, ``t`` and
    ``r <= t`` drawn from ``step``."""
    cp = list(inputs.chunk_partition)
    lo, hi = sum(cp[:chunk]), sum(cp[:chunk + 1])
    g = torch.Generator().manual_seed(100 + step)
    latents = torch.randn(inputs.latents[:, lo:hi].shape, generator=g)
    t = torch.rand(inputs.t[:, lo:hi].shape, generator=g) * 1000
    r = t * torch.rand(t.shape, generator=g)
    return dict(hidden_states=latents, timestep=t, r_timestep=r, encoder_hidden_states=inputs.text,
                chunk_partition=cp[:chunk + 1], kv_cache=None,
                kv_cache_flag={"num_cached_chunks": chunk, "is_cache_step": False}, return_dict=False)


COMPILE_CHUNK = 2  # SHAPES[0]'s chunk 2: 21 tokens (11 + 10 on 2 ranks) behind 3 compressed + 42 full cache rows


def _cached_steps(model, inputs, call) -> list[torch.Tensor]:
    """Two denoising steps of chunk ``COMPILE_CHUNK`` through ``call`` (same shapes, new values),
    behind the cache that ``model``'s eager rollout of the chunks before it filled."""
    cp = list(inputs.chunk_partition)
    cache = far_kv_cache(model, inputs.latents.shape[0], cp, inputs.latents.shape[3], inputs.latents.shape[4])
    far_rollout(model, replace(inputs, chunk_partition=tuple(cp[:COMPILE_CHUNK + 1])), cache)  # fills the cache
    outs = []
    with torch.no_grad():
        for step in range(2):
            outs.append(call(**{**_cached_step_kwargs(inputs, COMPILE_CHUNK, step), "kv_cache": cache})[0])
    return outs


def compile_case(mesh) -> dict[str, float]:
    """The cached (denoising) call compiled with ``fullgraph=True`` on ``mesh`` (Dynamo's graph
    through a counter, backend "eager"), two steps of the same shapes: one graph (no recompile),
    each output vs one process's (stock). The cache calls before it run eagerly (their mask is read
    on the host: Note [compiling FAR] in usp_dit.pipelines.families.anyflow_far). Called on
    spawned ranks (tests/test_compile_grid.py)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, inputs = _build(SHAPES[0])
    ref = _cached_steps(model, inputs, model)
    enable_usp(model, mesh=mesh)
    try:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        got = _cached_steps(model, inputs, torch.compile(model, backend=counter, fullgraph=True))
    finally:
        disable_usp(model)
    return {"err": max(rel_err(a, b) for a, b in zip(got, ref)), "graphs_not_1": float(counter.frame_count != 1)}


PIPELINE_GRIDS = parity.ci_grids(parity.pipeline_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)]))


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(the latents the VAE decodes (1, 4, 4, 6, 14), the frames) of 13 frames of 48 x 112 in chunks
    (1, 2, 1), 2 steps a chunk, guidance 2 ([negative; positive] batched, a cache of batch 2),
    continuing a given first latent frame (image-to-video: chunk 0 is context, cached, never denoised)."""
    first = torch.randn(1, 1, 4, 6, 14, generator=torch.Generator().manual_seed(1))
    return parity.decoded_latents_and(
        pipe, "frames", prompt="a red fox jumps over a log", negative_prompt="blurry", video_latents=first,
        height=48, width=112,
        num_frames=13, num_inference_steps=2, guidance_scale=2.0, max_sequence_length=16,
        chunk_partition=[1, 2, 1], generator=torch.Generator().manual_seed(0), output_type="pt",
    )


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, None, {2: [], 4: []})
    parity.record(results, "after-disable", lambda: _disable_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    parity.record(results, "grad-refused", lambda: _gradient_refused(init_usp(2, 2)))
    parity.record(results, "training-refused", lambda: _training_refused(init_usp(1, 4)))
    parity.record(results, "clean-mask-refused", lambda: _clean_mask_refused(init_usp(1, 4)))
    two_heads = tiny_anyflow_far(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", lambda: parity.pipeline_cases(
        tiny_anyflow_far_pipeline((1, 2, 1)), _generate, PIPELINE_GRIDS, names=("latents", "frames")), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, _ = parity.grid_tests(parity.output_keys(SHAPES), [], TOL)


def test_disable_gives_back_stock_bit_for_bit_on_a_grid(grid_results):
    parity.assert_within(grid_results, "after-disable", 0.0)


def test_cfg_parallel_splits_the_batch_and_keeps_the_whole_cache(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_a_gradient_through_an_inference_call_is_refused_on_a_grid(grid_results):
    parity.assert_within(grid_results, "grad-refused", 0.0)


def test_the_training_rollout_is_refused_on_a_grid(grid_results):
    parity.assert_within(grid_results, "training-refused", 0.0)


def test_a_cache_mask_that_is_no_prefix_on_some_ranks_is_refused_on_all(grid_results):
    parity.assert_within(grid_results, "clean-mask-refused", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_pipeline_matches_one_process(grid_results, key: str):
    """(2,1) and (2,2) sequence-parallel; (1,2,2): the batched [negative; positive] split over cfg."""
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0, fallback="pipeline")


# ---- single process: one rank, restore exactly, loud failures ------------------------------------


def test_one_rank_matches_stock_and_disable_restores_it_bit_for_bit():
    """One rank runs the same merges as a grid (not stock's flex kernel): within float32 rounding."""
    model, inputs = _build(SHAPES[0])
    ref = far_rollout(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        errors = _errors(far_rollout(model, inputs), ref)
    finally:
        ADAPTER.disable(model)
    assert max(errors.values()) <= TOL, errors
    assert all(torch.equal(a, b) for a, b in zip(far_rollout(model, inputs)[0], ref[0]))


def test_a_cache_call_mask_that_is_no_prefix_is_refused():
    model, inputs = _build(SHAPES[1])
    kwargs = _clean_mask_kwargs(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with torch.no_grad(), pytest.raises(NotImplementedError, match="prefix of the keys"):
            model(**kwargs)
    finally:
        ADAPTER.disable(model)


def test_a_cache_call_mask_of_another_call_is_refused():
    """A mask built for another chunk partition (one chunk of 7 full frames: 147 tokens): ValueError
    naming both padded lengths."""
    model, inputs = _build(SHAPES[0])
    kwargs = inputs.kwargs(cache_call=3)  # 9 compressed + 21 full tokens, padded to 128
    kwargs["attention_mask"] = model.build_attention_mask(chunk_partition=[7], height=6, width=14, mode="cache")
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=r"BlockMask is \(256, 256\).*are 128"):
            model(**kwargs)
    finally:
        ADAPTER.disable(model)


test_find_adapter_finds_the_far_model = family_checks.adapter_found(tiny_anyflow_far, ADAPTER)
test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, (USPFARSelfAttnProcessor, transformer_anyflow_far.AnyFlowCrossAttnProcessor))
test_a_bidirectional_processor_in_attn1_is_refused = family_checks.foreign_processor_refused(
    tiny_anyflow_far, ADAPTER, "blocks.1.attn1", transformer_anyflow_far.AnyFlowAttnProcessor)
test_diffusers_context_parallelism_is_refused = family_checks.context_parallelism_refused(
    tiny_anyflow_far, ADAPTER, "blocks.0.attn1")
test_no_blocks_is_refused = family_checks.no_blocks_refused(lambda: tiny_anyflow_far(num_layers=0), ADAPTER)
test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(
    tiny_anyflow_far, ADAPTER, "AnyFlowFAR")
