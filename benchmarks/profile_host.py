"""Where one transformer forward spends its *host* (Python) time, stock against ``enable_usp``
(world size 1): for models whose forward is host-bound (a few ms of GPU work, e.g. PixArt, DiT),
where ``profile_step.py``'s kernel table shows equal CUDA time and the ratio comes from Python.

    PYTHONPATH=. python3 benchmarks/profile_host.py --model pixart
    PYTHONPATH=. python3 benchmarks/profile_host.py --model pixart --device cpu --tiny   # no GPU: a tiny config

One model of ``bench_pipelines.CASES``; per variant, warm-up forwards, then ``--iters`` forwards
under ``cProfile`` (each variant's wall time without the profiler first). Prints, per function,
the difference in own time per forward (usp - stock) and the calls per forward of each variant,
largest first: a function stock never calls shows ``0 -> n``. cProfile inflates Python's cost
about 2-3x, so read the differences as a ranking, and the unprofiled wall times as the figure.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

import bench_pipelines as bp

# A config small enough that the CPU's kernels cost about what an H100's launches do (host-bound).
_TINY = {"pixart": dict(num_attention_heads=2, attention_head_dim=8, caption_channels=16, cross_attention_dim=16,
                        sample_size=8),
         "dit": dict(num_attention_heads=2, attention_head_dim=8, sample_size=8)}


def _wall_ms(forward, iters: int, sync) -> float:
    """Median over 5 rounds of ``iters`` forwards, ms per forward."""
    rounds = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            forward()
        sync()
        rounds.append((time.perf_counter() - start) / iters * 1e3)
    return sorted(rounds)[2]


def _own_times(forward, iters: int, sync) -> dict[str, tuple[float, float]]:
    """``{function: (own seconds, calls)}`` over ``iters`` profiled forwards."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        forward()
    sync()
    prof.disable()
    out = {}
    for (path, line, name), (_, calls, own, _, _) in pstats.Stats(prof).stats.items():
        out[f"{path.rsplit('/', 1)[-1]}:{line}({name})"] = (own, calls)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pixart", help=f"one of {', '.join(bp.CASES)}")
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help=f"the tiny config of {sorted(_TINY)} (for the CPU)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    device = torch.device(args.device)
    if args.tiny:  # float32 on the CPU (bf16 matmuls there are not host-bound), as check_cases builds
        import pipeline_cases as pc
        from check_cases import as_float32, build_tiny

        model, inputs, shape = getattr(pc, f"{args.model}_case")(build_tiny, device, 64, 64, config=_TINY[args.model])
        inputs = {k: as_float32(v) for k, v in inputs.items()}
    else:
        model, inputs, shape = bp.CASES[args.model](device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"# {args.model} {shape}")
    wall, own = {}, {}
    with torch.inference_mode():
        for variant in ("stock", "usp"):
            bp.set_variant(model, variant, args.backend)
            forward = lambda: model(**inputs)  # noqa: E731
            for _ in range(3):
                forward()
            wall[variant] = _wall_ms(forward, args.iters, sync)
            own[variant] = _own_times(forward, args.iters, sync)
        bp.set_variant(model, "stock", args.backend)
    print(f"wall ms a forward: stock {wall['stock']:.2f}, usp {wall['usp']:.2f} ({wall['usp'] / wall['stock']:.3f}x)")
    rows = []
    for key in own["stock"].keys() | own["usp"].keys():
        (a, na), (b, nb) = own["stock"].get(key, (0.0, 0)), own["usp"].get(key, (0.0, 0))
        rows.append(((b - a) / args.iters * 1e6, key, na / args.iters, nb / args.iters))
    rows.sort(reverse=True)
    print(f"profiled own-time difference, us a forward (total {sum(r[0] for r in rows):.0f}); calls a forward")
    for diff, key, na, nb in rows[:args.top]:
        print(f"{diff:9.1f}  {key[:80]:80s} {na:6.0f} -> {nb:.0f}")
    print("... and where usp spends less (stock's calls it replaces):")
    for diff, key, na, nb in [r for r in rows if r[0] < 0][-max(args.top // 3, 5):]:
        print(f"{diff:9.1f}  {key[:80]:80s} {na:6.0f} -> {nb:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
