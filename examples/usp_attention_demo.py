"""torchrun demo: usp_attention on a Ulysses x Ring grid, checked against one rank.

    torchrun --standalone --nproc-per-node 4 examples/usp_attention_demo.py --ulysses 2 --ring 2

Every rank builds the same random Q/K/V (a Flux-like layout scaled down: image tokens plus joint
text tokens), keeps its shard, runs ``usp_attention`` forward and backward, gathers the result and
compares it with the same attention computed on the full sequence in one process. Rank 0 prints.
Without torchrun it runs on one rank. A bad value is reported on one line by rank 0 and every rank
exits with code 2; Ctrl-C exits with 130 (``usp_dit.cli.launch``).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import usp_dit
from usp_dit import gather_sequence, init_usp, launch, shard_sequence, usp_attention


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``check_args``); a bad value raises ``launch.UsageError``."""
    p = launch.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: 2 if it fits)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: world / ulysses)")
    p.add_argument("--seq", type=int, default=1021, help="image tokens (any length, prime by default)")
    p.add_argument("--joint", type=int, default=77, help="joint text tokens")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA), default = heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--backend", default="auto")
    args = p.parse_args(argv)
    check_args(args, launch.env_world_size())
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Raise ``launch.UsageError`` for a value that would fail later; fills ``args.degrees``."""
    for flag, value in (("--seq", args.seq), ("--heads", args.heads), ("--head-dim", args.head_dim)):
        launch.check_at_least(flag, value, 1)
    launch.check_at_least("--joint", args.joint, 1)
    kv_heads = args.kv_heads or args.heads
    if kv_heads < 1 or args.heads % kv_heads:
        raise launch.UsageError(f"--kv-heads {kv_heads} must divide --heads {args.heads} (GQA)")
    launch.check_backend("--backend", args.backend)
    args.degrees = launch.check_degrees(world, args.ulysses, args.ring)[:2]


@record  # torchrun's error file for any other exception
@launch.cli_main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    launch.note_single_rank()
    rank, world, _ = launch.init_distributed()
    ulysses, ring = args.degrees
    mesh = init_usp(ulysses_degree=ulysses, ring_degree=ring)
    dtype = getattr(torch, args.dtype)
    kv_heads = args.kv_heads or args.heads
    g = torch.Generator().manual_seed(0)  # same inputs on every rank

    def rand(s, h):
        return torch.randn(1, s, h, args.head_dim, generator=g, dtype=dtype)

    q, k, v = rand(args.seq, args.heads), rand(args.seq, kv_heads), rand(args.seq, kv_heads)
    jq, jk, jv = rand(args.joint, args.heads), rand(args.joint, kv_heads), rand(args.joint, kv_heads)
    q_l, k_l, v_l = (shard_sequence(t, mesh).clone().requires_grad_() for t in (q, k, v))
    out_l, jout, _, _ = usp_attention(q_l, k_l, v_l, joint_q=jq, joint_k=jk, joint_v=jv, mesh=mesh, backend=args.backend)
    out_l.sum().backward()
    out = gather_sequence(out_l.detach(), mesh, seq_len=args.seq)

    single = usp_dit.single_rank_mesh()
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    ref, jref, _, _ = usp_attention(q1, k1, v1, joint_q=jq, joint_k=jk, joint_v=jv, mesh=single, backend=args.backend)
    # The ranks' losses (each the sum of its shard's output) add up to this one-rank loss.
    ref.sum().backward()

    def err(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    errors = {
        "out": err(out, ref.detach()),
        "joint_out": err(jout, jref.detach()),
        "dq_shard": err(q_l.grad, shard_sequence(q1.grad, mesh)),
    }
    worst = torch.tensor(max(errors.values()))
    if dist.is_initialized():
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"usp_dit {usp_dit.__version__}: {mesh}, {args.seq}+{args.joint} tokens, {args.heads} heads "
              f"({kv_heads} K/V), head_dim {args.head_dim}, {args.dtype}, backend {args.backend}")
        print("rank 0 errors vs one rank (max|diff|/max|ref|): " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        tol = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2}[args.dtype]
        verdict = "MATCH" if worst.item() <= tol else "MISMATCH"
        print(f"worst over all ranks {worst.item():.2e} (tolerance {tol:.0e}): {verdict}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
