"""Diffusers' First Block Cache on the Flux.1-dev transformer at world size 1: step time saved.

    PYTHONPATH=. python3 benchmarks/bench_cache.py --steps 28 --json cache.json

Full-size Flux.1-dev transformer with random weights (benchmarks/bench_pipelines.py's config), bf16,
1024x1024 (4096 image + 512 text tokens), ``torch.inference_mode``. A flow-matching Euler loop of
``--steps`` steps (the latents move by the model's prediction, as in FluxPipeline) is run three
ways: uncached; uncached with a hook recording First Block Cache's metric at every step (mean
|r_t - r_(t-1)| / mean |r_(t-1)| of the first block's residual r); cached with
``FirstBlockCacheConfig(threshold=median of that metric)``, which skips about half the steps. The
number of skipped steps is counted (calls of the second block's first norm), the loop times compared. Under
``enable_usp`` on a grid the decision is taken on the full-sequence metric (usp_dit.pipelines.caches),
so a grid skips the same steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

try:
    import bench_pipelines  # run as benchmarks/bench_cache.py: this folder is on sys.path
except ImportError:
    from benchmarks import bench_pipelines


def _loop(model, inputs: dict, steps: int) -> torch.Tensor:
    x = inputs["hidden_states"]
    for i in range(steps):
        t = 1.0 - i / steps
        with model.cache_context("cond"):  # as FluxPipeline does (the cache keeps state per context)
            v = model(**{**inputs, "hidden_states": x, "timestep": torch.full_like(inputs["timestep"], t)})[0]
        x = x - v / steps
    return x


def _timed_loop(model, inputs: dict, steps: int) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = _loop(model, inputs, steps)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), out


def _metrics(model, inputs: dict, steps: int) -> list[float]:
    """First Block Cache's metric at every step of an uncached loop."""
    block, previous, metrics = model.transformer_blocks[0], [None], []

    def hook(module, args, kwargs, output):
        residual = (output[1] if isinstance(output, tuple) else output) - kwargs.get("hidden_states", args[0] if args else None)
        if previous[0] is not None:
            metrics.append(((residual - previous[0]).abs().mean() / previous[0].abs().mean()).item())
        previous[0] = residual

    handle = block.register_forward_hook(hook, with_kwargs=True)
    try:
        _loop(model, inputs, steps)
    finally:
        handle.remove()
    return metrics


def main(argv: list[str] | None = None) -> int:
    from diffusers import FirstBlockCacheConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    model, inputs, shape = bench_pipelines.flux_case(device)
    with torch.inference_mode():
        _loop(model, inputs, 2)  # warm-up
        metrics = _metrics(model, inputs, args.steps)
        threshold = statistics.median(metrics)
        plain = [_timed_loop(model, inputs, args.steps)[0] for _ in range(args.rounds)]
        calls = [0]
        # the second block's norm runs only when the block computes (a skipped block's hook returns early)
        handle = model.transformer_blocks[1].norm1.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
        model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        cached = []
        for _ in range(args.rounds):
            calls[0] = 0
            cached.append(_timed_loop(model, inputs, args.steps)[0])
        handle.remove()
        model.disable_cache()
    row = dict(
        model="flux-dev", shape=shape, steps=args.steps, threshold=round(threshold, 4),
        steps_computed=calls[0], steps_skipped=args.steps - calls[0],
        uncached_ms=round(statistics.median(plain), 1), cached_ms=round(statistics.median(cached), 1),
    )
    row["time_ratio"] = round(row["cached_ms"] / row["uncached_ms"], 3)
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
