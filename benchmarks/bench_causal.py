"""Causal attention on one GPU (the lent H200): the figures of docs/PERFORMANCE.md "Causal attention".

    PYTHONPATH=. python3 benchmarks/bench_causal.py --suite all --json out.json

Suites (every pair of numbers in a row measured side by side, interleaved, in one run):
- world1: causal ``usp_attention`` at world size 1 against the same kernel called directly with
  its causal flag (``backend.forward(..., causal=True)``), forward and forward+backward, for
  Llama-style shapes (32 heads x 128, GQA 8 K/V heads). Goal: ratio <= 1.03.
- balance: one GPU simulating a ring of N ranks (U = 1, R = N, no communication): for each rank,
  the kernel calls of its plans against every ring block (``usp_dit.attention.masks.ring_plans``, merged
  with ``RowMerger`` exactly as the ring merges), timed rank by rank; reports the most loaded
  rank's time over the mean for "contiguous", "zigzag" and "stripe" (goal <= 1.10 for zigzag
  and stripe), beside the index maths' prediction (``rank_work``). Forward, and forward +
  backward (``masked_block_grads``, what the ring backward runs per block pair).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_attention import side_by_side  # noqa: E402  (interleaved rounds, median)
from usp_dit import single_rank_mesh, usp_attention  # noqa: E402
from usp_dit.attention.masked import RowMerger, attend_plan, masked_block_grads  # noqa: E402
from usp_dit.attention.masks import rank_work, ring_plans  # noqa: E402
from usp_dit.kernels import select_backend  # noqa: E402
from usp_dit.kernels.autograd import kernel_backward, kernel_forward  # noqa: E402
from usp_dit.sharding.layouts import block_positions  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _qkv(seq: int, grad: bool, kv_heads: int = KV_HEADS):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(1, seq, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return [t.requires_grad_(grad) for t in (mk(HEADS), mk(kv_heads), mk(kv_heads))]


def suite_world1(seqs: list[int], backend_name: str, repeats: int) -> list[dict]:
    rows, mesh = [], single_rank_mesh()
    for seq in seqs:
        for mode in ("fwd", "fwd+bwd"):
            grad = mode == "fwd+bwd"
            q, k, v = _qkv(seq, grad)
            backend = select_backend(backend_name, "cuda", q.dtype, HEAD_DIM, grad, causal=True)
            dout = torch.randn_like(q)
            scale = HEAD_DIM ** -0.5

            def direct():
                out, lse = kernel_forward(backend, q, k, v, scale, True)
                if grad:
                    kernel_backward(backend, dout, q, k, v, out, lse, scale, True)

            def ours():
                out = usp_attention(q, k, v, mesh=mesh, backend=backend.name, causal=True).out
                if grad:
                    torch.autograd.grad(out, (q, k, v), dout)

            t = side_by_side({"direct": direct, "usp": ours}, iters=5, repeats=repeats)
            rows.append({"suite": "world1", "seq": seq, "mode": mode, "backend": backend.name,
                         "direct_ms": t["direct"], "usp_ms": t["usp"], "ratio": t["usp"] / t["direct"]})
            print(f"world1 S={seq} {mode} {backend.name}: direct {t['direct']:.2f} ms, usp {t['usp']:.2f} ms, "
                  f"ratio {t['usp'] / t['direct']:.3f}", flush=True)
    return rows


def _rank_fn(rank: int, ring: int, layout: str, seq: int, qkv, backend, grad: bool) -> Callable[[], object]:
    """What ring rank ``rank`` computes for its queries against every block (no communication)."""
    blocks = block_positions(seq, ring, 1, layout)
    q, k, v = qkv
    idx = [b.to("cuda") for b in blocks]
    q_r = q.index_select(1, idx[rank])
    ks = [k.index_select(1, i) for i in idx]
    vs = [v.index_select(1, i) for i in idx]
    plans = ring_plans(seq, ring, 1, layout, 1, rank)
    scale = HEAD_DIM ** -0.5
    dout = torch.randn_like(q_r)

    def run():
        merger = RowMerger(q_r)
        for j, plan in enumerate(plans):
            attend_plan(merger, q_r, ks[j], vs[j], plan, backend, scale)
        out, lse = merger.result(q_r.dtype)
        if grad:
            for j, plan in enumerate(plans):
                masked_block_grads(backend, dout, q_r, ks[j], vs[j], out, lse, scale, plan)

    return run


def suite_balance(seq: int, rings: list[int], backend_name: str, repeats: int) -> list[dict]:
    rows = []
    qkv = _qkv(seq, False)
    for grad in (False, True):
        backend = select_backend(backend_name, "cuda", torch.bfloat16, HEAD_DIM, grad, causal=True)
        for ring in rings:
            for layout in ("contiguous", "zigzag", "stripe"):
                fns = {r: _rank_fn(r, ring, layout, seq, qkv, backend, grad) for r in range(ring)}
                t = side_by_side(fns, iters=1, repeats=repeats)
                times = [t[r] for r in range(ring)]
                work = rank_work(seq, ring, 1, layout, 1)
                row = {"suite": "balance", "seq": seq, "ring": ring, "layout": layout, "backend": backend.name,
                       "mode": "fwd+bwd" if grad else "fwd", "rank_ms": times,
                       "max_over_mean": max(times) / statistics.mean(times),
                       "predicted_max_over_mean": max(work) / statistics.mean(work)}
                rows.append(row)
                print(f"balance S={seq} N={ring} {layout:10s} {row['mode']:7s} {backend.name}: "
                      f"max/mean {row['max_over_mean']:.3f} (index maths {row['predicted_max_over_mean']:.3f}); "
                      f"ranks {', '.join(f'{x:.1f}' for x in times)} ms", flush=True)
                del fns
                torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="all", choices=["all", "world1", "balance"])
    p.add_argument("--backend", default="auto")
    p.add_argument("--seqs", default="8192,32768", help="world1 sequence lengths")
    p.add_argument("--seq", type=int, default=131072, help="balance: the whole sequence")
    p.add_argument("--rings", default="4,8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_causal needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    rows = []
    if args.suite in ("all", "world1"):
        rows += suite_world1([int(s) for s in args.seqs.split(",")], args.backend, args.repeats)
    if args.suite in ("all", "balance"):
        rows += suite_balance(args.seq, [int(r) for r in args.rings.split(",")], args.backend, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
