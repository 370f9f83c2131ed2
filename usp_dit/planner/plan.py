"""``usp_dit.plan``: choose the grid (Ulysses x Ring x cfg), ring schedule and kernel for a model.

Layout: no tensors; a model is a Diffusers pipeline, its transformer, or a family name of
``usp_dit.planner.models.SPECS``; figures are per rank for one denoising step.

    plan = usp_dit.plan(pipe, world_size=8, height=1024, width=1024)
    print(plan.explain())
    pipe.enable_usp(degrees="auto")          # the same choice, made at enable

    python -m usp_dit.planner --model flux --world-size 8 [--height H --width W --frames F | --seconds S
                           --batch B --cfg/--no-cfg --interconnect nvlink|pcie|infiniband --gpu h200]
    python -m usp_dit.planner --model wan --world-size 1 --project

prints every valid grid with its predicted step time, traffic and memory, best first (or, with
``--project``, the best plan at 1 to 64 GPUs: the projection table of docs/PERFORMANCE.md).

    plan = usp_dit.plan(pipe, world_size=8, gpu_memory_gib=24)   # only plans that fit 24 GiB a GPU
    python -m usp_dit.planner --model flux2 --world-size 8 --gpu-memory-gib 24
    python -m usp_dit.planner --memory-table        # the memory table of docs/PERFORMANCE.md

With ``gpu_memory_gib`` every grid is also priced in each placement of the weights (replicated,
or sharded over the ranks: ``enable_usp(..., shard_weights=True)``) and of the text encoders
("replicate", "shard", "rank0": ``enable_usp(..., text_encoder=...)``), its memory per rank
counted (``usp_dit.planner.memory`` Note [memory per rank]) and its weight all-gathers priced
(``cost`` Note [sharded weights cost]); only the placements whose peak fits are kept, and the
cheapest step wins (ties: replicated weights, then a replicated text encoder: nothing to gather).
A family that declares tensor-parallel cuts (``models`` Note [tensor cuts]) is then also priced on
grids with a tensor degree T (cfg x ulysses x ring x tensor = world size, Ulysses at most a tensor
rank's ceil(H / T) heads), alone and with sharded weights (``cost`` Note [tensor parallel cost]);
the plan's ``tensor_degree`` is what ``enable_usp(degrees=plan)`` runs.

Every grid whose degrees multiply to ``world_size`` with at most as many Ulysses ranks as heads,
and cfg 2 only where the guidance has two branches to split (``planner.cost.call_batch``), is
priced by the cost model (``usp_dit.planner.cost`` Note [the cost model]) under each ring
schedule; the cheapest wins, ties to fewer ring ranks (less to go wrong). The predictions are
projections until a several-GPU run calibrates the links (``planner.hardware`` Note [link
defaults]); the bytes are exact (``planner.volumes``, checked against counted traffic).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from usp_dit.planner import kernels
from usp_dit.planner.cost import SCHEDULES, Grid, Prediction, placed, predict
from usp_dit.planner.hardware import GPU, INTERCONNECTS, check_gpu, check_interconnect
from usp_dit.planner.memory import ENCODER_PLACEMENTS, MemoryBreakdown
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
    candidates: list[Prediction] = field(default_factory=list, repr=False)  # every grid that fits, best first
    shard_weights: bool = False  # enable_usp(..., shard_weights=...)
    text_encoder: str = "replicate"  # enable_usp(..., text_encoder=...)
    memory: MemoryBreakdown | None = None  # the chosen placement's, GiB per rank
    gpu_memory_gib: float | None = None  # the limit the candidates were filtered by (None: none)
    unfit: list[Prediction] = field(default_factory=list, repr=False)  # priced but over gpu_memory_gib
    tensor_degree: int = 1  # enable_usp(..., tensor_degree=...)
    # What the figures leave out (``ModelMemory.left_out``) or price roughly (``ModelSpec.caveat``).
    notes: tuple[str, ...] = ()

    @property
    def degrees(self) -> tuple[int, int, int]:
        return self.ulysses_degree, self.ring_degree, self.cfg_degree

    def explain(self) -> str:
        """Why this grid, and not the next best, in a few lines."""
        best = self.candidates[0]
        lines = [
            f"{self.model} on {self.world_size} GPU(s) over {self.interconnect}: ulysses {self.ulysses_degree} x "
            f"ring {self.ring_degree} x cfg {self.cfg_degree}"
            + (f" x tensor {self.tensor_degree}" if self.tensor_degree > 1 else "")
            + (f", ring schedule {self.ring_schedule!r}" if self.ring_degree > 1 else "")
            + f": {self.predicted_step_ms:.1f} ms per step predicted ({_parts(best)}).",
        ]
        if len(self.candidates) > 1:
            other = next((p for p in self.candidates[1:] if p.grid != best.grid), self.candidates[1])
            lines.append(f"Next best: {_grid_text(other)} at {other.step_ms:.1f} ms "
                         f"(+{100 * (other.step_ms / best.step_ms - 1):.1f}%): {_difference(best, other)}.")
        if self.cfg_degree == 2:
            lines.append("cfg 2: each half of the GPUs computes one guidance branch (half the work per rank).")
        lines.extend(self._memory_lines())
        lines.extend(f"{note}." for note in self.notes)
        lines.append(f"Kernel: {self.backend} rates ({kernels.KERNEL_SOURCE}); links are datasheet estimates "
                     f"until measured (usp_dit.planner.hardware). A projection, not a measurement.")
        return "\n".join(lines)

    def _memory_lines(self) -> list[str]:
        """The placement and why: what it holds, what the faster or simpler one would need."""
        m = self.memory
        if m is None:
            return []
        others = f"other modules {m.others:.1f}, " if m.others else ""
        parts = (f"weights {m.weights:.1f}, text encoders {m.text_encoders:.1f}, activations {m.activations:.1f}, "
                 f"VAE {m.vae:.1f}, {others}reserve {m.reserve:.1f}; peak while {_PHASE_WORDS[m.peak_phase]}")
        if self.gpu_memory_gib is None:
            return [(f"Memory: {m.total:.1f} GiB per rank, {m.placement()} ({parts}); not checked against a GPU: "
                     f"pass gpu_memory_gib= to choose the placement.")]
        lines = [f"Memory: {m.placement()}: {m.total:.1f} of {self.gpu_memory_gib:g} GiB per rank ({parts})."]
        priced = self.candidates + self.unfit
        why = []
        if self.shard_weights:
            need = min(p.memory_per_rank_gib for p in priced if not p.shard_weights and p.tensor == 1)
            gather = self.candidates[0].parts.get("weight_gather", 0.0)
            why.append(f"replicated weights need at least {need:.1f} GiB a rank (> {self.gpu_memory_gib:g}); "
                       f"sharding costs {gather:.1f} ms a step of weight all-gathers the prefetch does not hide")
        elif self.world_size > 1:
            why.append("replicated weights fit: no all-gathers a step")
        why.extend(self._tensor_why(priced))
        if self.text_encoder == "shard":
            need = min(p.memory_per_rank_gib for p in priced
                       if p.shard_weights == self.shard_weights and p.text_encoder != "shard")
            why.append(f"a whole text encoder on a rank ('replicate' or 'rank0') needs {need:.1f} GiB; 'shard' "
                       f"gathers it once per prompt ({self.candidates[0].encode_gather_ms:.0f} ms), not per step")
        if why:
            lines.append("Why: " + "; ".join(why) + ".")
        return lines

    def _tensor_why(self, priced: list[Prediction]) -> list[str]:
        """Why this tensor degree: what TP saves in weights and what its all-reduces cost, against
        the fastest placement of the other kind (Note [tensor parallel cost] in ``planner.cost``)."""
        best = self.candidates[0]
        if self.tensor_degree > 1:
            plain = [p for p in priced if p.tensor == 1]
            fitting = [p for p in self.candidates if p.tensor == 1]
            weights = self.memory.weights
            text = (f"TP {self.tensor_degree} cuts the blocks' heads and MLP columns (weights {weights:.1f} GiB a "
                    f"rank); its all-reduces cost {best.parts.get('tensor_all_reduce', 0.0):.1f} ms a step")
            if fitting:
                text += (f", and it is still {fitting[0].step_ms - best.step_ms:.1f} ms a step faster than the "
                         f"fastest placement without it ({_grid_text(fitting[0])}, {fitting[0].memory.placement()}: "
                         f"{fitting[0].step_ms:.1f} ms)")
            elif plain:
                need = min(p.memory_per_rank_gib for p in plain)
                text += f"; without it no placement fits (the smallest needs {need:.1f} GiB a rank)"
            return [text]
        cut = [p for p in self.candidates[1:] if p.tensor > 1]
        if cut:
            other = cut[0]
            return [(f"tensor parallelism fits too but costs more: {_grid_text(other)}, {other.memory.placement()} "
                     f"at {other.step_ms:.1f} ms ({other.parts.get('tensor_all_reduce', 0.0):.1f} ms of all-reduces "
                     f"a step)")]
        return []

    def table(self) -> str:
        """Every candidate, best first, as a markdown table."""
        rows = [("| ulysses | ring | cfg | tensor | schedule | weights | text enc. | step ms | attention | a2a | "
                 "ring exposed | rest | tensor all-reduce | weight gather | GB/rank | GiB/rank |"),
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p in self.candidates:
            g, x = p.grid, p.parts
            rows.append(
                f"| {g.ulysses} | {g.ring} | {g.cfg} | {g.tensor} | {p.schedule} | "
                f"{'sharded' if p.shard_weights else 'replicated'} | {p.text_encoder} | {p.step_ms:.1f} | "
                f"{x['attention']:.1f} | "
                f"{x['ulysses_all_to_all']:.1f} | {x['ring_exposed']:.1f} | {x['rest_of_model']:.1f} | "
                f"{x.get('tensor_all_reduce', 0.0):.1f} | "
                f"{x.get('weight_gather', 0.0):.1f} | {p.comm_bytes_per_rank / 1e9:.2f} | {p.memory_per_rank_gib:.1f} |"
            )
        return "\n".join(rows)


_PHASE_WORDS = {"encode": "encoding the prompt", "denoise": "denoising", "decode": "decoding"}


def _grid_text(p: Prediction) -> str:
    g = p.grid
    sched = f" {p.schedule}" if g.ring > 1 else ""
    tensor = f" x tensor {g.tensor}" if g.tensor > 1 else ""
    return f"ulysses {g.ulysses} x ring {g.ring} x cfg {g.cfg}{tensor}{sched}"


def _parts(p: Prediction) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in p.parts.items() if v >= 0.05)


def _difference(best: Prediction, other: Prediction) -> str:
    """The parts that make ``other`` slower, largest first."""
    diffs = sorted(((other.parts[k] - best.parts[k], k) for k in best.parts), reverse=True)
    said = [f"{k.replace('_', ' ')} +{d:.1f} ms" for d, k in diffs if d > 0.05][:2]
    return ", ".join(said) or "within rounding"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_degrees(spec: ModelSpec, world_size: int) -> list[int]:
    """The tensor degrees a grid of ``spec`` may take on ``world_size`` GPUs: 1, and where its family
    declares cuts (``models`` Note [tensor cuts]) every other divisor up to its heads."""
    if not spec.tensor_parallel:
        return [1]
    return [t for t in _divisors(world_size) if t <= spec.heads]


def candidate_grids(spec: ModelSpec, world_size: int, batch: int, cfg: bool, tensor: bool = False) -> list[Grid]:
    """Every (U, R, cfg, T) with U * R * cfg * T == world_size that ``spec`` can run (T > 1 only
    with ``tensor`` and a family that declares tensor cuts; U at most a tensor rank's heads)."""
    grids = []
    for t in (tensor_degrees(spec, world_size) if tensor else [1]):
        heads = math.ceil(spec.heads / t)
        for c in (1, 2):
            if (world_size // t) % c:
                continue
            for u in _divisors(world_size // t // c):
                grid = Grid(u, world_size // t // c // u, c, t)
                if u > heads:
                    continue
                if c == 2 and not (cfg or batch % 2 == 0):
                    continue
                if c == 2 and spec.guidance == "distilled" and batch % 2:
                    continue
                grids.append(grid)
    return grids


def _spec(model: Any, height, width, num_frames, seconds=None) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return spec_for(model, height, width, num_frames, seconds)
    transformer = getattr(model, "transformer", model)
    if transformer is None or not hasattr(transformer, "config"):
        raise ValueError(f"usp_dit.plan cannot plan a {type(model).__name__}: pass a pipeline, its transformer, "
                         f"or a model name of {sorted(SPECS)}")
    pipe = model if transformer is not model else None
    return spec_of_transformer(transformer, height, width, num_frames, pipe=pipe, seconds=seconds)


def _default_cfg(model: Any, spec: ModelSpec) -> bool:
    """Guidance on by default for families whose pipelines guide with two branches."""
    guidance = getattr(model, "do_classifier_free_guidance", None)
    if isinstance(guidance, bool):
        return guidance
    return spec.guidance != "distilled"


def check_gpu_memory(gpu_memory_gib: Any) -> float | None:
    """``gpu_memory_gib`` as a float, ``None`` kept (no limit).

    Raises:
        ValueError: not a finite number > 0.
    """
    if gpu_memory_gib is None:
        return None
    if isinstance(gpu_memory_gib, bool) or not isinstance(gpu_memory_gib, (int, float)) \
            or not math.isfinite(gpu_memory_gib) or gpu_memory_gib <= 0:
        raise ValueError(f"gpu_memory_gib={gpu_memory_gib!r} must be a number of GiB > 0 (or None: no limit)")
    return float(gpu_memory_gib)


def _placements(world_size: int, limited: bool) -> list[tuple[bool, str]]:
    """``(shard_weights, text_encoder)`` pairs to price: every one under a memory limit on several
    GPUs; else the default (replicated weights and encoders: the plan ``enable_usp`` makes
    without being asked)."""
    if not limited or world_size == 1:
        return [(False, "replicate")]
    return [(shard, enc) for shard in (False, True) for enc in ENCODER_PLACEMENTS]


def _sort_key(p: Prediction) -> tuple:
    """Cheapest first; on a tie fewer ring ranks, the streaming schedule (least memory), fewer tensor
    ranks, replicated weights, then the text encoder placement that gathers least ("replicate",
    "shard", "rank0")."""
    schedule = SCHEDULES.index(p.schedule) if p.schedule in SCHEDULES else -1
    return (round(p.step_ms, 3), p.grid.ring, schedule, p.grid.tensor, p.shard_weights,
            ENCODER_PLACEMENTS.index(p.text_encoder))


def priced(spec: ModelSpec, world_size: int, *, batch: int = 1, cfg: bool, interconnect: str = "nvlink",
           gpu: GPU, backend: str = kernels.DEFAULT_BACKEND, placements: list[tuple[bool, str]] | None = None,
           tensor: bool = False) -> list[Prediction]:
    """Every grid (with ``tensor``, tensor-parallel ones too), schedule and placement of ``spec`` on
    ``world_size`` GPUs, priced and sorted (``_sort_key``); no memory filter and no check that
    enable_usp can run the model."""
    placements = placements or [(False, "replicate")]
    predictions = []
    for grid in candidate_grids(spec, world_size, batch, cfg, tensor):
        for schedule in (SCHEDULES if grid.ring > 1 else ("none",)):
            base = predict(spec, grid, schedule, batch=batch, cfg=cfg, interconnect=interconnect, gpu=gpu,
                           backend=backend)
            predictions.extend(placed(spec, base, shard_weights=shard, text_encoder=enc, interconnect=interconnect)
                               for shard, enc in placements)
    predictions.sort(key=_sort_key)
    return predictions


def _fits(predictions: list[Prediction], gpu_memory_gib: float | None) -> tuple[list[Prediction], list[Prediction]]:
    """``(fitting, unfit)``: the predictions whose peak is at most ``gpu_memory_gib``, in order."""
    if gpu_memory_gib is None:
        return predictions, []
    return ([p for p in predictions if p.memory_per_rank_gib <= gpu_memory_gib],
            [p for p in predictions if p.memory_per_rank_gib > gpu_memory_gib])


def _too_small(spec: ModelSpec, world_size: int, gpu_memory_gib: float, unfit: list[Prediction]) -> ValueError:
    """The error naming the smallest ``gpu_memory_gib`` at which some candidate fits."""
    least = min(unfit, key=lambda p: p.memory_per_rank_gib)
    need = math.ceil(least.memory_per_rank_gib * 10) / 10
    return ValueError(
        f"gpu_memory_gib={gpu_memory_gib:g}: no grid and placement of {spec.label or spec.name} fits on "
        f"{world_size} GPU(s); the smallest that works is gpu_memory_gib={need:g} ({_grid_text(least)}, "
        f"{least.memory.placement()}: {least.memory_per_rank_gib:.2f} GiB a rank). Use GPUs of at least that "
        f"much memory or more of them."
    )


def plan(
    pipe_or_transformer: Any,
    *,
    world_size: int,
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    seconds: float | None = None,
    batch: int = 1,
    cfg: bool | None = None,
    interconnect: str = "nvlink",
    gpu: str | None = None,
    backend: str = kernels.DEFAULT_BACKEND,
    gpu_memory_gib: float | None = None,
) -> Plan:
    """The grid, schedule, kernel and placement with the lowest predicted step time (module docstring).

    Args:
        pipe_or_transformer: a Diffusers pipeline, its transformer, or a model name (``SPECS``).
            A pipeline's memory is counted from its own components (transformers, text encoders,
            VAE); a bare transformer's has no text encoders or VAE; a name takes the release's.
        world_size: GPUs the job runs on (>= 1).
        height, width, num_frames: the output size; ``None`` takes the model's usual size.
        seconds: an audio model's output length (its only size; ``models`` Note [audio specs]).
        batch: prompts per step. cfg: whether classifier-free guidance runs two branches
            (``None``: the family's usual).
        interconnect: "nvlink" (one node), "pcie", or "infiniband" (nodes of 8 over NVLink).
        gpu: "h200" (default) or "h100".
        gpu_memory_gib: GiB each GPU may hold (e.g. 24). Every placement of the weights and text
            encoders is priced and only those whose peak per rank fits are kept
            (``usp_dit.planner.memory`` Note [memory per rank]). ``None``: no limit, and the
            weights and text encoders stay replicated (the memory is still reported).

    Raises:
        ValueError: world_size < 1, batch < 1, gpu_memory_gib <= 0, an unknown interconnect or GPU,
            a model the planner does not know (naming the ones it does) or that enable_usp cannot
            run yet, or no grid and placement that fits ``gpu_memory_gib`` (naming the smallest
            that would).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be an int >= 1")
    limit = check_gpu_memory(gpu_memory_gib)
    check_interconnect(interconnect)
    device = check_gpu(gpu)
    spec = _spec(pipe_or_transformer, height, width, num_frames, seconds)
    if spec.unsupported:
        raise ValueError(f"model {spec.name!r} ({spec.label}): {spec.unsupported}; the planner has its memory "
                         f"(python -m usp_dit.planner --memory-table) but plans only what enable_usp runs")
    guided = _default_cfg(pipe_or_transformer, spec) if cfg is None else bool(cfg)
    return choose(spec, world_size, batch=batch, cfg=guided, interconnect=interconnect, gpu=device,
                  backend=backend, gpu_memory_gib=limit)


def choose(spec: ModelSpec, world_size: int, *, batch: int = 1, cfg: bool, interconnect: str = "nvlink",
           gpu: GPU, backend: str = kernels.DEFAULT_BACKEND, gpu_memory_gib: float | None = None) -> Plan:
    """``plan``'s choice for a spec, whether or not enable_usp can run it (the memory table's
    models that it cannot are priced the same way).

    Raises:
        ValueError: no grid and placement fits ``gpu_memory_gib``.
    """
    limited = gpu_memory_gib is not None
    every = priced(spec, world_size, batch=batch, cfg=cfg, interconnect=interconnect, gpu=gpu, backend=backend,
                   placements=_placements(world_size, limited), tensor=limited)
    fitting, unfit = _fits(every, gpu_memory_gib)
    if not fitting:
        raise _too_small(spec, world_size, gpu_memory_gib, unfit)
    best = fitting[0]
    g = best.grid
    return Plan(spec.name, world_size, g.ulysses, g.ring, g.cfg, best.schedule if g.ring > 1 else "auto", backend,
                best.step_ms, best.comm_bytes_per_rank, best.memory_per_rank_gib, interconnect, fitting,
                best.shard_weights, best.text_encoder, best.memory, gpu_memory_gib, unfit, g.tensor, _notes(spec))


def _notes(spec: ModelSpec) -> tuple[str, ...]:
    """What ``spec``'s figures leave out, which are estimates, and where its time is priced roughly,
    for explain()."""
    left_out = spec.memory.left_out if spec.memory is not None else ""
    vae = spec.memory.vae if spec.memory is not None else None
    estimate = vae is not None and vae.estimated
    return tuple(note for note in (left_out and f"Memory leaves out {left_out}",
                                   estimate and f"The VAE decode's memory ({vae.name}) is an {vae.source}",
                                   spec.caveat and f"Time is rough: {spec.caveat}") if note)


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


MEMORY_TABLE_MODELS = ("flux2", "qwen_image", "wan22", "hunyuan_video15", "kandinsky6")
MEMORY_TABLE_WORLDS = (1, 2, 4, 8)
_TABLE_PLACEMENTS = ((False, "replicate"), (False, "shard"), (True, "replicate"), (True, "shard"))


def _fastest_grid(spec: ModelSpec, world: int, gpu: GPU, interconnect: str) -> Prediction:
    """The fastest grid and schedule of ``spec`` on ``world`` GPUs, weights and encoders replicated."""
    return priced(spec, world, cfg=spec.guidance != "distilled", interconnect=interconnect, gpu=gpu)[0]


def _limited_plan_text(spec: ModelSpec, world: int, gpu: GPU, interconnect: str, limit: float) -> str:
    """The plan at ``limit`` GiB a GPU in a few words, or what it would need."""
    try:
        chosen = choose(spec, world, cfg=spec.guidance != "distilled", interconnect=interconnect, gpu=gpu,
                        gpu_memory_gib=limit)
    except ValueError:
        every = priced(spec, world, cfg=spec.guidance != "distilled", interconnect=interconnect, gpu=gpu,
                       placements=_placements(world, True), tensor=True)
        return f"none (needs {min(p.memory_per_rank_gib for p in every):.1f})"
    best = chosen.candidates[0]
    weights = ("sharded" if best.shard_weights else "replicated") + (f" + TP {best.tensor}" if best.tensor > 1 else "")
    return (("would be " if spec.unsupported else "") + f"{_grid_text(best)}, {weights}, {best.text_encoder!r}: "
            f"{best.memory_per_rank_gib:.1f} GiB, {best.step_ms:.0f} ms")


def _tensor_text(spec: ModelSpec, world: int, gpu: GPU, interconnect: str) -> str:
    """The fastest tensor-parallel grid (T > 1) of ``spec`` on ``world`` GPUs in a few words: T, the
    transformer's GiB a rank replicated / sharded, and the peak with a sharded text encoder."""
    if world == 1:
        return "-"
    if not spec.tensor_parallel:
        return "no cuts"
    cut = [p for p in priced(spec, world, cfg=spec.guidance != "distilled", interconnect=interconnect, gpu=gpu,
                             tensor=True) if p.tensor > 1]
    if not cut:
        return "-"
    base = cut[0]
    repl, shard = (placed(spec, base, shard_weights=w, text_encoder="shard", interconnect=interconnect).memory
                   for w in (False, True))
    return f"T {base.tensor}: {repl.weights:.1f} / {shard.weights:.1f}; peak {repl.total:.1f} / {shard.total:.1f}"


def memory_table(models: tuple[str, ...] = MEMORY_TABLE_MODELS, worlds: tuple[int, ...] = MEMORY_TABLE_WORLDS, *,
                 gpu_memory_gib: float = 24.0, interconnect: str = "nvlink", gpu: str | None = None) -> str:
    """Markdown: per model and GPU count, one rank's GiB of each part (``usp_dit.planner.memory``
    Note [memory per rank]) at the fastest grid, the peak in each placement, the fastest
    tensor-parallel grid's (where the family declares cuts), and the plan at ``gpu_memory_gib`` a
    GPU (``plan(..., gpu_memory_gib=)``'s choice: grid, weights, text encoder, peak, step ms). A
    projection from the planner's counts; models enable_usp cannot run yet are marked and priced
    the same way."""
    device, limit = check_gpu(gpu), check_gpu_memory(gpu_memory_gib)
    rows = [
        ("| model | GPUs | grid (fastest) | transformer repl. / sharded | text enc. whole / shard | activations | "
         "VAE | peak repl. + whole | repl. + shard | sharded + whole | sharded + shard | "
         f"tensor parallel (transformer repl. / sharded; peak, text enc. shard) | plan at {limit:g} GiB |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in models:
        spec = spec_for(name)
        label = spec.label + (" (not runnable yet)" if spec.unsupported else "")
        for world in worlds:
            base = _fastest_grid(spec, world, device, interconnect)
            peaks = [placed(spec, base, shard_weights=w, text_encoder=e, interconnect=interconnect).memory
                     for w, e in _TABLE_PLACEMENTS]
            repl, shard = peaks[0], peaks[3]
            rows.append(
                f"| {label} | {world} | {base.grid.ulysses} x {base.grid.ring} x {base.grid.cfg}"
                f"{' ' + base.schedule if base.grid.ring > 1 else ''} | "
                f"{repl.weights:.1f} / {shard.weights:.1f} | {repl.text_encoders:.1f} / {shard.text_encoders:.1f} | "
                f"{repl.activations:.1f} | {repl.vae:.1f} | " + " | ".join(f"{m.total:.1f}" for m in peaks)
                + f" | {_tensor_text(spec, world, device, interconnect)}"
                + f" | {_limited_plan_text(spec, world, device, interconnect, limit)} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m usp_dit.planner", description="Predicted step time of every grid.")
    p.add_argument("--model", choices=sorted(SPECS))
    p.add_argument("--world-size", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--frames", type=int, dest="num_frames")
    p.add_argument("--seconds", type=float, help="an audio model's output length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cfg", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--interconnect", default="nvlink", choices=INTERCONNECTS)
    p.add_argument("--gpu", default="h200")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="GiB a GPU may hold: price every placement of the weights and text encoders and keep "
                        "those that fit (usp_dit.planner.memory)")
    p.add_argument("--project", action="store_true",
                   help="print the best plan at 1, 2, 4, 8 GPUs (NVLink) and 16, 32, 64 (InfiniBand) instead")
    p.add_argument("--memory-table", action="store_true",
                   help="print the memory per rank of Flux.2-dev, Qwen-Image, Wan 2.2 A14B, HunyuanVideo 1.5 and "
                        "Kandinsky 6 at 1, 2, 4, 8 GPUs, replicated and sharded (--model: that model only; "
                        "--gpu-memory-gib: the limit of the last column, default 24)")
    args = p.parse_args(argv)
    try:
        if args.memory_table:
            models = (args.model,) if args.model else MEMORY_TABLE_MODELS
            limit = 24.0 if args.gpu_memory_gib is None else args.gpu_memory_gib
            print(memory_table(models, gpu_memory_gib=limit, interconnect=args.interconnect, gpu=args.gpu))
            return 0
        if args.model is None or (args.world_size is None and not args.project):
            p.error("--model and --world-size are required (except with --memory-table)")
        if args.project:
            print(projection(args.model, height=args.height, width=args.width, num_frames=args.num_frames,
                             seconds=args.seconds, batch=args.batch, cfg=args.cfg, gpu=args.gpu))
            return 0
        result = plan(args.model, world_size=args.world_size, height=args.height, width=args.width,
                      num_frames=args.num_frames, seconds=args.seconds, batch=args.batch, cfg=args.cfg,
                      interconnect=args.interconnect,
                      gpu=args.gpu, gpu_memory_gib=args.gpu_memory_gib)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.table())
    print()
    print(result.explain())
    return 0
