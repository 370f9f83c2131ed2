"""Several GPUs: ``usp_attention`` on every (U, R) grid against one GPU, forward and backward (issue 6).

    torchrun --nproc-per-node 4 benchmarks/bench_parity.py --json parity_p4.json
    torchrun --nproc-per-node 8 benchmarks/bench_parity.py --shapes mochi --dtypes bfloat16
    torchrun --nproc-per-node 2 benchmarks/bench_parity.py --tiny       # CPU / gloo: the CI smoke run

Every rank makes the same seeded full q, k, v (image/video tokens) and joint q, k, v (text tokens)
at the attention shapes of shared/shapes.md, and computes the one-GPU result itself: the same
backend on the whole sequence (forward, then backward of a seeded output gradient). Then, for every
(U, R) with U * R = world size and both ring schedules where R > 1, each rank runs
``usp_attention`` on its shard and compares its output, LSE and q/k/v gradients with its slice of the
one-GPU result, and the joint output and (all-reduced) joint gradients with the whole one.

Error = max|x - x_1| / max|x_1|, worst rank. Bounds: 2e-2 in bf16/fp16 (8 mantissa bits: shorter
kernel calls, merges and float32 gradient sums move results by a few bf16 ulps), 1e-4 in float32,
1e-10 in float64. A float64 reference at these sizes would not fit the time; the GPU kernel tests
(tests/gpu) hold each kernel to float64 on smaller shapes. The run exits 1 on a miss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _val)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_scaling import parse_grids, worst  # noqa: E402

SHAPES = {  # name: (image/video tokens, text tokens, heads, kv heads, head_dim), shared/shapes.md
    "flux": (4096, 512, 24, 24, 128),
    "cogvideox": (17550, 226, 48, 48, 64),
    "mochi": (44520, 256, 24, 24, 128),
}
TINY_SHAPES = {"tiny": (37, 7, 8, 8, 32), "tiny-gqa": (29, 5, 6, 2, 16)}
BOUND = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4, torch.float64: 1e-10}


def make_case(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Seeded full tensors, identical on every rank: q/k/v, joint jq/jk/jv, and output gradients."""
    s, t, h, hk, d = shape
    g = torch.Generator(device).manual_seed(0)
    make = lambda n, heads: torch.randn(1, n, heads, d, generator=g, device=device).to(dtype)  # noqa: E731
    return {"q": make(s, h), "k": make(s, hk), "v": make(s, hk), "jq": make(t, h), "jk": make(t, hk),
            "jv": make(t, hk), "g_out": make(s, h), "g_joint": make(t, h)}


def run(x: dict[str, torch.Tensor], mesh, backend: str) -> dict[str, torch.Tensor]:
    """Forward and backward of ``usp_attention`` on this rank's shard (whole sequence at one rank)."""
    from usp_dit import shard_sequence, usp_attention

    p = mesh.sequence_degree
    leaves = {n: shard_sequence(x[n], mesh).detach().clone().requires_grad_() for n in ("q", "k", "v")}
    leaves.update({n: x[n].detach().clone().requires_grad_() for n in ("jq", "jk", "jv")})
    out, jout, lse, jlse = usp_attention(
        leaves["q"], leaves["k"], leaves["v"], joint_q=leaves["jq"], joint_k=leaves["jk"], joint_v=leaves["jv"],
        mesh=mesh, backend=backend, return_lse=True,
    )
    # Every rank reads joint_out: their losses sum to the one-rank loss.
    loss = (out.float() * shard_sequence(x["g_out"], mesh).float()).sum() + (jout.float() * x["g_joint"].float()).sum() / p
    loss.backward()
    res = {"out": out.detach(), "lse": lse.detach(), "joint_out": jout.detach(), "joint_lse": jlse.detach()}
    for n, t in leaves.items():
        g = t.grad.contiguous()
        if n.startswith("j") and mesh.seq_group is not None:
            dist.all_reduce(g, group=mesh.seq_group)  # per-rank partials sum to the full gradient
        res[f"d{n}"] = g
    return res


def errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], mesh) -> dict[str, float]:
    """Worst-rank error of every quantity; sharded ones against this rank's slice of the reference."""
    from usp_dit import shard_sequence

    out = {}
    for key, value in got.items():
        r = ref[key] if key.startswith(("joint", "dj")) else shard_sequence(ref[key], mesh)
        err = ((value.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-300)).item()
        out[key] = worst(err)
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help=f"comma list of {sorted(SHAPES)} (default: all; tiny ones with --tiny)")
    p.add_argument("--dtypes", default=None, help="comma list (default bfloat16,float32; float32,float64 with --tiny)")
    p.add_argument("--grids", default=None, help="UxR list (default: every split of the world)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--tiny", action="store_true", help="small shapes on CPU ranks (a smoke run of this script)")
    p.add_argument("--json", default=None, help="rank 0 writes the rows here")
    return p.parse_args()


def main() -> int:
    from usp_dit import init_usp, single_rank_mesh
    from usp_dit.cli.launch import init_distributed

    args = parse_args()
    rank, world, device = init_distributed()
    table = TINY_SHAPES if args.tiny else SHAPES
    shapes = args.shapes.split(",") if args.shapes else list(table)
    dtypes = [getattr(torch, n) for n in (args.dtypes or ("float32,float64" if args.tiny else "bfloat16,float32")).split(",")]
    if rank == 0:
        print("| shape | dtype | UxR | schedule | out | lse | dq | dk | dv | joint out | djq | djk | djv | verdict |")
        print("|---" * 14 + "|", flush=True)
    rows, meshes = [], {}
    for name in shapes:
        for dtype in dtypes:
            x = make_case(table[name], dtype, device)
            ref = run(x, single_rank_mesh(device.type), args.backend)
            for u, r in parse_grids(args.grids, world):
                for schedule in (("stream", "gather_merge", "gather_one_call") if r > 1 else ("auto",)):
                    key = (u, r, schedule)  # process groups are built once per grid
                    if key not in meshes:
                        meshes[key] = init_usp(ulysses_degree=u, ring_degree=r, ring_schedule=schedule)
                    mesh = meshes[key]
                    err = errors(run(x, mesh, args.backend), ref, mesh)
                    ok = max(err.values()) <= BOUND[dtype]
                    rows.append(dict(shape=name, dtype=str(dtype), ulysses=u, ring=r, schedule=schedule, ok=ok, **err))
                    if rank == 0:
                        cols = ("out", "lse", "dq", "dk", "dv", "joint_out", "djq", "djk", "djv")
                        print(f"| {name} | {str(dtype).removeprefix('torch.')} | {u}x{r} | {schedule} | "
                              + " | ".join(f"{err[c]:.1e}" for c in cols) + f" | {'ok' if ok else 'MISS'} |", flush=True)
    bad = [r for r in rows if not r["ok"]]
    if rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        print(f"parity: {'MISMATCH' if bad else 'MATCH'} ({len(rows) - len(bad)}/{len(rows)} cases within bounds)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # a failure is a traceback and a non-zero status
        traceback.print_exc()
        code = 1
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
