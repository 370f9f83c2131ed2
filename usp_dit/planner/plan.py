"""``usp_dit.plan``: choose the grid (Ulysses x Ring x cfg), ring schedule and kernel for a model.

Layout: no tensors; a model is a Diffusers pipeline, its transformer, or a family name of
``usp_dit.planner.models.SPECS``; figures are per rank for one denoising step.

    plan = usp_dit.plan(pipe, world_size=8, height=1024, width=1024)
    print(plan.explain())
    pipe.enable_usp(degrees="auto")          # the same choice, made at enable

    python -m usp_dit.planner --model flux --world-size 8 [--height H --width W --frames F
                           --batch B --cfg/--no-cfg --interconnect nvlink|pcie|infiniband --gpu h200]
    python -m usp_dit.planner --model wan --world-size 1 --project

prints every valid grid with its predicted step time, traffic and memory, best first (or, with
``--project``, the best plan at 1 to 64 GPUs: the projection table of docs/PERFORMANCE.md).

Every grid whose degrees multiply to ``world_size`` with at most as many Ulysses ranks as heads,
and cfg 2 only where the guidance has two branches to split (``planner.cost.call_batch``), is
priced by the cost model (``usp_dit.planner.cost`` Note [the cost model]) under each ring
schedule; the cheapest wins, ties to fewer ring ranks (less to go wrong). The predictions are
projections until a several-GPU run calibrates the links (``planner.hardware`` Note [link
defaults]); the bytes are exact (``planner.volumes``, checked against counted traffic).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

from usp_dit.planner import kernels
from usp_dit.planner.cost import SCHEDULES, Grid, Prediction, predict
from usp_dit.planner.hardware import INTERCONNECTS, check_gpu, check_interconnect
from usp_dit.planner.models import SPECS, ModelSpec, spec_for, spec_of_transformer


@dataclass
class Plan:
    """The chosen grid and what the cost model predicts for it (per rank, one step)."""

    model: str
    world_size: int
    ulysses_degree: int
    ring_degree: int
    cfg_degree: int
    ring_schedule: str
    backend: str
    predicted_step_ms: float
    comm_bytes_per_rank: float
    memory_per_rank_gib: float
    interconnect: str
    candidates: list[Prediction] = field(default_factory=list, repr=False)  # every grid, best first

    @property
    def degrees(self) -> tuple[int, int, int]:
        return self.ulysses_degree, self.ring_degree, self.cfg_degree

    def explain(self) -> str:
        """Why this grid, and not the next best, in a few lines."""
        best = self.candidates[0]
        lines = [
            f"{self.model} on {self.world_size} GPU(s) over {self.interconnect}: ulysses {self.ulysses_degree} x "
            f"ring {self.ring_degree} x cfg {self.cfg_degree}" + (f", ring schedule {self.ring_schedule!r}" if self.ring_degree > 1 else "")
            + f": {self.predicted_step_ms:.1f} ms per step predicted ({_parts(best)}).",
        ]
        if len(self.candidates) > 1:
            other = next((p for p in self.candidates[1:] if p.grid != best.grid), self.candidates[1])
            lines.append(f"Next best: {_grid_text(other)} at {other.step_ms:.1f} ms "
                         f"(+{100 * (other.step_ms / best.step_ms - 1):.1f}%): {_difference(best, other)}.")
        if self.cfg_degree == 2:
            lines.append("cfg 2: each half of the GPUs computes one guidance branch (half the work per rank).")
        lines.append(f"Kernel: {self.backend} rates ({kernels.KERNEL_SOURCE}); links are datasheet estimates "
                     f"until measured (usp_dit.planner.hardware). A projection, not a measurement.")
        return "\n".join(lines)

    def table(self) -> str:
        """Every candidate, best first, as a markdown table."""
        rows = ["| ulysses | ring | cfg | schedule | step ms | attention | a2a | ring exposed | rest | GB/rank | GiB/rank |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p in self.candidates:
            g, x = p.grid, p.parts
            rows.append(
                f"| {g.ulysses} | {g.ring} | {g.cfg} | {p.schedule} | {p.step_ms:.1f} | {x['attention']:.1f} | "
                f"{x['ulysses_all_to_all']:.1f} | {x['ring_exposed']:.1f} | {x['rest_of_model']:.1f} | "
                f"{p.comm_bytes_per_rank / 1e9:.2f} | {p.memory_per_rank_gib:.1f} |"
            )
        return "\n".join(rows)


def _grid_text(p: Prediction) -> str:
    g = p.grid
    sched = f" {p.schedule}" if g.ring > 1 else ""
    return f"ulysses {g.ulysses} x ring {g.ring} x cfg {g.cfg}{sched}"


def _parts(p: Prediction) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in p.parts.items() if v >= 0.05)


def _difference(best: Prediction, other: Prediction) -> str:
    """The parts that make ``other`` slower, largest first."""
    diffs = sorted(((other.parts[k] - best.parts[k], k) for k in best.parts), reverse=True)
    said = [f"{k.replace('_', ' ')} +{d:.1f} ms" for d, k in diffs if d > 0.05][:2]
    return ", ".join(said) or "within rounding"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_grids(spec: ModelSpec, world_size: int, batch: int, cfg: bool) -> list[Grid]:
    """Every (U, R, cfg) with U * R * cfg == world_size that ``spec`` can run."""
    grids = []
    for c in (1, 2):
        if world_size % c:
            continue
        for u in _divisors(world_size // c):
            grid = Grid(u, world_size // c // u, c)
            if u > spec.heads:
                continue
            if c == 2 and not (cfg or batch % 2 == 0):
                continue
            if c == 2 and spec.guidance == "distilled" and batch % 2:
                continue
            grids.append(grid)
    return grids


def _spec(model: Any, height, width, num_frames) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return spec_for(model, height, width, num_frames)
    transformer = getattr(model, "transformer", model)
    if transformer is None or not hasattr(transformer, "config"):
        raise ValueError(f"usp_dit.plan cannot plan a {type(model).__name__}: pass a pipeline, its transformer, "
                         f"or a model name of {sorted(SPECS)}")
    return spec_of_transformer(transformer, height, width, num_frames)


def _default_cfg(model: Any, spec: ModelSpec) -> bool:
    """Guidance on by default for families whose pipelines guide with two branches."""
    guidance = getattr(model, "do_classifier_free_guidance", None)
    if isinstance(guidance, bool):
        return guidance
    return spec.guidance != "distilled"


def plan(
    pipe_or_transformer: Any,
    *,
    world_size: int,
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    batch: int = 1,
    cfg: bool | None = None,
    interconnect: str = "nvlink",
    gpu: str | None = None,
    backend: str = kernels.DEFAULT_BACKEND,
) -> Plan:
    """The grid, schedule and kernel with the lowest predicted step time (module docstring).

    Args:
        pipe_or_transformer: a Diffusers pipeline, its transformer, or a model name (``SPECS``).
        world_size: GPUs the job runs on (>= 1).
        height, width, num_frames: the output size; ``None`` takes the model's usual size.
        batch: prompts per step. cfg: whether classifier-free guidance runs two branches
            (``None``: the family's usual).
        interconnect: "nvlink" (one node), "pcie", or "infiniband" (nodes of 8 over NVLink).
        gpu: "h200" (default) or "h100".

    Raises:
        ValueError: world_size < 1, batch < 1, an unknown interconnect or GPU, or a model the
            planner does not know (naming the ones it does).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be an int >= 1")
    check_interconnect(interconnect)
    device = check_gpu(gpu)
    spec = _spec(pipe_or_transformer, height, width, num_frames)
    guided = _default_cfg(pipe_or_transformer, spec) if cfg is None else bool(cfg)
    predictions = []
    for grid in candidate_grids(spec, world_size, batch, guided):
        for schedule in (SCHEDULES if grid.ring > 1 else ("none",)):
            predictions.append(predict(spec, grid, schedule, batch=batch, cfg=guided, interconnect=interconnect,
                                       gpu=device, backend=backend))
    # Cheapest first; on a tie fewer ring ranks, then the streaming schedule (least memory).
    predictions.sort(key=lambda p: (round(p.step_ms, 3), p.grid.ring, SCHEDULES.index(p.schedule) if p.schedule in SCHEDULES else -1))
    best = predictions[0]
    g = best.grid
    return Plan(spec.name, world_size, g.ulysses, g.ring, g.cfg, best.schedule if g.ring > 1 else "auto", backend,
                best.step_ms, best.comm_bytes_per_rank, best.memory_per_rank_gib, interconnect, predictions)


PROJECTION_WORLDS = (1, 2, 4, 8, 16, 32, 64)


def projection(model: str, worlds: tuple[int, ...] = PROJECTION_WORLDS, **size: Any) -> str:
    """Markdown rows of the best plan per world size: NVLink up to one node of 8, InfiniBand
    between nodes beyond (Note [link defaults] in ``usp_dit.planner.hardware``); parallel
    efficiency = t1 / (P x tP). A projection: no several-GPU run has calibrated it yet."""
    rows = ["| GPUs | link | grid (U x R x cfg, schedule) | step ms | speed-up | efficiency | GB / rank / step |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    t1 = None
    for world in worlds:
        link = "nvlink" if world <= 8 else "infiniband"
        p = plan(model, world_size=world, interconnect=link, **size)
        t1 = t1 or p.predicted_step_ms
        sched = f", {p.ring_schedule}" if p.ring_degree > 1 else ""
        rows.append(f"| {world} | {link} | {p.ulysses_degree} x {p.ring_degree} x {p.cfg_degree}{sched} | "
                    f"{p.predicted_step_ms:.1f} | {t1 / p.predicted_step_ms:.2f} | "
                    f"{t1 / (world * p.predicted_step_ms):.2f} | {p.comm_bytes_per_rank / 1e9:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m usp_dit.planner", description="Predicted step time of every grid.")
    p.add_argument("--model", required=True, choices=sorted(SPECS))
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--frames", type=int, dest="num_frames")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cfg", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--interconnect", default="nvlink", choices=INTERCONNECTS)
    p.add_argument("--gpu", default="h200")
    p.add_argument("--project", action="store_true",
                   help="print the best plan at 1, 2, 4, 8 GPUs (NVLink) and 16, 32, 64 (InfiniBand) instead")
    args = p.parse_args(argv)
    if args.project:
        try:
            print(projection(args.model, height=args.height, width=args.width, num_frames=args.num_frames,
                             batch=args.batch, cfg=args.cfg, gpu=args.gpu))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        result = plan(args.model, world_size=args.world_size, height=args.height, width=args.width,
                      num_frames=args.num_frames, batch=args.batch, cfg=args.cfg, interconnect=args.interconnect,
                      gpu=args.gpu)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.table())
    print()
    print(result.explain())
    return 0

