"""torchrun demo: usp_attention on a Ulysses x Ring grid, checked against one rank.

    torchrun --standalone --nproc-per-node 4 examples/usp_attention_demo.py --ulysses 2 --ring 2

Every rank builds the same random Q/K/V (a Flux-like layout scaled down: image tokens plus joint
text tokens), keeps its shard, runs ``usp_attention`` forward and backward, gathers the result and
compares it with the same attention computed on the full sequence in one process. Rank 0 prints.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import usp_dit
from usp_dit import gather_sequence, init_usp, shard_sequence, usp_attention


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: 2 if it fits)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: world / ulysses)")
    p.add_argument("--seq", type=int, default=1021, help="image tokens (any length, prime by default)")
    p.add_argument("--joint", type=int, default=77, help="joint text tokens")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA), default = heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--backend", default="auto")
    return p.parse_args()


def degrees(args: argparse.Namespace, world: int) -> tuple[int, int]:
    ulysses = args.ulysses or (2 if world % 2 == 0 else 1)
    ring = args.ring or world // ulysses
    return ulysses, ring


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ulysses, ring = degrees(args, world)
    mesh = init_usp(ulysses_degree=ulysses, ring_degree=ring)
    dtype = getattr(torch, args.dtype)
    kv_heads = args.kv_heads or args.heads
    g = torch.Generator().manual_seed(0)  # same inputs on every rank

    def rand(s, h):
        return torch.randn(1, s, h, args.head_dim, generator=g, dtype=dtype)

    q, k, v = rand(args.seq, args.heads), rand(args.seq, kv_heads), rand(args.seq, kv_heads)
    jq, jk, jv = rand(args.joint, args.heads), rand(args.joint, kv_heads), rand(args.joint, kv_heads)
    q_l, k_l, v_l = (shard_sequence(t, mesh).clone().requires_grad_() for t in (q, k, v))
    out_l, jout = usp_attention(q_l, k_l, v_l, joint_q=jq, joint_k=jk, joint_v=jv, mesh=mesh, backend=args.backend)
    out_l.sum().backward()
    out = gather_sequence(out_l.detach(), mesh, seq_len=args.seq)

    single = usp_dit.single_rank_mesh()
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    ref, jref = usp_attention(q1, k1, v1, joint_q=jq, joint_k=jk, joint_v=jv, mesh=single, backend=args.backend)
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
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"usp_dit {usp_dit.__version__}: {mesh}, {args.seq}+{args.joint} tokens, {args.heads} heads "
              f"({kv_heads} K/V), head_dim {args.head_dim}, {args.dtype}, backend {args.backend}")
        print("rank 0 errors vs one rank (max|diff|/max|ref|): " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
        tol = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2}[args.dtype]
        verdict = "MATCH" if worst.item() <= tol else "MISMATCH"
        print(f"worst over all ranks {worst.item():.2e} (tolerance {tol:.0e}): {verdict}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
