"""Why a host-bound model runs slower under ``enable_usp`` than stock at world size 1 (DiT: 1.17x
on an H100 with bit-identical outputs, 2026-12-06): one process, both variants alternately.

    PYTHONPATH=. python3 benchmarks/diag_host_gap.py --model dit

Per variant: the wall time of a forward (20 forwards, synced at the end; median of 5 rounds,
alternating variants), the host time of a small elementwise op in that state (a global slowdown
of tensor dispatch would show there), then one forward under ``torch.profiler`` (CPU and CUDA):
the CUDA runtime calls (launches, mallocs, syncs, copies) and the kernels launched, counted, and the
ops with the most self CPU time. A difference in launches or runtime calls names the cause; equal
counts with a slower wall time point at the host (Python) or at the GPU's clocks.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bench_pipelines as bp


def _wall_ms(forward, iters: int = 20) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        forward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def _micro_us(n: int = 5000) -> float:
    a = torch.randn(64, 64, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        a.mul(1.0001)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def _profile(forward, top: int) -> None:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    events = prof.key_averages()
    runtime = sorted((e for e in events if e.key.startswith("cuda")), key=lambda e: -e.count)
    print("    CUDA runtime calls: " + ", ".join(f"{e.key} {e.count}" for e in runtime[:8]))
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"    kernels: {sum(e.count for e in kernels)} launches, {device_ms:.2f} ms")
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_cpu_time_total)
    for e in cpu[:top]:
        print(f"    {e.self_cpu_time_total / 1e3:8.2f} ms self CPU  {e.count:5d}x  {e.key[:70]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dit")
    p.add_argument("--backend", default="auto")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    model, inputs, shape = bp.CASES[args.model](torch.device("cuda"))
    forward = lambda: model(**inputs)  # noqa: E731
    print(f"# {args.model} {shape}")
    walls: dict[str, list[float]] = {"stock": [], "usp": []}
    micros: dict[str, list[float]] = {"stock": [], "usp": []}
    with torch.inference_mode():
        for variant in ("stock", "usp"):  # warm-up
            bp.set_variant(model, variant, args.backend)
            for _ in range(3):
                forward()
        for _ in range(5):
            for variant in ("stock", "usp"):
                bp.set_variant(model, variant, args.backend)
                forward()
                walls[variant].append(_wall_ms(forward))
                micros[variant].append(_micro_us())
        for variant in ("stock", "usp"):
            bp.set_variant(model, variant, args.backend)
            rounds = ", ".join(f"{w:.1f}" for w in walls[variant])
            print(f"{variant}: {statistics.median(walls[variant]):.2f} ms a forward (rounds {rounds}); "
                  f"a small op {statistics.median(micros[variant]):.2f} us")
            _profile(forward, args.top)
        bp.set_variant(model, "stock", args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
