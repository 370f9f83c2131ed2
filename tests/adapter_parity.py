"""Shared body of the model-adapter parity tests (tests/test_pipeline_*.py).

Each rank computes the stock model's output itself (the one-process result: same seeded weights and
inputs on every rank), enables the adapter on a mesh, runs, disables and runs again. Errors are
max|err| / max|ref| (``usp_dit.testing.rel_err``).

A family's file spawns one group of 4 ranks and calls ``run_grid_cases`` there (the 2-rank grids
run on it as two data-parallel replicas); the 8-rank grids are in tests/test_world8.py.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from usp_dit import disable_usp, enable_usp, init_usp, single_rank_mesh
from usp_dit.pipelines import _routing, is_usp_enabled
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import assert_no_crash, full_suite, rel_err, run_spawned

# (ulysses, ring, cfg) grids per world size: the grids plus (1, 4) and a cfg mesh, whose two
# cfg groups each shard the (whole) batch over their own two ranks.
GRIDS = {2: [(2, 1, 1), (1, 2, 1)], 4: [(2, 2, 1), (4, 1, 1), (1, 4, 1), (1, 2, 2)]}
GRAD_GRID = {2: (1, 2, 1), 4: (2, 2, 1)}  # the gradient cases' grid per sequence-group size


def sample(out) -> torch.Tensor:
    """The output tensor of ``model(..., return_dict=False)``: the tuple's first entry, or the
    tensor itself (Kandinsky 5 returns a bare tensor there)."""
    return out if torch.is_tensor(out) else out[0]


def forward(model, inputs) -> torch.Tensor:
    """The sample (the first output); a list of per-item samples (Cosmos 3's packed call) flattened into one vector."""
    with torch.no_grad():
        out = sample(model(**inputs.kwargs(), return_dict=False))
    return torch.cat([t.flatten() for t in out]) if isinstance(out, list) else out


def compile_backend() -> str:
    """The backend of a family's fullgraph case: "aot_eager" under ``--full``, "eager" in CI.

    Dynamo alone still fails ``fullgraph`` on any graph break and runs every op on fake tensors
    (the custom ops' fake kernels, the functional collectives' shapes); AOTAutograd's
    functionalisation of the same graph is what "aot_eager" adds, at about twice the time
    (measured: HunyuanVideo 1.5's case 14 s of its file's 41 s), and tests/test_compile_grid.py
    runs it on the core and on Flux in CI (its ``AOT_FAMILIES``)."""
    return "aot_eager" if full_suite() else "eager"


def compiled_case(model, inputs, mesh, backend: str | None = None) -> dict[str, float]:
    """``model`` enabled on ``mesh``, then ``torch.compile(fullgraph=True)`` through a graph counter
    against the eager enabled model: ``{"err": rel. error, "graphs_not_1": 0.0 for one graph}``.
    ``backend``: "aot_eager" (forward and backward traced as inductor sees them, no C++ build) or
    "eager" (Dynamo's graph alone: a graph break still fails ``fullgraph``; about half the time);
    default ``compile_backend()``."""
    from torch._dynamo.testing import CompileCounterWithBackend

    enable_usp(model, mesh=mesh)
    ref = forward(model, inputs)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend or compile_backend())
    got = forward(torch.compile(model, backend=counter, fullgraph=True), inputs)
    return {"err": rel_err(got, ref), "graphs_not_1": float(counter.frame_count != 1)}


def _output_vs_stock(model, inputs, adapter, mesh, attention: torch.nn.Module, tokens: int,
                     seen_tokens: Callable[[tuple, dict], int], replicated: int = 0) -> dict[str, float]:
    """Output through ``adapter`` on ``mesh`` vs the stock output; 1.0 if the most tokens
    ``attention`` saw in a call (``seen_tokens(args, kwargs)`` of its forward) exceed
    ceil(tokens / P) + ``replicated`` (text tokens every rank holds beside its shard in the same
    sequence, e.g. a single-stream model's), i.e. the tokens were not split (or it never ran); 1.0
    if the output after ``disable`` is not bit-identical."""
    ref = forward(model, inputs)
    lengths = []
    adapter.enable(model, mesh, "auto")
    hook = attention.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(seen_tokens(args, kwargs)),
                                               with_kwargs=True)
    try:
        out = forward(model, inputs)
    finally:
        hook.remove()
        adapter.disable(model)
    again = forward(model, inputs)
    return {
        "out": rel_err(out, ref),
        "block0_tokens_above_ceil": float(
            not lengths or max(lengths) > math.ceil(tokens / mesh.sequence_degree) + replicated),
        "disable_not_bit_identical": float(not torch.equal(again, ref)),
    }


def sharded_output_case(model, inputs, adapter, mesh, attention: torch.nn.Module, tokens: int,
                        replicated: int = 0) -> dict[str, float]:
    """``_output_vs_stock`` where ``attention`` (block 0's, of ``model``) sees the sequence as its
    ``hidden_states``: at most ceil(tokens / P) + ``replicated`` of them."""
    def seen(args: tuple, kwargs: dict) -> int:
        return (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1]

    return _output_vs_stock(model, inputs, adapter, mesh, attention, tokens, seen, replicated)


def joint_output_case(model, inputs, adapter, mesh, attention: torch.nn.Module, tokens: int) -> dict[str, float]:
    """``sharded_output_case`` for a model whose text is split with its image (Flux-like: Note
    [joint token split]): the tokens ``attention`` (block 0's double-stream attention) sees are
    its ``hidden_states`` (image part) and ``encoder_hidden_states`` (text part) together, at most
    ceil(tokens / P) with ``tokens`` = text + image."""
    def seen(args: tuple, kwargs: dict) -> int:
        return kwargs["hidden_states"].shape[1] + kwargs["encoder_hidden_states"].shape[1]

    return _output_vs_stock(model, inputs, adapter, mesh, attention, tokens, seen)


def _param_grads(model, inputs, divisor: int) -> dict[str, torch.Tensor]:
    out = sample(model(**inputs.kwargs(), return_dict=False))
    if isinstance(out, list):  # one sample per element (Z-Image): flattened into one vector, as ``forward``
        out = torch.cat([t.flatten() for t in out])
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(123))
    loss = (out * weight).sum() / divisor
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params.items(), grads)}


def gradient_errors(model, inputs, adapter, mesh, zero_by_maths: str | None = None) -> dict[str, float]:
    """Fine-tuning convention: each rank's loss is L / P; parameter gradients summed over the
    sequence group must equal one process's gradients of L. Returns the worst parameter's error.

    ``zero_by_maths``: a regex of ``*.bias`` parameters whose gradient is zero by maths (a key bias
    before softmax, which ignores a shift shared by a query row's keys), so rounding noise relative
    to itself: their error is measured against the scale of their module's ``*.weight`` gradient."""
    ref = _param_grads(model, inputs, 1)
    adapter.enable(model, mesh, "auto")
    try:
        grads = _param_grads(model, inputs, mesh.sequence_degree)
    finally:
        adapter.disable(model)
    worst = 0.0
    for name, g in grads.items():
        g = g.contiguous()  # gloo reduces contiguous buffers only
        dist.all_reduce(g, group=mesh.seq_group)
        if zero_by_maths is not None and re.fullmatch(zero_by_maths, name):
            scale = ref[name.removesuffix(".bias") + ".weight"].abs().max().item()
            worst = max(worst, (g - ref[name]).abs().max().item() / scale)
        else:
            worst = max(worst, rel_err(g, ref[name]))
    return {"grad": worst}


def checkpointed_gradient_errors(model, inputs, adapter, mesh) -> dict[str, float]:
    """``gradient_errors`` with ``model.enable_gradient_checkpointing()``: the blocks recomputed in
    backward (block 0's recompute shards its saved input again; the arguments a model passes the
    checkpointed blocks by position reach the adapter's hooks as such)."""
    model.enable_gradient_checkpointing()
    return gradient_errors(model, inputs, adapter, mesh)


def allowance_gradient_errors(
    model, inputs, adapter, mesh, exact: dict[str, torch.Tensor], stock: dict[str, torch.Tensor], tol: float,
    factor: float = 2.0,
) -> dict[str, float]:
    """``gradient_errors`` against ``exact`` (one process's gradients in float64) where the stock
    float32 model is itself far from them: each parameter's gradient, summed over the sequence group
    (each rank's loss L / P), its error over max(``tol``, ``factor`` x ``stock``'s error there).
    ``{"grad_over_allowed": the worst parameter's}``, asserted at most 1 by the parent.

    A bias whose exact gradient is zero by maths (a key bias before softmax: ``_zero_by_maths``)
    holds float32 rounding noise alone, in stock as sharded, and noise against noise is no test
    (the ratio of two noises moved past 2 with the CPU's kernels: AVX2 against AVX-512): its error
    is measured against the scale of its module's weight gradient instead, within ``tol``."""
    adapter.enable(model, mesh, "auto")
    try:
        grads = _param_grads(model, inputs, mesh.sequence_degree)
    finally:
        adapter.disable(model)
    worst = 0.0
    for name, g in grads.items():
        g = g.contiguous()  # gloo reduces contiguous buffers only
        dist.all_reduce(g, group=mesh.seq_group)
        weight_scale = _zero_by_maths(name, exact)
        if weight_scale is not None:
            worst = max(worst, (g.double() - exact[name]).abs().max().item() / weight_scale / tol)
            continue
        allowed = max(tol, factor * rel_err(stock[name], exact[name]))
        worst = max(worst, rel_err(g, exact[name]) / allowed)
    return {"grad_over_allowed": worst}


def _zero_by_maths(name: str, exact: dict[str, torch.Tensor]) -> float | None:
    """The max |gradient| of ``name``'s module weight where ``name`` is a bias whose exact (float64)
    gradient is below 1e-9 of it (zero by maths, float64 noise left); ``None`` otherwise."""
    weight = name.removesuffix(".bias") + ".weight"
    if not name.endswith(".bias") or weight not in exact:
        return None
    scale = exact[weight].abs().max().item()
    return scale if scale > 0 and exact[name].abs().max().item() <= 1e-9 * scale else None


def assert_within(per_rank: list[dict], key: str, tol: float, by_name: dict[str, float] | None = None,
                  fallback: str | None = None) -> None:
    """Every quantity of each rank's ``res[key]`` is ``<= tol`` (``by_name[quantity]`` where given: a
    decoded image's own tolerance, 0 for a flag); where a rank has no ``key``, its ``res[fallback]``
    (the error string of a ``record(..., many=True)`` that raised) is what fails."""
    for rank, res in enumerate(per_rank):
        errors = res[key] if fallback is None else res.get(key) or res.get(fallback, "no result")
        if isinstance(errors, str) and errors.startswith(NOT_IN_CI):
            pytest.skip(f"{errors}: run with bash scripts/test.sh --full")
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        if by_name is None:
            worst = {k: v for k, v in errors.items() if not v <= tol}
            assert not worst, f"rank {rank}: above {tol}: {worst}"
        else:
            tols = {k: by_name.get(k, tol) for k in errors}
            worst = {k: v for k, v in errors.items() if not v <= tols[k]}
            assert not worst, f"rank {rank}: above {tols}: {worst}"


def differing_inputs_flags(call: Callable[[torch.Tensor], Any], x: torch.Tensor) -> dict[str, float]:
    """``call(x + rank)`` under no_grad (an input differing between the ranks): flags, each 0.0 when
    it raised on this rank the ValueError of ``usp_dit.pipelines.vae.calls.require_same``."""
    try:
        with torch.no_grad():
            call(x + dist.get_rank())
    except ValueError as exc:
        return {"differing_inputs_wrong_error": float("differs between the ranks" not in str(exc))}
    return {"differing_inputs_did_not_raise": 1.0}


def spawn_grid(run_all: Callable[[], dict], world: int, **kwargs) -> list[dict]:
    """Every rank's ``run_all()`` results from one spawned group of ``world`` ranks (``kwargs`` to
    ``usp_dit.testing.run_spawned``); a crashed rank fails here, the module fixture's caller."""
    per_rank = run_spawned(run_all, world, **kwargs)
    assert_no_crash(per_rank)
    return per_rank


def cfg_split_case(model, inputs, mesh) -> dict[str, float]:
    """``model`` enabled on ``mesh`` (a cfg mesh) through ``usp_dit.enable_usp``: its batch split over
    the cfg groups, vs the stock output (``{"out": rel. error}``)."""
    ref = forward(model, inputs)
    enable_usp(model, mesh=mesh)
    try:
        out = forward(model, inputs)
    finally:
        disable_usp(model)
    return {"out": rel_err(out, ref)}


def first_attention_qk(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, k) of the first call of ``module.name`` (an attention function taking q, k, v first,
    (B, S, H, D)) in a forward of ``model``: block 0's self-attention's, rotated, in most families."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        forward(model, inputs)
    return seen[0]


def rotated_qk_case(model, inputs, adapter, mesh, stock_module) -> dict[str, float]:
    """Each rank's rotated Q/K of the first attention call (stock: ``stock_module``'s
    ``dispatch_attention_fn``; enabled: the routed ``usp_attention``) equal the same rows of one
    process's (``shard_sequence`` of the whole sequence): the RoPE rows cut like the tokens."""
    q_ref, k_ref = first_attention_qk(model, inputs, stock_module, "dispatch_attention_fn")
    adapter.enable(model, mesh, "auto")
    try:
        q, k = first_attention_qk(model, inputs, _routing, "usp_attention")
    finally:
        adapter.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


# ---- the grid of a family's spawned group (tests/test_pipeline_<family>.py) ------------------------
# One group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel replicas.

SCHEDULES = ("stream", "gather_merge")  # forced on every grid with a ring, besides the mesh default ("auto")
RING_GRIDS = [g for world in (2, 4) for g in GRIDS[world] if g[1] > 1]


def schedule_grids() -> list[tuple[int, int, int, str | None]]:
    """(U, R, cfg, forced schedule or None): the 2- and 4-rank grids, each ring grid also with every
    schedule forced ("auto" never merges at the tiny sizes of the tests)."""
    grids = [(u, r, c, None) for world in (2, 4) for u, r, c in GRIDS[world]]
    return grids + [(u, r, c, s) for u, r, c, _ in grids if r > 1 for s in SCHEDULES]


def kept_in_ci(grid: tuple[int, int, int, str | None], shape_index: int) -> bool:
    """Note [schedules in CI]: every grid under the mesh's own schedule; the forced schedules on one
    ring grid per shape (shape i: ``RING_GRIDS[i % 4]``), the rest under ``--full``.

    A forced schedule changes how the ring moves K/V blocks and merges them, which is the core's
    (tests/test_usp_attention.py forces every schedule on every grid, against float64); what a
    family adds (its token split, tables, masks, joint tokens) is the same under any schedule, and
    the default schedule already runs it on every grid. Taking the grid in turn by shape keeps the
    forced schedules meeting each family's inputs on several grids in CI at 8 cases a shape, not 14.
    """
    if grid[3] is None or full_suite():
        return True
    return RING_GRIDS[shape_index % len(RING_GRIDS)] == grid[:3]


def grid_id(grid: tuple[int, int, int] | tuple[int, int, int, str | None]) -> str:
    """``"u<U>r<R>cfg<C>"`` of a (U, R, cfg) grid, ``-<schedule>`` added for a forced one."""
    u, r, c, s = (*grid, None)[:4]
    return f"u{u}r{r}cfg{c}" + (f"-{s}" if s else "")


def record(results: dict, key: str, fn: Callable[[], Any], many: bool = False) -> None:
    """``results[key] = fn()`` (``many``: ``fn()`` is a dict of keys), or the error as a string,
    asserted by the parent (``assert_within``)."""
    start = time.perf_counter()
    try:
        results.update(fn()) if many else results.__setitem__(key, fn())
    except Exception as exc:
        results[key] = f"{type(exc).__name__}: {exc}"
    _log_time(key, time.perf_counter() - start)


def _log_time(key: str, seconds: float) -> None:
    """With ``USP_DIT_CASE_TIMES=FILE`` set, rank 0 appends "seconds key" to FILE: where a family
    file's one spawned group spends its time (docs/TESTING.md, "Keeping CI within budget")."""
    path = os.environ.get("USP_DIT_CASE_TIMES")
    if path and (not dist.is_initialized() or dist.get_rank() == 0):
        with open(path, "a") as f:
            f.write(f"{seconds:7.2f} {key}\n")


def run_grid_cases(
    results: dict, shapes: list, output_case: Callable[[Any, Any], dict],
    gradient_case: Callable[[Any, Any], dict], grad_shapes: dict[int, list] | None = None,
    fits: Callable[[Any, tuple], bool] | None = None,
) -> None:
    """Into ``results``: ``output_case(shape, mesh)`` for every grid of ``schedule_grids`` and every
    shape (key ``"<grid id>-<shape>"``; only where ``fits(shape, grid)`` when given, e.g. a batch
    the grid's cfg degree divides), and ``gradient_case(shape, mesh)`` on 2 and 4 ranks
    (``GRAD_GRID``; key ``"grad-p<P>-<shape>"``) for ``grad_shapes[P]`` (default: every shape)."""
    meshes = {grid: init_usp(*grid[:3], ring_schedule=grid[3] or "auto") for grid in schedule_grids()}
    for grid in schedule_grids():  # meshes that differ only in schedule share their groups
        for i, shape in enumerate(shapes):
            if (fits is None or fits(shape, grid)) and kept_in_ci(grid, i):
                record(results, f"{grid_id(grid)}-{shape}", lambda: output_case(shape, meshes[grid]))
    for world in (2, 4):
        mesh = init_usp(*GRAD_GRID[world])
        for shape in (grad_shapes or {}).get(world, shapes):
            record(results, f"grad-p{world}-{shape}", lambda: gradient_case(shape, mesh))


def output_keys(shapes: list, fits: Callable[[Any, tuple], bool] | None = None) -> list:
    """The keys ``run_grid_cases`` records output cases under (the same ``fits``), as pytest
    parameters: those it computes only under ``--full`` (``kept_in_ci``) marked ``slow``."""
    keys = []
    for g in schedule_grids():
        for i, s in enumerate(shapes):
            if fits is None or fits(s, g):
                key = f"{grid_id(g)}-{s}"
                keys.append(key if kept_in_ci(g, i) else pytest.param(key, marks=pytest.mark.slow))
    return keys


def grad_keys(shapes: Iterable = (), by_world: dict[int, list] | None = None) -> list[str]:
    """The keys ``run_grid_cases`` records gradient cases under: every shape of ``shapes`` on 2 and 4
    ranks, or with ``by_world`` (its ``grad_shapes``) ``by_world[P]`` on P ranks."""
    return [f"grad-p{p}-{s}" for p in (2, 4) for s in (shapes if by_world is None else by_world[p])]


def grid_tests(output: list[str], grads: list[str], tol: float, grad_tol: float | None = None) -> tuple[Callable, ...]:
    """The two parametrized tests every family's file has, over its module fixture ``grid_results``
    (every rank's ``run_grid_cases`` results): each key of ``output`` within ``tol``, each key of
    ``grads`` within ``grad_tol`` (default ``tol``; 1.0 where a case records each parameter's error
    over its allowance). The file assigns them to ``test_sharded_output_matches_one_process`` and
    ``test_parameter_gradients_match_one_process``, the names pytest collects and reports."""

    @pytest.mark.parametrize("key", output)
    def test_sharded_output_matches_one_process(grid_results: list[dict], key: str) -> None:
        assert_within(grid_results, key, tol)

    @pytest.mark.parametrize("key", grads)
    def test_parameter_gradients_match_one_process(grid_results: list[dict], key: str) -> None:
        assert_within(grid_results, key, tol if grad_tol is None else grad_tol)

    return test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process


def ulysses_above_heads_case(model: torch.nn.Module, adapter, mesh) -> dict[str, float]:
    """``mesh`` with ulysses_degree 4 on a 2-head ``model``: a ValueError at enable naming the head
    count (asserted with tolerance 0 by the parent)."""
    try:
        adapter.enable(model, mesh, "auto")
    except ValueError as exc:
        return {"wrong_error": float("exceeds the 2 attention heads" not in str(exc))}
    adapter.disable(model)
    return {"did_not_raise": 1.0}


# ---- the stock pipeline through pipe.enable_usp() (tests/test_pipeline_<family>.py) --------------


def latents_and(pipe, output: str = "images", **call) -> tuple[torch.Tensor, torch.Tensor]:
    """``pipe(**call)``: (the final latents, as ``callback_on_step_end`` sees them after the last
    step; the result's ``output`` attribute, e.g. the decoded images or frames)."""
    last = {}

    def keep_latents(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return {}

    result = pipe(**call, callback_on_step_end=keep_latents)
    return last["latents"], getattr(result, output)


def decoded_latents_and(pipe, output: str = "images", **call) -> tuple[torch.Tensor, torch.Tensor]:
    """``latents_and`` for a pipeline that takes no step callback: the latents its VAE decodes (a spy
    on ``pipe.vae.decode`` for this call), and the result's ``output`` attribute."""
    seen = []
    decode = pipe.vae.decode
    with mock.patch.object(pipe.vae, "decode", lambda z, **kw: (seen.append(z.clone()), decode(z, **kw))[1]):
        result = pipe(**call)
    return seen[0], getattr(result, output)


def pipeline_grids(grids: list[tuple[int, int, int]], prefix: str = "pipeline") -> dict[str, tuple[int, int, int]]:
    """``{"<prefix>-u<U>r<R>cfg<C>": (U, R, C)}``: the keys ``pipeline_cases`` records ``grids`` under."""
    return {f"{prefix}-u{u}r{r}cfg{c}": (u, r, c) for u, r, c in grids}


NOT_IN_CI = "--full only: "  # a result that says its case runs under scripts/test.sh --full alone


def pipeline_grids_in_ci(grids: dict[str, tuple[int, int, int]]) -> dict[str, tuple[int, int, int]]:
    """The pipeline grids CI runs (all of them under ``--full``).

    Note [pipeline grids in CI]
        A family's pipeline case (its stock Diffusers call through ``pipe.enable_usp``, one
        reference and one run a grid) checks what the family's pipeline code adds: its call's
        shapes, its CFG (batched or two-call), its VAE. A 2-rank sequence group without cfg, e.g.
        (2, 1, 1) in the 4-rank group (two replicas), adds nothing to that which the 4-rank
        sequence grid (2, 2, 1: Ulysses and the ring together) and the cfg grid do not: the
        replicas are the core's (tests/test_pipelines_api.py, tests/test_replica.py). So CI keeps
        the grids of 4 ranks and those with cfg, and a file whose grids are all 2-rank sequence
        groups keeps them all (2026-12-07, for CI's budget: ~1 s a family a pipeline).
    """
    if full_suite():
        return dict(grids)
    kept = {k: g for k, g in grids.items() if math.prod(g[:3]) > 2 or (len(g) > 2 and g[2] > 1)}
    return kept or dict(grids)


def ci_grids(grids: list[tuple] | dict[str, tuple]) -> list[tuple] | dict[str, tuple]:
    """A family file's ``PIPELINE_GRIDS`` (a list of (U, R, cfg) or a dict of them) as CI runs it:
    ``pipeline_grids_in_ci``'s choice, in the same container, so its cases and its parametrized
    tests both follow (Note [pipeline grids in CI])."""
    if isinstance(grids, dict):
        return pipeline_grids_in_ci(grids)
    kept = pipeline_grids_in_ci(dict(enumerate(grids)))
    return [g for i, g in enumerate(grids) if i in kept]


def pipeline_cases(
    pipe, generate: Callable[[Any], tuple[torch.Tensor, ...]], grids: dict[str, tuple[int, int, int]],
    names: tuple[str, ...] = ("latents", "images"), check_enabled: bool = True,
    after_disable: str | None = "pipeline-after-disable", probe: Callable[[Any, tuple], Any] | None = None,
) -> dict[str, dict[str, float]]:
    """``generate(pipe)`` (a tuple of tensors, called ``names``) through ``pipe.enable_usp`` on each
    (U, R, cfg) of ``grids`` vs one process's: ``results[key] = {name: rel. error}``, with
    ``check_enabled`` also 1.0 under "not_enabled_then_restored" unless the transformer was enabled and
    ``disable_usp`` restored it. ``after_disable`` (a key; None: not checked): 1.0 unless ``generate``
    after all grids is bit-identical to the first one (each pipeline build is costly: one reference
    serves every grid). ``probe(pipe, (U, R, cfg))``: a context manager entered once the pipeline is
    enabled, around its call, yielding a function that gives a family's further quantities (e.g.
    ``cfg_pair_computations``)."""
    pipe.set_progress_bar_config(disable=True)
    ref = generate(pipe)
    results = {}
    kept = pipeline_grids_in_ci(grids)
    for key, (u, r, c) in grids.items():
        if key not in kept:
            results[key] = f"{NOT_IN_CI}a 2-rank sequence group's pipeline run (Note [pipeline grids in CI])"
            continue
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe.transformer)
        try:
            with probe(pipe, (u, r, c)) if probe else contextlib.nullcontext(dict) as measure:
                got = generate(pipe)
                more = measure()
        finally:
            pipe.disable_usp()
        errors = {"not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe.transformer))}
        errors = errors if check_enabled else {}
        results[key] = {**errors, **{name: rel_err(g, want) for name, g, want in zip(names, got, ref, strict=True)},
                        **more}
    if after_disable is not None:
        again = generate(pipe)
        results[after_disable] = {"not_bit_identical": float(not all(map(torch.equal, again, ref)))}
    return results


@contextlib.contextmanager
def cfg_pair_computations(pipe, grid: tuple[int, int, int], steps: int,
                          blocks: str = "transformer_blocks") -> Iterator[Callable[[], dict[str, float]]]:
    """A ``pipeline_cases`` probe for a pipeline of two guidance calls a step: at cfg 2, 1.0 under
    "computations_not_steps_plus_1" unless block 0 (of the transformer's list ``blocks``) ran
    ``steps + 1`` times on this rank (the first step's two calls, then one pair a step:
    ``usp_dit.pipelines.cfg_pair`` Note [two calls a step])."""
    computed = []
    first = getattr(pipe.transformer, blocks)[0]
    hook = first.register_forward_pre_hook(lambda m, a: computed.append(1))
    try:
        yield lambda: {"computations_not_steps_plus_1": float(len(computed) != steps + 1)} if grid[2] == 2 else {}
    finally:
        hook.remove()


# ---- one process: what enable changes, disable gives back (tests/test_pipeline_<family>.py) ------


def assert_disable_restores(model: torch.nn.Module, inputs, adapter, processor: type) -> None:
    """``adapter`` enabled on one rank sets ``processor`` on every attention module; after a forward,
    ``disable`` gives back the same processor objects, the class's ``forward`` (no instance
    attribute left) and no forward hook or pre-hook on any module."""
    before = [m.processor for m in model.modules() if hasattr(m, "processor")]
    adapter.enable(model, single_rank_mesh(), "auto")
    assert all(isinstance(m.processor, processor) for m in model.modules() if hasattr(m, "processor"))
    forward(model, inputs)
    adapter.disable(model)
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == before
    assert "forward" not in model.__dict__
    hooked = [type(m).__name__ for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not hooked, f"hooks left on {hooked}"


def assert_one_rank_bit_identical(model: torch.nn.Module, inputs, adapter) -> None:
    """``adapter`` enabled on one rank (nothing split, the hooks and processors in place) gives the
    stock output bit for bit."""
    ref = forward(model, inputs)
    adapter.enable(model, single_rank_mesh(), "auto")
    try:
        out = forward(model, inputs)
    finally:
        adapter.disable(model)
    assert torch.equal(out, ref)
