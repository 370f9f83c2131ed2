"""Several GPUs: step time, parallel efficiency and parity of a transformer on (U, R) grids (issue 6).

    torchrun --nproc-per-node 4 benchmarks/bench_scaling.py --model flux --json flux_p4.json
    torchrun --nproc-per-node 8 benchmarks/bench_scaling.py --model mochi --grids 8x1,4x2,2x4,1x8
    torchrun --nproc-per-node 4 benchmarks/bench_scaling.py --model flux2048 --ring-schedule stream
    torchrun --nproc-per-node 2 benchmarks/bench_scaling.py --tiny      # CPU / gloo: the CI smoke run

Every rank builds the same seeded random-weight transformer and the same inputs. It first times the
stock model alone (t1: each rank its own copy, concurrently, no communication), then the same model
under ``enable_usp`` on each (U, R) grid with U * R = world size (all ranks together, cfg 1). Timing:
median over ``--rounds`` rounds of ``--iters`` forwards (CUDA events on GPUs, wall clock on CPU),
the slowest rank's figure, beside the planner's prediction for the real models (usp_dit.planner:
datasheet links until this run calibrates them). Parallel efficiency = t1 / (P * tP). Parity: max|out - out_1| / max|out_1|
of the grid's output against the stock output on the same rank, worst rank; the run exits 1 when it
is above ``--tolerance`` (default: 5e-2 in bf16, the rounding of different kernel splits; 1e-4 in
float32). Models: Flux.1-dev 1024² and 2048², CogVideoX-5B 49 x 480 x 720, Mochi-1 163 x 480 x 848
(configs in ``bench_pipelines``), or ``--tiny`` ones on CPU.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, set below unless already set): the lent
machines require it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable

for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _val)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_pipelines import cogvideox_case, flux_case, mochi_case  # noqa: E402
from usp_dit.distributed.config import RING_SCHEDULES  # noqa: E402

REAL = {
    "flux": lambda dev: flux_case(dev),
    "flux2048": lambda dev: flux_case(dev, 2048, 2048),
    "cogvideox": lambda dev: cogvideox_case(dev),
    "mochi": lambda dev: mochi_case(dev),
}


def tiny_cases() -> dict[str, Callable]:
    """Small float32 models of the three families (CPU smoke run): (model, kwargs, shape text)."""
    from usp_dit.demo.tiny_flux import flux_inputs, tiny_flux_transformer
    from usp_dit.demo.tiny_video import cogvideox_inputs, mochi_inputs, tiny_cogvideox, tiny_mochi

    def flux(dev):
        kwargs = {**flux_inputs(1, 12, 12, 7), "guidance": torch.full((1,), 3.5), "return_dict": False}
        return tiny_flux_transformer(), kwargs, "tiny 144 + 7 tokens"

    def cog(dev):
        model = tiny_cogvideox()
        return model, {**cogvideox_inputs(model, 3, 8, 8, batch=1).kwargs(), "return_dict": False}, "tiny 48 + 7 tokens"

    def mochi(dev):
        model = tiny_mochi()
        return model, {**mochi_inputs(model, 3, 8, 8).kwargs(), "return_dict": False}, "tiny 48 + 9 tokens"

    return {"flux": flux, "cogvideox": cog, "mochi": mochi}


def parse_grids(text: str | None, world: int) -> list[tuple[int, int]]:
    """``"4x1,2x2"`` -> [(4, 1), (2, 2)]; by default every U x R = world with U a power of two."""
    if text:
        grids = [tuple(int(x) for x in g.split("x")) for g in text.split(",")]
    else:
        grids = [(u, world // u) for u in (8, 4, 2, 1) if u <= world and world % u == 0]
    for u, r in grids:
        if u * r != world:
            raise ValueError(f"--grids entry {u}x{r}: U * R must equal the world size {world}")
    return grids


def timed(forward: Callable[[], torch.Tensor], device: torch.device, warmup: int, iters: int, rounds: int) -> float:
    """Median ms per forward over ``rounds`` rounds of ``iters`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        forward()
    samples = []
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            forward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(samples)


def worst(value: float) -> float:
    """The largest ``value`` over ranks (the slowest rank sets a parallel step's time)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def bench_model(name: str, build: Callable, args, device: torch.device, world: int) -> list[dict]:
    """t1 and every grid's tP, efficiency and parity for one model; rows for rank 0 to print."""
    import usp_dit

    torch.manual_seed(0)  # the same random weights on every rank
    model, kwargs, shape = build(device)
    model = model.to(device)
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}

    def forward() -> torch.Tensor:
        return model(**kwargs)[0]

    rows = []
    with torch.inference_mode():
        ref = forward()
        t1 = worst(timed(forward, device, args.warmup, args.iters, args.rounds))
        for u, r in parse_grids(args.grids, world):
            usp_dit.enable_usp(model, ulysses_degree=u, ring_degree=r, backend=args.backend,
                               ring_schedule=args.ring_schedule)
            try:
                out = forward()
                tp = worst(timed(forward, device, args.warmup, args.iters, args.rounds))
            finally:
                usp_dit.disable_usp(model)
            rows.append(dict(model=name, shape=shape, world=world, ulysses=u, ring=r, schedule=args.ring_schedule,
                             t1_ms=t1, tp_ms=tp,
                             predicted_ms=None if args.tiny else predicted_ms(name, u, r, args.ring_schedule),
                             speedup=t1 / tp, efficiency=t1 / (world * tp),
                             max_rel_diff=worst(rel_diff(out, ref))))
    del model, kwargs, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


PLANNER_SPECS = {"flux": ("flux", {}), "flux2048": ("flux", {"height": 2048, "width": 2048}),
                 "cogvideox": ("cogvideox", {}), "mochi": ("mochi", {})}


def predicted_ms(name: str, ulysses: int, ring: int, schedule: str, interconnect: str = "nvlink") -> float | None:
    """The cost model's time for one forward of a real model on this grid (usp_dit.planner.cost,
    batch 1, no CFG: what this script times), so that the first several-GPU run calibrates it;
    "auto" takes the schedule the model finds cheapest. ``None`` for the tiny models."""
    if name not in PLANNER_SPECS:
        return None
    from usp_dit.planner.cost import SCHEDULES, Grid, predict
    from usp_dit.planner.hardware import check_gpu
    from usp_dit.planner.models import spec_for

    model, size = PLANNER_SPECS[name]
    spec = spec_for(model, **size)
    schedules = (schedule,) if schedule != "auto" else SCHEDULES
    return min(predict(spec, Grid(ulysses, ring), s, gpu=check_gpu("h200"), interconnect=interconnect).step_ms
               for s in (schedules if ring > 1 else ("none",)))


def markdown(row: dict) -> str:
    pred = "—" if row.get("predicted_ms") is None else f"{row['predicted_ms']:.1f}"
    return (f"| {row['model']} | {row['shape']} | {row['world']} | {row['ulysses']}x{row['ring']} | {row['schedule']} | "
            f"{row['t1_ms']:.1f} | {row['tp_ms']:.1f} | {pred} | {row['speedup']:.2f} | {row['efficiency']:.2f} | "
            f"{row['max_rel_diff']:.1e} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"one of {sorted(REAL)} or 'all' (default: all with --tiny, else flux)")
    p.add_argument("--tiny", action="store_true", help="tiny float32 models on CPU (a smoke run of this script)")
    p.add_argument("--grids", default=None, help="UxR list, e.g. 4x1,2x2,1x4 (default: every split of the world)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--ring-schedule", default="auto", choices=RING_SCHEDULES)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tolerance", type=float, default=None, help="parity bound (default 5e-2 bf16, 1e-4 tiny float32)")
    p.add_argument("--json", default=None, help="rank 0 writes the rows here")
    return p.parse_args()


def main() -> int:
    from usp_dit.cli.launch import init_distributed

    args = parse_args()
    rank, world, device = init_distributed()
    cases = tiny_cases() if args.tiny else REAL
    names = list(cases) if (args.model in (None, "all") and args.tiny) or args.model == "all" else [args.model or "flux"]
    tol = args.tolerance or (1e-4 if args.tiny else 5e-2)
    if rank == 0:
        print(f"# {world} x {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}; "
              f"ms per transformer forward, slowest rank; efficiency = t1 / (P * tP)", flush=True)
        print("| model | shape | P | UxR | schedule | t1 ms | tP ms | predicted tP ms | speedup | efficiency | max rel diff |")
        print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for name in names:
        for row in bench_model(name, cases[name], args, device, world):
            rows.append(row)
            if rank == 0:
                print(markdown(row), flush=True)
    bad = [r for r in rows if not r["max_rel_diff"] <= tol]
    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        print(f"parity: {'MISMATCH' if bad else 'MATCH'} (worst {max(r['max_rel_diff'] for r in rows):.1e}, "
              f"tolerance {tol:.0e})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # a failure is a traceback and a non-zero status, never a half table passing as done
        traceback.print_exc()
        code = 1
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
