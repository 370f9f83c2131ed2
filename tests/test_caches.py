"""Diffusers' step caches under ``enable_usp``: a cached run on a grid equals the same cached run on one process.

``usp_dit.pipelines.caches`` Note [step caches under USP]. One spawned group of 4 ranks runs every
case. Pipelines: the tiny ``FluxPipeline`` (32 x 32: 64 image + 16 text tokens, 2 images per
prompt so that the cfg axis has a batch to split; guidance-distilled, one call a step) and the tiny
``CogVideoXPipeline`` (48 x 48 x 9 frames: 27 video tokens; classifier-free guidance batched as
[uncond, cond]), 6 steps each. Caches: FirstBlockCache, MagCache, TaylorSeer (float32 factors),
Pyramid Attention Broadcast, each with settings under which it skips work in those 6 steps.

Each rank first runs every pipeline uncached and with each cache on one process (the references),
then for each grid (U, R, cfg) in (2, 2, 1), (1, 2, 2), (4, 1, 1) and each enable order:

    cache-first   enable_cache, enable_usp, run, disable_cache, disable_usp
    usp-first     enable_usp, enable_cache, run, disable_usp (the cache still on), disable_cache

and checks: the final latents and the decoded output equal the cached one-process run's; the
number of attention computations (calls of the attention modules' ``to_q``) equals the cached
one-process run's on every rank (every rank took one process's skip decisions); FBC's reduced
metric is installed during the run and gone after ``disable_usp``. Per cache, the cached
one-process run computes fewer attentions than the uncached one and its latents differ from the
uncached ones by more than 1e-3 (the cache did something, so the comparison proves something).
MagCache in calibration mode: the ratios it logs on each rank equal one process's (a mean over
the replica's tokens, with cfg over its batch too). After all, the uncached runs are bit-identical
to the first ones. FasterCache: refused at the first call when enabled after ``enable_usp`` (on
every rank, and the group goes on), ``disable_usp`` refused until ``disable_cache``. FBC on a
two-call pipeline (Wan) at cfg_degree=2: refused before the first speculated call.

FBC thresholds sit far from every metric of these runs (measured: Flux 1.015, 0.881 | 0.726, 0.745
skipped | 0.830 against 0.8; CogVideoX 1.595 | 0.659 skipped | 0.890 | 0.837 skipped | 0.918
against 0.85), so float32 summation order (~1e-7) cannot flip a decision.

Tolerance: max|err| / max|ref| <= 1e-5 on latents and Flux images, 3e-4 on CogVideoX frames: the
untrained random video VAE multiplies the ~1e-6 of the latents (guidance 6x) tenfold to a
hundredfold, depending on the direction of the difference (tests/test_video_pipelines.py measured
1.5e-6 -> 1.4e-5; here, First Block Cache on (2,2) with transformers 5.25: final latents 1.03e-6
apart, and the *one-process* decode of the grid's latents is already 1.17e-4 from the reference
frames, while the parallel decode of those latents is 8.5e-6 from the one-process decode of the
same latents: the grid adds nothing, the VAE's gain does it). Calibration ratios: 1e-5.
"""
from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from diffusers.hooks import (
    FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig, PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig,
)

import usp_dit
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.caches import (
    ReducedFirstBlockDecision, _block_hooks, cache_refusal, check_no_hook_over_usp, first_block_sums,
)
from usp_dit.demo.tiny_flux import flux_inputs, tiny_flux_pipeline, tiny_flux_transformer
from usp_dit.demo.tiny_video import tiny_cogvideox_pipeline
from usp_dit.testing import assert_no_crash, rel_err, run_spawned

WORLD = 4
STEPS = 6
GRIDS = [(2, 2, 1), (1, 2, 2), (4, 1, 1)]  # (ulysses, ring, cfg)
ORDERS = ("cache-first", "usp-first")
TOL = {"latents": 1e-5, "images": 1e-5, "frames": 3e-4}
CHANGED = 1e-3  # a cache that skips must move the latents at least this much


# ---- the pipelines and caches ---------------------------------------------------------------------


def _run_flux(pipe, callback) -> torch.Tensor:
    return pipe("a tiny red fox", height=32, width=32, num_inference_steps=STEPS, guidance_scale=3.5,
                max_sequence_length=16, num_images_per_prompt=2, generator=torch.Generator().manual_seed(0),
                output_type="pt", callback_on_step_end=callback).images


def _run_cogvideox(pipe, callback) -> torch.Tensor:
    return pipe(prompt="a red fox", negative_prompt="blurry", height=48, width=48, num_frames=9,
                num_inference_steps=STEPS, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
                output_type="pt", callback_on_step_end=callback).frames


def _mag(calibrate: bool = False) -> MagCacheConfig:
    if calibrate:
        return MagCacheConfig(calibrate=True, num_inference_steps=STEPS)
    # retention 1 step, then skip while the accumulated error allows, at most 2 in a row: steps 0, 3 computed
    return MagCacheConfig(threshold=0.5, max_skip_steps=2, retention_ratio=0.2, num_inference_steps=STEPS,
                          mag_ratios=[1.0] + [1.05] * (STEPS - 1))


def _pab(pipe) -> PyramidAttentionBroadcastConfig:
    return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                           spatial_attention_timestep_skip_range=(-1, 1001),
                                           current_timestep_callback=lambda: pipe.current_timestep)


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], object]
    run: Callable[[object, Callable], torch.Tensor]
    output: str  # "images" or "frames"
    fbc_threshold: float
    taylor_identifiers: tuple[str, ...] | None  # None: TaylorSeer's defaults hook the attention modules

    def caches(self, pipe) -> dict[str, Callable[[], object]]:
        """Fresh configs (a config is bound to the hooks it made)."""
        taylor = dict(cache_identifiers=list(self.taylor_identifiers)) if self.taylor_identifiers else {}
        return {
            "fbc": lambda: FirstBlockCacheConfig(threshold=self.fbc_threshold),
            "mag": _mag,
            "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, max_order=1,
                                                        taylor_factors_dtype=torch.float32, **taylor),
            "pab": lambda: _pab(pipe),
        }


FAMILIES = [
    Family("flux", tiny_flux_pipeline, _run_flux, "images", 0.8, None),
    # CogVideoX's attention modules are attn1: outside TaylorSeer's default patterns ("...attn")
    Family("cogvideox", lambda: tiny_cogvideox_pipeline(max_text_len=16), _run_cogvideox, "frames", 0.85,
           (r"^transformer_blocks.*attn1",)),
]
CACHES = ("fbc", "mag", "taylorseer", "pab")


class AttentionCount:
    """How many attention modules' forwards reached their ``to_q`` projection: how many attentions
    were computed (a skipped block never calls its attention, a broadcast or predicted one returns
    before its projections). Counted once per forward: usp_dit's CogVideoX processor projects the
    text and the video shard in two ``to_q`` calls."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.n = 0
        self.armed: set[int] = set()
        for module in model.modules():
            if isinstance(getattr(module, "to_q", None), torch.nn.Module):
                module.register_forward_pre_hook(self._arm)
                module.to_q.register_forward_pre_hook(lambda m, args, attn=id(module): self._count(attn))

    def _arm(self, module, args) -> None:
        self.armed.add(id(module))

    def _count(self, attn: int) -> None:
        if attn in self.armed:
            self.armed.discard(attn)
            self.n += 1


def _generate(family: Family, pipe, counter: AttentionCount) -> dict:
    last = {}

    def keep_latents(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return {}

    counter.n = 0
    out = family.run(pipe, keep_latents)
    return {"latents": last["latents"], family.output: out, "attentions": counter.n}


def _generate_calibrating(family: Family, pipe, counter: AttentionCount) -> tuple[dict, list[float]]:
    """A run with MagCache calibrating; the ratios it prints at the last step."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = _generate(family, pipe, counter)
    found = re.findall(r"^\[([-0-9.e, ]+)\]$", printed.getvalue(), flags=re.M)
    return result, [float(x) for x in found[-1].split(",")] if found else []


def _errors(result: dict, ref: dict, family: Family) -> dict[str, float]:
    return {
        "latents": rel_err(result["latents"], ref["latents"]),
        family.output: rel_err(result[family.output], ref[family.output]),
        "attentions_differ": float(result["attentions"] != ref["attentions"]),
    }


def _reduced_metric_installed(model) -> bool:
    return any(isinstance(h.__dict__.get("_should_compute_remaining_blocks"), ReducedFirstBlockDecision)
               for _, h in _block_hooks(model))


def _patch_left(model) -> bool:
    return any(attr in h.__dict__ for _, h in _block_hooks(model)
               for attr in ("_should_compute_remaining_blocks", "_perform_calibration_step"))


def _grid_run(family: Family, pipe, counter, make_config, grid, order: str, calibrate: bool = False):
    """One cached run on ``grid`` in ``order``; (result, calibration ratios, checks)."""
    u, r, c = grid
    model = pipe.transformer
    if order == "cache-first":
        model.enable_cache(make_config())
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
    else:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        model.enable_cache(make_config())
    try:
        result, ratios = (_generate_calibrating(family, pipe, counter) if calibrate
                          else (_generate(family, pipe, counter), []))
        installed = _reduced_metric_installed(model)
    finally:
        if order == "cache-first":
            model.disable_cache()
            pipe.disable_usp()
        else:
            pipe.disable_usp()
            left = _patch_left(model)  # the cache's hooks are still there: usp_dit's metrics must be gone
            model.disable_cache()
    checks = {"not_restored": float(is_usp_enabled(pipe) or model.is_cache_enabled)}
    if order == "usp-first":
        checks["patch_left"] = float(left)
    return result, ratios, installed, checks


def _family_cases(family: Family) -> dict[str, dict]:
    pipe = family.build()
    pipe.set_progress_bar_config(disable=True)
    counter = AttentionCount(pipe.transformer)
    uncached = _generate(family, pipe, counter)
    results = {}
    for cache in CACHES:
        make = family.caches(pipe)[cache]
        pipe.transformer.enable_cache(make())
        ref = _generate(family, pipe, counter)
        pipe.transformer.disable_cache()
        results[f"{family.name}-{cache}-does-something"] = {
            "skipped_nothing": float(ref["attentions"] >= uncached["attentions"]),
            "latents_unchanged": float(rel_err(ref["latents"], uncached["latents"]) <= CHANGED),
        }
        for grid in GRIDS:
            for order in ORDERS:
                key = f"{family.name}-{cache}-u{grid[0]}r{grid[1]}cfg{grid[2]}-{order}"
                try:
                    result, _, installed, checks = _grid_run(family, pipe, counter, make, grid, order)
                    errors = {**_errors(result, ref, family), **checks}
                    if cache == "fbc":
                        errors["reduced_metric_not_installed"] = float(not installed)
                    results[key] = errors
                except Exception as exc:
                    results[key] = f"{type(exc).__name__}: {exc}"
    # MagCache calibrating: never skips; the ratios it logs are a mean over the replica's tokens.
    pipe.transformer.enable_cache(_mag(calibrate=True))
    _, ref_ratios = _generate_calibrating(family, pipe, counter)
    pipe.transformer.disable_cache()
    for grid in GRIDS:
        key = f"{family.name}-mag-calibration-u{grid[0]}r{grid[1]}cfg{grid[2]}"
        try:
            _, ratios, _, checks = _grid_run(family, pipe, counter, lambda: _mag(calibrate=True), grid, "usp-first",
                                             calibrate=True)
            same_length = len(ratios) == len(ref_ratios) == STEPS
            worst = max((abs(a - b) / abs(b) for a, b in zip(ratios, ref_ratios)), default=1.0)
            results[key] = {"ratios": worst if same_length else 1.0, **checks}
        except Exception as exc:
            results[key] = f"{type(exc).__name__}: {exc}"
    again = _generate(family, pipe, counter)
    same = all(torch.equal(again[k], uncached[k]) for k in ("latents", family.output))
    results[f"{family.name}-restored"] = {"not_bit_identical": float(not same)}
    return results


# ---- refusals on the grid ---------------------------------------------------------------------------


def _faster_cache_config(pipe) -> FasterCacheConfig:
    return FasterCacheConfig(current_timestep_callback=lambda: pipe.current_timestep, tensor_format="BFCHW",
                             attention_weight_callback=lambda _: 0.5)


def _faster_cache_case() -> dict[str, float]:
    """FasterCache on the CogVideoX pipeline, (2, 2, 1): refused at enable_usp (cache first), and at
    the first call (enabled after); disable_usp refused until disable_cache; then all is as before."""
    pipe = tiny_cogvideox_pipeline(max_text_len=16)
    pipe.set_progress_bar_config(disable=True)
    counter = AttentionCount(pipe.transformer)
    family = FAMILIES[1]
    ref = _generate(family, pipe, counter)
    out = {}
    pipe.transformer.enable_cache(_faster_cache_config(pipe))
    try:
        pipe.enable_usp(ulysses_degree=2, ring_degree=2)
        out["enable_not_refused"] = 1.0
    except NotImplementedError as exc:
        out["enable_not_refused"] = float("FasterCacheConfig" not in str(exc))
    out["enabled_after_refusal"] = float(is_usp_enabled(pipe))
    pipe.transformer.disable_cache()

    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    pipe.transformer.enable_cache(_faster_cache_config(pipe))
    try:
        _generate(family, pipe, counter)
        out["call_not_refused"] = 1.0
    except NotImplementedError as exc:
        out["call_not_refused"] = float("FasterCacheConfig" not in str(exc) or "disable_cache" not in str(exc))
    try:
        pipe.disable_usp()
        out["disable_usp_not_refused"] = 1.0
    except ValueError as exc:
        out["disable_usp_not_refused"] = float("disable_cache() first" not in str(exc))
    pipe.transformer.disable_cache()
    pipe.disable_usp()
    # The group is still usable: a collective every rank enters, then the stock pipeline.
    flag = torch.ones(1)
    dist.all_reduce(flag)
    out["group_broken"] = float(flag.item() != WORLD)
    again = _generate(family, pipe, counter)
    out["not_bit_identical"] = float(not torch.equal(again["frames"], ref["frames"]))
    return out


def _two_call_cfg_case() -> dict[str, float]:
    """FBC with cfg_degree=2 on a pipeline that calls the transformer once per guidance branch
    (Wan): refused before the first speculated call (usp_dit.pipelines.cfg_pair), on every rank."""
    from usp_dit.demo.tiny_wan import tiny_wan_pipeline

    pipe = tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_usp(ring_degree=2, cfg_degree=2)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    try:
        pipe(prompt="a red fox", negative_prompt="blurry", height=48, width=80, num_frames=9, num_inference_steps=3,
             max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="pt")
        return {"not_refused": 1.0}
    except NotImplementedError as exc:
        return {"not_refused": float("cfg_degree=2" not in str(exc))}
    finally:
        pipe.transformer.disable_cache()
        pipe.disable_usp()


def _record(results: dict, key: str, fn: Callable[[], dict], many: bool = False) -> None:
    try:
        results.update(fn()) if many else results.__setitem__(key, fn())
    except Exception as exc:
        results[key] = f"{type(exc).__name__}: {exc}"


def _run_all() -> dict:
    results = {}
    for family in FAMILIES:
        _record(results, family.name, lambda: _family_cases(family), many=True)
    _record(results, "faster-cache-refused", _faster_cache_case)
    _record(results, "two-call-cfg-refused", _two_call_cfg_case)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    per_rank = run_spawned(_run_all, WORLD)
    assert_no_crash(per_rank)
    return per_rank


def _assert(per_rank: list[dict], key: str, tols: dict[str, float] | None = None) -> None:
    for rank, res in enumerate(per_rank):
        errors = res.get(key, "no result")
        if isinstance(errors, str) and key.split("-")[0] in res:  # the family failed as a whole
            errors = res[key.split("-")[0]]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {k: v for k, v in errors.items() if not v <= (tols or {}).get(k, 0.0)}
        assert not worst, f"rank {rank} {key}: above {tols or 0}: {worst}"


GRID_KEYS = [f"{f.name}-{c}-u{u}r{r}cfg{g}-{o}" for f in FAMILIES for c in CACHES for u, r, g in GRIDS for o in ORDERS]


@pytest.mark.parametrize("key", GRID_KEYS)
def test_cached_grid_run_equals_cached_one_process_run(grid_results, key: str):
    _assert(grid_results, key, TOL)


@pytest.mark.parametrize("key", [f"{f.name}-{c}-does-something" for f in FAMILIES for c in CACHES])
def test_each_cache_skips_work_and_changes_the_result(grid_results, key: str):
    _assert(grid_results, key)


@pytest.mark.parametrize("key", [f"{f.name}-mag-calibration-u{u}r{r}cfg{g}" for f in FAMILIES for u, r, g in GRIDS])
def test_magcache_calibration_ratios_are_the_whole_replicas(grid_results, key: str):
    _assert(grid_results, key, {"ratios": 1e-5})


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_pipeline_is_bit_identical_after_all(grid_results, name: str):
    _assert(grid_results, f"{name}-restored")


def test_faster_cache_is_refused_on_every_rank_without_a_hang(grid_results):
    _assert(grid_results, "faster-cache-refused")


def test_a_cache_with_two_call_cfg_parallel_is_refused(grid_results):
    _assert(grid_results, "two-call-cfg-refused")


# ---- one process --------------------------------------------------------------------------------------


def _flux_call(batch: int = 2, seed: int = 0) -> dict:
    """A tiny Flux-dev transformer's call: 16 image and 3 text tokens, guidance 3.5."""
    return {**flux_inputs(batch, 4, 4, 3, seed=seed), "guidance": torch.full((batch,), 3.5)}


def test_first_block_metric_is_a_sum_over_any_split_of_batch_and_tokens():
    """FBC's mean|r - p| / mean|p| is sum|r - p| / sum|p|: the sums of uneven token shards of each
    cfg half add up to the whole's (float64), and their ratio is the stock metric."""
    g = torch.Generator().manual_seed(0)
    r, p = torch.randn(4, 37, 24, generator=g), torch.randn(4, 37, 24, generator=g)
    stock = ((r - p).abs().mean() / p.abs().mean()).item()
    parts = torch.zeros(2, dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 4)):  # the cfg groups' halves of the batch
        for lo, hi in ((0, 10), (10, 19), (19, 28), (28, 37)):  # uneven sequence shards
            parts += first_block_sums(r[rows, lo:hi], p[rows, lo:hi])
    assert torch.allclose(parts, first_block_sums(r, p), rtol=1e-12, atol=0)
    assert abs((parts[0] / parts[1]).item() - stock) <= 1e-6 * stock


@pytest.mark.parametrize("config", ["FirstBlockCacheConfig", "MagCacheConfig", "TaylorSeerCacheConfig",
                                    "PyramidAttentionBroadcastConfig"])
def test_supported_caches(config):
    assert cache_refusal(type(config, (), {})()) is None


def test_faster_cache_enabled_first_is_refused_at_enable_usp():
    model = tiny_flux_transformer()
    model.enable_cache(FasterCacheConfig(current_timestep_callback=lambda: 500))
    with pytest.raises(NotImplementedError, match=r"diffusers cache enabled \(FasterCacheConfig\).*FFT"):
        usp_dit.enable_usp(model)
    assert not is_usp_enabled(model)


def test_faster_cache_enabled_after_is_refused_at_the_call_and_disable_order():
    model = tiny_flux_transformer()
    inputs = _flux_call()
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
    usp_dit.enable_usp(model)
    model.enable_cache(FasterCacheConfig(current_timestep_callback=lambda: 500))
    with pytest.raises(NotImplementedError, match=r"FasterCacheConfig.*disable_cache\(\)"):
        with torch.no_grad(), model.cache_context("cond"):
            model(**inputs)
    # Its hook wraps the forward usp_dit installed: disable_usp first would cut it off.
    with pytest.raises(ValueError, match=r"disable_cache\(\) first"):
        usp_dit.disable_usp(model)
    assert is_usp_enabled(model)
    model.disable_cache()
    check_no_hook_over_usp(model)
    usp_dit.disable_usp(model)
    assert "forward" not in model.__dict__ and not model._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(model(**inputs, return_dict=False)[0], ref)


def test_an_unknown_cache_is_refused():
    @dataclass
    class SomeNewCacheConfig:
        threshold: float = 0.1

    model = tiny_flux_transformer()
    model._cache_config = SomeNewCacheConfig()
    with pytest.raises(NotImplementedError, match=r"\(SomeNewCacheConfig\).*has not checked"):
        usp_dit.enable_usp(model)


def test_at_one_rank_the_stock_metric_stays():
    """At model degree 1 nothing is sharded: FBC keeps its own decision (nothing installed, nothing
    paid) and the cached output is bit-identical to the cached run without usp_dit."""
    model = tiny_flux_transformer()
    inputs = [_flux_call(1, seed=s) for s in range(3)]

    def run():
        outs = []
        with torch.no_grad(), model.cache_context("cond"):
            for x in inputs:
                outs.append(model(**x, return_dict=False)[0])
        model._reset_stateful_cache()
        return outs

    model.enable_cache(FirstBlockCacheConfig(threshold=10.0))  # skips every step after the first
    ref = run()
    usp_dit.enable_usp(model)
    try:
        assert not _reduced_metric_installed(model)
        got = run()
    finally:
        usp_dit.disable_usp(model)
        model.disable_cache()
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_first_block_the_plan_does_not_shard_is_refused():
    """FBC's partial sums add up to the whole only if its first block runs on the shards: a plan
    whose blocks do not include it is refused (none of usp_dit's plans is such; checked anyway)."""
    from types import SimpleNamespace

    from usp_dit.pipelines.caches import check_cache

    model = tiny_flux_transformer()
    model.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    check_cache(model, SimpleNamespace(name="Flux", block_lists=("transformer_blocks", "single_transformer_blocks")))
    with pytest.raises(NotImplementedError, match=r"first block is in 'transformer_blocks'"):
        check_cache(model, SimpleNamespace(name="Flux", block_lists=("single_transformer_blocks",)))
