"""What the cross-rank call handshake costs (Note [call handshake] in usp_dit.distributed.handshake).

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_handshake.py
    torchrun --nproc-per-node 8 benchmarks/bench_handshake.py --device cuda --seq 4608 --heads 24 --head-dim 128

Times, per call, interleaved over rounds (median):
  * ``sizes``: the one-int64 all-gather of shard lengths that every unverified call ran before;
  * ``agree``: the handshake that replaces it (hashing the fields + a 3-int64 all-gather);
  * ``usp checked``: a whole ``usp_attention`` call with the handshake (seq_len given, outside a
    verified scope);
  * ``usp verified``: the same call inside ``verified_calls(mesh)``, as an enabled model runs it
    (no handshake at all).
Rank 0 prints one table row per measurement and the ratios checked/verified and agree/sizes.
At world size 1 no handshake runs (there is no other rank to disagree with).

Layout: q, k, v (batch, seq_local, heads, head_dim).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import usp_dit
from usp_dit.distributed.comm import start_all_gather
from usp_dit.distributed.handshake import agree, verified_calls


def _timed(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq", type=int, default=257)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    mesh = usp_dit.init_usp(ulysses_degree=int(os.environ.get("WORLD_SIZE", "1")))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    full = [torch.randn(1, args.seq, args.heads, args.head_dim, generator=g).to(device, dtype) for _ in range(3)]
    q, k, v = (usp_dit.shard_sequence(t, mesh) for t in full)
    fields = {"dtype": dtype, "batch": 1, "heads": args.heads, "kv_heads": args.heads, "head_dim": args.head_dim}
    one = torch.tensor([q.shape[1]], dtype=torch.int64, device=device)

    def verified():
        with verified_calls(mesh):
            usp_dit.usp_attention(q, k, v, mesh=mesh, seq_len=args.seq)

    if mesh.sequence_degree == 1:
        raise SystemExit("run under torchrun with 2 or more ranks: at world size 1 no handshake runs")
    cases = {
        "sizes": lambda: funcol.wait_tensor(start_all_gather(one, mesh.seq_group)).tolist(),
        "agree": lambda: agree(fields, mesh.seq_group, device, varying=q.shape[1]),
        "usp checked": lambda: usp_dit.usp_attention(q, k, v, mesh=mesh, seq_len=args.seq),
        "usp verified": verified,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        _timed(fn, 5, device)  # warm-up
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(_timed(fn, args.iters, device))
    med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()}, {device.type}, seq {args.seq}, heads {args.heads}, "
              f"head_dim {args.head_dim}, {args.rounds} rounds x {args.iters} calls, median us per call")
        for name, us in med.items():
            print(f"| {name} | {us:.1f} |")
        print(f"agree / sizes = {med['agree'] / med['sizes']:.3f}; "
              f"usp checked / usp verified = {med['usp checked'] / med['usp verified']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
