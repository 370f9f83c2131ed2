"""Two collectives in flight on one gloo group, in a loop: the heap corruption of Note [gloo
all-gather race] (``usp_dit/distributed/gloo.py``) and its workaround, on CPU.

    PYTHONPATH=. python benchmarks/stress_gloo.py --pair gather,gather --iters 20000            # torch's two threads
    PYTHONPATH=. python benchmarks/stress_gloo.py --pair gather,gather --iters 30000 --one-thread  # usp_dit's groups

Four ranks (spawned, gloo on 127.0.0.1); each iteration posts the pair on one 4-rank group
(functional collectives of (2, 4, 2, 4) float32 blocks, as the ring's gather schedule posts K and
V), does a small matmul, then waits both. Prints the iterations done and each rank's exit code: a
negative code is the signal that killed it (-6 abort: "malloc(): unaligned tcache chunk
detected"; -11 SIGSEGV; None: still running at ``--seconds``, a stall). ``--pair``: two of gather,
a2a, reduce.
"""
from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

from usp_dit.testing.pool import free_port

WORLD = 4


def _post(kind: str, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if kind == "gather":
        return funcol.all_gather_tensor(x, 0, group)
    if kind == "a2a":
        return funcol.all_to_all_single(x.reshape(-1), None, None, group)
    if kind == "reduce":
        return funcol.all_reduce(x, "sum", group)
    raise ValueError(f"--pair: {kind!r} is not one of gather, a2a, reduce")


def _rank(rank: int, port: int, pair: list[str], iters: int, one_thread: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if one_thread:
        from usp_dit.distributed.gloo import serialize_gloo_groups

        serialize_gloo_groups()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(list(range(WORLD)))
    start = time.time()
    for i in range(iters):
        pending = [_post(kind, torch.randn(2, 4, 2, 4), group) for kind in pair]
        torch.randn(16, 16) @ torch.randn(16, 16)  # the compute the transfers overlap
        for p in pending:
            funcol.wait_tensor(p)
        if rank == 0 and i % 2000 == 0:
            print(f"iteration {i}: {time.time() - start:.1f} s", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"done: {iters} iterations in {time.time() - start:.1f} s", flush=True)
    os._exit(0)  # skip teardown with live groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="gather,gather", help="two of gather, a2a, reduce (default gather,gather)")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--one-thread", action="store_true", help="usp_dit's serialize_gloo_groups() first")
    parser.add_argument("--seconds", type=float, default=300.0, help="stop (and say so) after this long")
    args = parser.parse_args()
    pair = args.pair.split(",")
    if len(pair) != 2:
        raise ValueError(f"--pair: {args.pair!r} must name two collectives, e.g. gather,a2a")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, pair, args.iters, args.one_thread)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.seconds
    # A rank that dies leaves its peers waiting for it (up to the group's timeout), and the race can
    # also stall a collective: stop at the first death or at the deadline.
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    codes = [p.exitcode for p in procs]  # None: still running (stalled, or cut by --seconds)
    for p in procs:
        p.kill()
    verdict = "clean" if codes == [0] * WORLD else "FAILED (negative: killed by that signal; None: stalled)"
    print(f"pair {args.pair}, one thread: {args.one_thread}; exit codes {codes}: {verdict}")


if __name__ == "__main__":
    main()
