"""Where one transformer forward spends its GPU time, stock against ``enable_usp`` (world size 1).

    PYTHONPATH=. python3 benchmarks/profile_step.py --model sd35

One model of ``bench_pipelines.CASES``; after two warm-up forwards per variant, one profiled forward
each (``torch.profiler``, CUDA activity); prints each variant's total CUDA time and its top kernels,
so a usp/stock ratio above 1 in bench_pipelines can be traced to the kernels (or the gaps) that cause it.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import bench_pipelines as bp


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="sd35", help=f"one of {', '.join(bp.CASES)}")
    p.add_argument("--backend", default="auto")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    model, inputs, shape = bp.CASES[args.model](device)
    print(f"# {args.model} {shape}")
    with torch.inference_mode():
        for variant in ("stock", "usp"):
            bp.set_variant(model, variant, args.backend)
            for _ in range(2):
                model(**inputs)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                model(**inputs)
                torch.cuda.synchronize()
            events = prof.key_averages()
            cuda_total = sum(e.self_device_time_total for e in events) / 1e3
            print(f"## {variant}: {cuda_total:.1f} ms of CUDA kernels")
            print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))
        bp.set_variant(model, "stock", args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
