"""Shared body of the model-adapter parity tests (tests/test_pipeline_*.py).

Each rank computes the stock model's output itself (the one-process result: same seeded weights and
inputs on every rank), enables the adapter on a mesh, runs, disables and runs again. Errors are
max|err| / max|ref| (``usp_dit.testing.rel_err``).

A family's file spawns one group of 4 ranks and calls ``run_grid_cases`` there (the 2-rank grids
run on it as two data-parallel replicas); the 8-rank grids are in tests/test_pipeline_world8.py.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from usp_dit import enable_usp, init_usp
from usp_dit.testing import rel_err

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


def compiled_case(model, inputs, mesh, backend: str = "aot_eager") -> dict[str, float]:
    """``model`` enabled on ``mesh``, then ``torch.compile(fullgraph=True)`` through a graph counter
    against the eager enabled model: ``{"err": rel. error, "graphs_not_1": 0.0 for one graph}``.
    ``backend``: "aot_eager" (forward and backward traced as inductor sees them, no C++ build) or
    "eager" (Dynamo's graph alone: a graph break still fails ``fullgraph``; about half the time)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    enable_usp(model, mesh=mesh)
    ref = forward(model, inputs)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    got = forward(torch.compile(model, backend=counter, fullgraph=True), inputs)
    return {"err": rel_err(got, ref), "graphs_not_1": float(counter.frame_count != 1)}


def sharded_output_case(
    model, inputs, adapter, mesh, attention: torch.nn.Module, tokens: int, replicated: int = 0,
) -> dict[str, float]:
    """Output through ``adapter`` on ``mesh`` vs the stock output; 1.0 if the longest
    ``hidden_states`` that ``attention`` (block 0's, of ``model``) saw exceeds ceil(tokens / P) +
    ``replicated`` (text tokens every rank holds beside its shard in the same sequence, e.g. a
    single-stream model's), i.e. the tokens were not split (or it never ran); 1.0 if the output
    after ``disable`` is not bit-identical."""
    ref = forward(model, inputs)
    lengths = []

    def seen(module, args, kwargs):
        lengths.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1])

    adapter.enable(model, mesh, "auto")
    hook = attention.register_forward_pre_hook(seen, with_kwargs=True)
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


def joint_output_case(model, inputs, adapter, mesh, attention: torch.nn.Module, tokens: int) -> dict[str, float]:
    """``sharded_output_case`` for a model whose text is split with its image (Flux-like: Note
    [joint token split]): the tokens ``attention`` (block 0's double-stream attention) sees are
    its ``hidden_states`` (image part) and ``encoder_hidden_states`` (text part) together, at most
    ceil(tokens / P) with ``tokens`` = text + image."""
    ref = forward(model, inputs)
    lengths = []

    def seen(module, args, kwargs):
        lengths.append(kwargs["hidden_states"].shape[1] + kwargs["encoder_hidden_states"].shape[1])

    adapter.enable(model, mesh, "auto")
    hook = attention.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        out = forward(model, inputs)
    finally:
        hook.remove()
        adapter.disable(model)
    again = forward(model, inputs)
    return {
        "out": rel_err(out, ref),
        "block0_tokens_above_ceil": float(not lengths or max(lengths) > math.ceil(tokens / mesh.sequence_degree)),
        "disable_not_bit_identical": float(not torch.equal(again, ref)),
    }


def _param_grads(model, inputs, divisor: int) -> dict[str, torch.Tensor]:
    out = sample(model(**inputs.kwargs(), return_dict=False))
    if isinstance(out, list):  # one sample per element (Z-Image): flattened into one vector, as ``forward``
        out = torch.cat([t.flatten() for t in out])
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(123))
    loss = (out * weight).sum() / divisor
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params.items(), grads)}


def gradient_errors(model, inputs, adapter, mesh) -> dict[str, float]:
    """Fine-tuning convention: each rank's loss is L / P; parameter gradients summed over the
    sequence group must equal one process's gradients of L. Returns the worst parameter's error."""
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
        worst = max(worst, rel_err(g, ref[name]))
    return {"grad": worst}


def assert_within(per_rank: list[dict], key: str, tol: float) -> None:
    for rank, res in enumerate(per_rank):
        errors = res[key]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {k: v for k, v in errors.items() if not v <= tol}
        assert not worst, f"rank {rank}: above {tol}: {worst}"


# ---- the grid of a family's spawned group (tests/test_pipeline_<family>.py) ------------------------
# One group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel replicas.

SCHEDULES = ("stream", "gather_merge")  # forced on every grid with a ring, besides the mesh default ("auto")


def schedule_grids() -> list[tuple[int, int, int, str | None]]:
    """(U, R, cfg, forced schedule or None): the 2- and 4-rank grids, each ring grid also with every
    schedule forced ("auto" never merges at the tiny sizes of the tests)."""
    grids = [(u, r, c, None) for world in (2, 4) for u, r, c in GRIDS[world]]
    return grids + [(u, r, c, s) for u, r, c, _ in grids if r > 1 for s in SCHEDULES]


def grid_id(grid: tuple[int, int, int, str | None]) -> str:
    u, r, c, s = grid
    return f"u{u}r{r}cfg{c}" + (f"-{s}" if s else "")


def record(results: dict, key: str, fn: Callable[[], Any], many: bool = False) -> None:
    """``results[key] = fn()`` (``many``: ``fn()`` is a dict of keys), or the error as a string,
    asserted by the parent (``assert_within``)."""
    try:
        results.update(fn()) if many else results.__setitem__(key, fn())
    except Exception as exc:
        results[key] = f"{type(exc).__name__}: {exc}"


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
        for shape in shapes:
            if fits is None or fits(shape, grid):
                record(results, f"{grid_id(grid)}-{shape}", lambda: output_case(shape, meshes[grid]))
    for world in (2, 4):
        mesh = init_usp(*GRAD_GRID[world])
        for shape in (grad_shapes or {}).get(world, shapes):
            record(results, f"grad-p{world}-{shape}", lambda: gradient_case(shape, mesh))


def output_keys(shapes: list, fits: Callable[[Any, tuple], bool] | None = None) -> list[str]:
    """The keys ``run_grid_cases`` records output cases under (the same ``fits``)."""
    return [f"{grid_id(g)}-{s}" for g in schedule_grids() for s in shapes if fits is None or fits(s, g)]


def ulysses_above_heads_case(model: torch.nn.Module, adapter, mesh) -> dict[str, float]:
    """``mesh`` with ulysses_degree 4 on a 2-head ``model``: a ValueError at enable naming the head
    count (asserted with tolerance 0 by the parent)."""
    try:
        adapter.enable(model, mesh, "auto")
    except ValueError as exc:
        return {"wrong_error": float("exceeds the 2 attention heads" not in str(exc))}
    adapter.disable(model)
    return {"did_not_raise": 1.0}
