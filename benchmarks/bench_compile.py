"""Compiled transformer step on one GPU: ``torch.compile`` of stock Diffusers against the same model
after ``enable_usp`` (world size 1), side by side in one run.

    PYTHONPATH=. python3 benchmarks/bench_compile.py --model flux                       # Flux.1-dev 1024^2
    PYTHONPATH=. python3 benchmarks/bench_compile.py --model flux --mode reduce-overhead  # CUDA graphs
    PYTHONPATH=. python3 benchmarks/bench_compile.py --model cogvideox,wan --rounds 3 --json out.json

The models, inputs and timing are benchmarks/bench_pipelines.py's (full-size transformers with
random weights, bf16, batch 1, ``torch.inference_mode``). One ``torch.compile(model, mode=...)``
serves both variants: the model is switched between stock and USP with ``enable_usp`` /
``disable_usp`` and Dynamo keeps one graph per variant (the switch changes what its guards see),
so after the warm-up neither recompiles. Each round times ``--iters`` forwards of each variant;
the median over ``--rounds`` is reported, in ms per forward. Also the eager stock time (the
compile speed-up) and the recompiles seen after the warm-up (must be 0).

Goal (issue 17): compiled usp / compiled stock <= 1.00.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch

try:
    import bench_pipelines  # run as benchmarks/bench_compile.py: this folder is on sys.path
except ImportError:
    from benchmarks import bench_pipelines


def _frames_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def bench(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Build ``name``'s model, compile it once, warm both variants, time them interleaved."""
    start = time.perf_counter()
    model, inputs, shape = bench_pipelines.CASES[name](device)
    compiled = torch.compile(model, mode=None if args.mode == "default" else args.mode)
    samples: dict[str, list[float]] = {"eager stock": [], "stock": [], "usp": []}
    outputs = {}
    with torch.inference_mode():
        bench_pipelines.set_variant(model, "stock", args.backend)
        for _ in range(2):
            model(**inputs)
        for variant in ("stock", "usp"):
            bench_pipelines.set_variant(model, variant, args.backend)
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                outputs[variant] = compiled(**inputs)[0].float()
            torch.cuda.synchronize()
            print(f"# {name} {variant}: compiled and warmed in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        graphs = _frames_compiled()
        for _ in range(args.rounds):
            bench_pipelines.set_variant(model, "stock", args.backend)
            samples["eager stock"].append(bench_pipelines.time_round(lambda: model(**inputs), args.iters))
            for variant in ("stock", "usp"):
                bench_pipelines.set_variant(model, variant, args.backend)
                samples[variant].append(bench_pipelines.time_round(lambda: compiled(**inputs), args.iters))
        bench_pipelines.set_variant(model, "stock", args.backend)
    ref, got = outputs["stock"], outputs["usp"]
    med = {k: statistics.median(v) for k, v in samples.items()}
    row = {
        "model": name, "shape": shape, "mode": args.mode, "eager_stock_ms": med["eager stock"],
        "stock_ms": med["stock"], "usp_ms": med["usp"], "ratio": med["usp"] / med["stock"],
        "recompiles_after_warmup": _frames_compiled() - graphs,
        "max_rel_diff": ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item(),
        "seconds": time.perf_counter() - start,
    }
    del model, compiled, inputs, outputs
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux", help=f"comma-separated: {', '.join(bench_pipelines.CASES)}")
    p.add_argument("--mode", default="default", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
    p.add_argument("--backend", default="auto", help="usp_dit attention backend for the usp variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_compile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch._dynamo.config.recompile_limit = 16  # two variants per code object, never near the default
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}; bf16, batch 1, world size 1; "
          f"torch.compile mode={args.mode}; ms per forward (median of {args.rounds} rounds x {args.iters})")
    print("| model | shape | eager stock ms | compiled stock ms | compiled usp ms | usp/stock | recompiles | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for name in args.model.split(","):
        r = bench(name, args, device)
        rows.append(r)
        print(f"| {name} | {r['shape']} | {r['eager_stock_ms']:.1f} | {r['stock_ms']:.1f} | {r['usp_ms']:.1f} | "
              f"{r['ratio']:.3f} | {r['recompiles_after_warmup']} | {r['max_rel_diff']:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
