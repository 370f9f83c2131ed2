"""Wan-Animate-2 adapter: both passes (reference extract, then cached generation) equal one process's.

One spawned group of 4 ranks runs every case (the 2-rank grids run on it as two data-parallel
replicas of 2 ranks). Model: a tiny 2-layer ``WanAnimate2Transformer3DModel`` (4 heads x 16,
CLIP image tokens, every weight perturbed; ``usp_dit.demo.tiny_wan_animate2``). Each case runs a
segment as the pipeline does: the reference pass into a fresh ``WanAnimate2KVCache``, then two
generation calls on it (the conditional, then the unconditional one: the second reads the
memoised reference window), batch 2 with a different driving video, prompt (of a different
length), CLIP image and timestep per sample; the outputs of all three calls are compared. The
stock reference builds its BlockMask uncompiled (``tiny_wan_animate2.eager_block_masks``: the
same mask, without a half-minute inductor build per rank).

Shapes (reference grid F_r, generation grid F x h x w, video geometry F0 x HW0 of the block mask):
  * r2f3h3w5o2x15: the pipeline's geometry (F = F_r + 1 = F0 + 1, h w = HW0): 45 generation and
    30 reference tokens; 45 on 4 ranks is 12 | 11 | 11 | 11 against frames of 15, so ranks'
    queries straddle frame boundaries and their reference windows overlap;
  * r3f5h1w3o4x5: a generation grid smaller than the video geometry (h w = 3 < HW0 = 5) and fewer
    reference frames than F0: zero keys in both parts of stock's packed buffer (10 in the
    generation part, 2 or 5 per frame in the reference part) and a last frame with no real
    reference key (Note [generation attention as a merge]); 15 and 9 tokens.
Neither generation count divides 2 or 4.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS),
ring grids also with "stream" and "gather_merge" forced (tests/adapter_parity Note [schedules in
CI]). Each case: outputs vs stock; block 0's self-attention sees at most ceil(tokens / P) tokens in
both passes, its cache holds at most ceil(reference tokens / P) rows and a window of exactly the
reference frames the rank's queries read (Note [where the reference cache lives]); after
``disable`` bit-identical. Also: a cache written by stock (the reference pass before ``enable``)
read under the adapter; the reference pass's parameter gradients on 2 ranks (first shape) and 4
(second shape); the generation pass's parameter gradients (Note [generation gradient]: the merge
through the LSE's gradient) on (1,2) (first shape, "stream") and (2,2) (second shape), the
reference pass under ``no_grad``, and on (2,1) behind a stock-written cache that requires a
gradient (the gradient flowing into the reference pass too), against one process's stock model
whose flex attention (no backward on CPU) is replaced by the same BlockMask's mask evaluated
densely under a plain masked softmax (``_dense_flex``); a gradient into a cache the adapter wrote
on a grid refused (NotImplementedError on every rank); through
``usp_dit.enable_usp`` on (2,1), (2,2) and cfg (1,2,2), whose two guidance calls of a step run on
the two cfg groups (``cfg_pair``), with the branch arguments ``encoder_hidden_states`` and
``is_uncondtion``.

The stock pipeline: ``pipe.enable_usp()`` on the modular pipeline of Diffusers'
``WanAnimate2CoreDenoiseStep`` (``tiny_wan_animate2_denoise``: the segment loop as the release
runs it -- VAE-encode the driving slice and the previous segment's tail, noise, the reference pass
into a fresh cache, guided denoising with a ``ClassifierFreeGuidance`` guider at 3.0, decode)
around the tiny transformer and a tiny ``AutoencoderKLWan``, 48 x 80 pixels, two segments of 5
frames (the second conditioned on the first's decoded last frame), 2 steps each: 45 generation
and 30 reference tokens a call (``wan_animate2_denoise_inputs``, seeded, the same seed on every
rank, and once seeded by each rank's rank on (2,2)), on (2,1), (2,2) and (1,2,2) against one process: every segment's denoised latents (as the
VAE decodes them) and the ``segment_frames``; the transformer enabled, then restored; every VAE
encode and decode of the loop split over the replica's ranks (the parallel VAE); at cfg 2
block 0 ran S (steps + 1) + 1 = 7 times a rank, not 10 (the guidance calls paired by ``cfg_pair``
from the first segment's first step on, the reference pass run whole by both cfg groups); after
``disable_usp`` bit-identical.

Not here, and why: the encoder steps (UMT5, CLIP vision, pose/face video preprocessing) and the
final decode step: they run before and after the core step, untouched by ``enable_usp`` but for
the parallel VAE, which the core step's in-loop decode already runs; the text and CLIP inputs are
seeded tensors. (Noise from a generator seeded differently on each rank is tested: the segment
loop draws it inside its block state, and the call's generators take rank 0's state first, Note
[modular pipelines].) No compiled case: stock's forward reads grids with ``.tolist()`` / ``.item()`` (a graph break), so
no fullgraph compile of this transformer exists, enabled or not.

Tolerance: max|err| / max|ref| <= 1e-5 (float32): sharding only reorders float32 sums (attention
merged by log-sum-exp against stock's one masked softmax; gradients summed over ranks). Decoded
frames: 1e-4, an untrained random VAE's gain on the latents' rounding (measured: frames 2.4e-6
for latents 8.6e-7), as tests/test_pipeline_flux3.py's images.
"""
from __future__ import annotations

import contextlib
import functools
import io
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from diffusers.models.transformers import transformer_wan_animate_2 as stock
from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
from torch.nn.attention.flex_attention import BlockMask

from tests import adapter_parity as parity
from usp_dit import disable_usp, enable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_wan_animate2 import (
    SegmentShape,
    eager_block_masks,
    run_segment,
    segment_inputs,
    tiny_wan_animate2,
    tiny_wan_animate2_denoise,
    wan_animate2_denoise_inputs,
)
from usp_dit.pipelines.families.wan_animate2 import ADAPTER, Geometry, rope_rows
from usp_dit.sharding.partition import split_sizes
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4  # decoded frames: an untrained random VAE's gain (as tests/test_pipeline_flux3.py's images)
WORLD = 4
SHAPES = [SegmentShape(2, 3, 3, 5, 2, 15), SegmentShape(3, 5, 1, 3, 4, 5)]
GRAD_SHAPES = {2: SHAPES[:1], 4: SHAPES[1:]}  # the reference pass's gradients: one shape per world size


@functools.cache
def _build(shape: SegmentShape):
    """One model and its inputs per shape, shared by the cases of a rank (each case disables what
    it enabled, and disable restores the model exactly: asserted in every output case)."""
    model = tiny_wan_animate2()
    return model, segment_inputs(model, shape)


@functools.cache
def _stock(shape: SegmentShape, calls: int = 2) -> torch.Tensor:
    """The one-process result of a segment (``run_segment``), computed once per shape."""
    return run_segment(*_build(shape), calls=calls)


def _needed_reference_frames(shape: SegmentShape, mesh) -> int:
    """Reference frames this rank's generation tokens read, counted token by token off stock's
    rule (generation frame f reads reference frame f - 1, if it exists)."""
    sizes = split_sizes(shape.tokens, mesh.sequence_degree)
    start = sum(sizes[:mesh.seq_rank])
    hw = shape.height * shape.width
    return len({j // hw - 1 for j in range(start, start + sizes[mesh.seq_rank])} & set(range(shape.ref_frames)))


def _output_case(shape: SegmentShape, mesh) -> dict[str, float]:
    """Both passes vs stock; the longest sequence block 0's self-attention saw vs ceil(S / P) of
    its pass; block 0's cache: at most ceil(S_ref / P) rows from the reference pass and, at the
    generation calls, a window of exactly the reference frames the rank's queries read; after
    disable, bit-identity."""
    model, inputs = _build(shape)
    ref = _stock(shape)
    seen, held = [], []
    attn = model.blocks[0].self_attn

    def cache_rows(module, args, kwargs, out) -> None:  # after the call: what the layer cache holds now
        cache = kwargs["kv_cache"]
        window = module.processor.windows.get(cache)
        held.append((cache.key.shape[1], None if window is None else window.frames))

    hooks = [attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((kwargs["kv_cache_mode"], args[0].shape[1])), with_kwargs=True),
        attn.register_forward_hook(cache_rows, with_kwargs=True)]
    ADAPTER.enable(model, mesh, "auto")
    try:
        out = run_segment(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
        ADAPTER.disable(model)
    again = run_segment(model, inputs)
    bound = {"extract": math.ceil(shape.ref_tokens / mesh.sequence_degree),
             "cached": math.ceil(shape.tokens / mesh.sequence_degree)}
    needed = _needed_reference_frames(shape, mesh)
    return {"out": rel_err(out, ref), "disable_not_bit_identical": float(not torch.equal(again, ref)),
            "block0_tokens_above_ceil": float(len(seen) != 3 or any(n > bound[mode] for mode, n in seen)),
            "cache_rows_above_ceil": float(len(held) != 3 or any(rows > bound["extract"] for rows, _ in held)),
            "window_not_the_frames_read": float(held[0][1] is not None or any(w != needed for _, w in held[1:]))}


def _stock_cache_case(mesh) -> dict[str, float]:
    """The reference pass run by stock (every row in the cache), the generation calls enabled."""
    model, inputs = _build(SHAPES[0])
    want = _stock(SHAPES[0])
    cache = WanAnimate2KVCache(model.config.num_layers)
    outs = []
    with torch.no_grad(), eager_block_masks():
        model(**inputs.extract(cache))
        ADAPTER.enable(model, mesh, "auto")
        try:
            for uncond in (False, True):
                outs += model(**inputs.cached(cache, is_uncondtion=uncond)).sample
        finally:
            ADAPTER.disable(model)
    got = torch.cat([o.flatten() for o in outs])
    return {"out": rel_err(got, want[-got.numel():])}  # the two generation calls' outputs


class _ExtractCall:
    """``gradient_errors``' inputs: the reference pass, into a fresh cache at each call."""

    def __init__(self, model, inputs) -> None:
        self.model, self.inputs = model, inputs

    def kwargs(self) -> dict:
        return self.inputs.extract(WanAnimate2KVCache(self.model.config.num_layers))


def _gradient_case(shape: SegmentShape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.gradient_errors(model, _ExtractCall(model, inputs), ADAPTER, mesh)


@contextlib.contextmanager
def _dense_flex():
    """Stock's generation calls with a differentiable stand-in for flex attention, which has no
    backward on CPU: the BlockMask's own ``mask_mod`` evaluated on every (query, key) pair, then a
    masked softmax (a row with no visible key, a padded query, gives 0 like flex, with no NaN)."""
    original = stock.dispatch_attention_fn

    def dispatch(query, key, value, attn_mask=None, **kwargs):
        if not isinstance(attn_mask, BlockMask):
            return original(query, key, value, attn_mask=attn_mask, **kwargs)
        zero = torch.zeros((), dtype=torch.long)
        visible = attn_mask.mask_mod(zero, zero, torch.arange(query.shape[1])[:, None],
                                     torch.arange(key.shape[1])[None, :])  # (Sq, Sk)
        rows = visible.any(-1, keepdim=True)
        scores = torch.einsum("bqhd,bkhd->bhqk", query, key) * query.shape[-1] ** -0.5
        probs = torch.softmax(scores.masked_fill(~(visible | ~rows), float("-inf")), dim=-1) * rows
        return torch.einsum("bhqk,bkhd->bqhd", probs, value)

    with mock.patch.object(stock, "dispatch_attention_fn", dispatch):
        yield


def _generation_grads(model, inputs, mesh, divisor: int, reference_grad: bool) -> dict[str, torch.Tensor]:
    """Parameter gradients of (out * w).sum() / ``divisor`` over one generation call's output, its
    reference pass under ``no_grad`` unless ``reference_grad`` (the cache then requires a gradient);
    ``mesh`` None: stock (``_dense_flex``), else the pass's own enabled model (the reference pass
    run by stock when ``reference_grad``: a cache that holds every row)."""
    cache = WanAnimate2KVCache(model.config.num_layers)
    with eager_block_masks(), _dense_flex():
        with torch.set_grad_enabled(reference_grad):
            model(**inputs.extract(cache))
        if mesh is not None:
            ADAPTER.enable(model, mesh, "auto")
        try:
            out = torch.cat([o.flatten() for o in model(**inputs.cached(cache)).sample])
        finally:
            if mesh is not None:
                ADAPTER.disable(model)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    params = dict(model.named_parameters())
    grads = torch.autograd.grad((out * weight).sum() / divisor, list(params.values()), allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)}


def _generation_gradient_case(shape: SegmentShape, mesh, reference_grad: bool = False) -> dict[str, float]:
    """Every parameter's gradient of a generation call (each rank's loss L / P, summed over the
    sequence group) vs one process's (Note [generation gradient])."""
    model, inputs = _build(shape)
    ref = _generation_grads(model, inputs, None, 1, reference_grad)
    grads = _generation_grads(model, inputs, mesh, mesh.sequence_degree, reference_grad)
    worst = 0.0
    for name, g in grads.items():
        g = g.contiguous()  # gloo reduces contiguous buffers only
        dist.all_reduce(g, group=mesh.seq_group)
        worst = max(worst, rel_err(g, ref[name]))
    return {"grad": worst}


def _cache_gradient_refused(mesh) -> dict[str, float]:
    """The reference pass under the adapter with a gradient, then a generation call: its window would
    come by a forward-only exchange, so NotImplementedError on every rank."""
    model, inputs = _build(SHAPES[0])
    cache = WanAnimate2KVCache(model.config.num_layers)
    ADAPTER.enable(model, mesh, "auto")
    try:
        with eager_block_masks():
            model(**inputs.extract(cache))
            model(**inputs.cached(cache))
    except NotImplementedError as exc:
        return {"wrong_error": float("a gradient into the reference K/V cache" not in str(exc))}
    finally:
        ADAPTER.disable(model)
    return {"did_not_raise": 1.0}


def _enable_usp_case(mesh) -> dict[str, float]:
    """Through ``usp_dit.enable_usp`` (input sync, call handshake; at cfg 2 the guidance pairs of
    ``cfg_pair``): reference pass, then two steps of (conditional, unconditional) calls."""
    model, inputs = _build(SHAPES[0])
    ref = _stock(SHAPES[0], calls=4)
    enable_usp(model, mesh=mesh)
    try:
        out = run_segment(model, inputs, calls=4)
    finally:
        disable_usp(model)
    return {"out": rel_err(out, ref)}


# ---- the stock modular pipeline ------------------------------------------------------------------

PIPELINE_STEPS, PIPELINE_SEGMENTS = 2, 2
PIPELINE_GRIDS = parity.ci_grids(parity.pipeline_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)]))


def _denoise(pipe, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(every segment's denoised latents as its VAE decodes them, (1, C, 2 per segment, 6, 10);
    the ``segment_frames``, (1, 3, 5 + 4, 48, 80)) of a run of the core denoise step whose
    generator is seeded ``seed``."""
    seen = []
    decode = pipe.vae.decode

    def spy(z: torch.Tensor, **kwargs):
        seen.append(z.clone())
        return decode(z, **kwargs)

    with mock.patch.object(pipe.vae, "decode", spy), eager_block_masks():
        frames = pipe(**wan_animate2_denoise_inputs(PIPELINE_SEGMENTS), num_inference_steps=PIPELINE_STEPS,
                      generator=torch.Generator().manual_seed(seed), output="segment_frames")
    return torch.cat(seen, dim=2), torch.cat(frames, dim=2)


@contextlib.contextmanager
def _probe(pipe, grid: tuple[int, int, int]):
    """The ``pipeline_cases`` probe. 1.0 under "vae_not_split" unless every VAE encode and decode of
    the run (a segment's: the driving slice and the previous tail encoded, the segment decoded)
    was split over the replica's ranks (no reason to run one whole noted). At cfg 2: block 0 runs
    once a segment for the reference pass (a batch of one: both cfg groups run it whole) and once
    a step for the paired guidance calls (``cfg_pair``), but for the first step of the first
    segment, whose two calls teach the pair: S (STEPS + 1) + 1 computations a rank, not
    S (2 STEPS + 1) (``parity.cfg_pair_computations``' steps + 1 with steps := S (STEPS + 1))."""
    from usp_dit.pipelines.vae.patch import _STATES

    with parity.cfg_pair_computations(pipe, grid, PIPELINE_SEGMENTS * (PIPELINE_STEPS + 1), "blocks") as measure:
        def quantities() -> dict[str, float]:
            state = _STATES.get(pipe.vae)  # made by enable, dropped by disable: this grid's
            split = state is not None and not state.logged and not any(state.reasons.values())
            return {"vae_not_split": float(not split), **measure()}

        yield quantities


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The stock ``WanAnimate2CoreDenoiseStep`` pipeline (``tiny_wan_animate2_denoise``: two segments,
    the second conditioned on the first's decoded last frame) through ``pipe.enable_usp()`` on each
    grid, against the same pipeline on one process (``adapter_parity.pipeline_cases``)."""
    return parity.pipeline_cases(tiny_wan_animate2_denoise(), _denoise, PIPELINE_GRIDS, names=("latents", "frames"),
                                 probe=_probe)


def _rank_seeded_case() -> dict[str, float]:
    """Note [modular pipelines], noise in loops: each segment draws its noise inside the loop from
    the call's generator; seeded by each rank's rank, ``pipe.enable_usp()`` on (2,2,1) gives every
    rank one process's latents and frames with rank 0's seed (without the generator sync the
    parallel VAE refuses the first decode: the ranks' latents differ). The step's own ``tqdm``
    (one bar a segment) shows on rank 0 alone."""
    import torch.distributed as dist

    pipe = tiny_wan_animate2_denoise()
    ref = _denoise(pipe)
    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    bars = io.StringIO()  # the block's own tqdm ("Segment k/S") writes to sys.stderr
    try:
        with contextlib.redirect_stderr(bars):
            got = _denoise(pipe, seed=dist.get_rank())
    finally:
        pipe.disable_usp()
    shown = "Segment 1/" in bars.getvalue()
    return {"latents": rel_err(got[0], ref[0]), "frames": rel_err(got[1], ref[1]),
            # Note [modular pipelines], progress: rank 0 alone shows the block's own bar
            "bar_wrong": float(shown != (dist.get_rank() == 0))}


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case, grad_shapes=GRAD_SHAPES)
    parity.record(results, "stock-cache-u2r2", lambda: _stock_cache_case(init_usp(2, 2)))
    parity.record(results, "generation-grad-u1r2", lambda: _generation_gradient_case(
        SHAPES[0], init_usp(1, 2, ring_schedule="stream")))
    parity.record(results, "generation-grad-u2r2", lambda: _generation_gradient_case(SHAPES[1], init_usp(2, 2)))
    parity.record(results, "generation-grad-stock-cache-u2r1",
                  lambda: _generation_gradient_case(SHAPES[1], init_usp(2, 1), reference_grad=True))
    parity.record(results, "cache-grad-refused", lambda: _cache_gradient_refused(init_usp(1, 2)))
    for grid in [(2, 1, 1), (2, 2, 1), (1, 2, 2)]:
        parity.record(results, f"enable_usp-u{grid[0]}r{grid[1]}cfg{grid[2]}",
                      lambda grid=grid: _enable_usp_case(init_usp(*grid)))
    parity.record(results, "ulysses-above-heads", lambda: parity.ulysses_above_heads_case(
        tiny_wan_animate2(num_heads=2, head_dim=32), ADAPTER, init_usp(4, 1)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    parity.record(results, "pipeline-rank-seeded", _rank_seeded_case)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES)
    + ["stock-cache-u2r2", "enable_usp-u2r1cfg1", "enable_usp-u2r2cfg1", "enable_usp-u1r2cfg2"],
    parity.grad_keys(by_world=GRAD_SHAPES), TOL,
)


@pytest.mark.parametrize("key", ["generation-grad-u1r2", "generation-grad-u2r2", "generation-grad-stock-cache-u2r1"])
def test_generation_pass_gradients_match_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


def test_gradient_into_an_exchanged_cache_is_refused(grid_results):
    parity.assert_within(grid_results, "cache-grad-refused", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_modular_pipeline_matches_one_process(grid_results, key: str):
    """Latents within TOL, decoded frames within TOL_FRAMES, on every rank; the transformer enabled
    and restored; every VAE encode and decode split; at cfg 2 the guider's two calls of a step ran
    on the two cfg groups."""
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_frames(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0, fallback="pipeline")


def test_rank_seeded_noise_in_each_segment_is_the_first_ranks(grid_results):
    parity.assert_within(grid_results, "pipeline-rank-seeded", TOL, {"frames": TOL_FRAMES})


# ---- single process -------------------------------------------------------------------------------


def test_one_rank_equals_stock_and_disable_restores():
    """Enabled on one rank the segment equals stock (the merge, not stock's packed call: float32
    rounding only); after disable, stock's processors, bit for bit."""
    model, inputs = _build(SHAPES[1])
    before = [m.processor for m in model.modules() if hasattr(m, "processor")]
    ref = run_segment(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    out = run_segment(model, inputs)
    ADAPTER.disable(model)
    assert rel_err(out, ref) <= TOL
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == before
    assert not [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert torch.equal(run_segment(model, inputs), ref)


@pytest.mark.parametrize("start, rows", [(0, 30), (7, 11), (29, 1)])
def test_rope_rows_equal_stock_rope_apply_rows(start: int, rows: int):
    """Rows [start, start + rows) rotated alone equal the same rows of stock's whole rotation."""
    from diffusers.models.transformers.transformer_wan_animate_2 import rope_apply

    model = tiny_wan_animate2()
    freqs = model._rope_freqs((1, 0, 5), torch.device("cpu"))
    x = torch.randn(2, 30, 4, 16, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[2, 3, 5], [2, 3, 5]])
    whole = rope_apply(x, grid, freqs, 2)
    assert torch.equal(rope_rows(x[:, start:start + rows], (2, 3, 5), freqs, 2, start), whole[:, start:start + rows])


def test_zero_keys_follow_stock_mask():
    """Zero-key counts per generation frame, counted off stock's mask rule directly."""
    g = Geometry(frames=5, hw=3, ref_frames=3, ref_hw=3, origin_frames=4, origin_hw=5)
    counts = g.zero_keys(torch.arange(5)).tolist()
    base = 5 * 5 - 5 * 3
    assert counts == [base, base + 2, base + 2, base + 2, base + 5]


def test_grids_outside_the_packed_buffer_raise():
    with pytest.raises(ValueError, match="do not fit the packed buffer"):
        Geometry(frames=3, hw=16, ref_frames=2, ref_hw=15, origin_frames=2, origin_hw=15).check()
    with pytest.raises(NotImplementedError, match="beyond origin_len"):
        Geometry(frames=4, hw=15, ref_frames=2, ref_hw=15, origin_frames=2, origin_hw=15).check()


def test_the_video_example_builds_and_runs_the_tiny_wan_animate2():
    """examples/generate_video.py --model wan_animate2: the tiny core denoise step on one process
    (1 step, two segments), RGB frames in [0, 1]; --model-path is refused (the example seeds what
    the encoder steps would hand over)."""
    from tests.test_examples_cli import _example
    from usp_dit.cli.launch import UsageError

    ex = _example("generate_video")
    args = ex.parse_args(["--model", "wan_animate2", "--steps", "1"])
    frames = ex.generate(ex.load_pipeline(args, torch.device("cpu")), args)
    assert frames.shape == (9, 48, 80, 3) and bool((frames >= 0).all() and (frames <= 1).all())
    with pytest.raises(UsageError, match="--model-path with --model wan_animate2"):
        ex.parse_args(["--model", "wan_animate2", "--model-path", "."])
