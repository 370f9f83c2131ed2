"""What sharded weights cost on one GPU: ``enable_usp(..., shard_weights=True)`` at world size 1, and
FSDP2's own machinery forced onto a one-rank mesh, against stock Diffusers, side by side.

    PYTHONPATH=. python3 benchmarks/bench_shard_weights.py --model flux,flux2

Layout: as ``bench_pipelines.py`` (full-size transformers at the released configs, random weights,
bf16, batch 1, one denoising step's inputs, ``torch.no_grad``: FSDP2 cannot run under
``inference_mode``, whose tensors keep no version counter).

Variants, timed interleaved in rounds (median of ``--rounds``, ms per transformer forward):
  stock    Diffusers as it ships;
  sharded  ``usp_dit.enable_usp(model, shard_weights=True)`` on a world of one rank: the replica is
           one rank, so nothing is sharded (``usp_dit.pipelines.weights.shard_weights`` returns
           ``None``) and the model runs as ``enable_usp`` alone. Issue 28's goal: <= 1.01x stock;
  fsdp1    the plan's FSDP2 units (every block, the outer modules, the root: what P ranks would
           shard) put through ``fully_shard`` on a one-rank DeviceMesh anyway, as
           ``shard_weights`` does on P ranks. Each unit's "all-gather" is then a copy of its
           parameters into a fresh buffer and the free after it: the HBM traffic and hook cost
           that a P-rank run pays besides the link. Not a mode users run; it prices the machinery.

Then a projection (labelled): per-rank all-gather bytes per step at P = 2, 4, 8 (each rank receives
(P - 1) / P of the transformer's bytes) and the time that takes at NVLink's datasheet all-gather bus
rate, beside the compute it must hide behind (the stock step / P, perfect scaling assumed).
Exits non-zero without CUDA or on any error.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

try:
    import bench_pipelines  # run as benchmarks/bench_shard_weights.py: this folder is on sys.path
except ImportError:
    from benchmarks import bench_pipelines

NVLINK_ALLGATHER_GBPS = 360.0  # H100/H200 SXM NVLink 4, all-gather bus bandwidth (datasheet-derived; planner's figure)
VARIANTS = ("stock", "sharded", "fsdp1")  # --variants picks which run (stock first)


def set_variant(model: torch.nn.Module, variant: str, state: dict) -> None:
    """Switch ``model`` to ``variant`` (undoing the previous one exactly)."""
    import usp_dit
    from usp_dit.pipelines import weights

    if state.get("record") is not None:
        weights.unshard_weights(model, state.pop("record"))
    usp_dit.disable_usp(model)
    if variant == "sharded":
        usp_dit.enable_usp(model, shard_weights=True)
    elif variant == "fsdp1":
        from torch.distributed.device_mesh import init_device_mesh

        usp_dit.enable_usp(model)
        from usp_dit.pipelines.base import find_adapter

        plan = find_adapter(model).plan
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("replica",))
        record = weights.ShardedWeights()
        blocks = weights.blocks_in_order(model, plan.block_lists)
        units = [*blocks, *weights.outer_modules(model, plan.block_lists), model]
        weights.shard_units(record, units, mesh)
        for current, following in zip([model, *blocks], blocks):
            current.set_modules_to_forward_prefetch([following])
        state["record"] = record


def bench(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    variants = args.variants
    model, inputs, shape = bench_pipelines.CASES[name](device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state: dict = {}
    samples = {v: [] for v in variants}
    outputs = {}
    with torch.no_grad():  # not inference_mode: FSDP2's unshard reads tensor version counters
        for variant in variants:
            set_variant(model, variant, state)
            for _ in range(args.warmup):
                outputs[variant] = model(**inputs)[0].float()
            torch.cuda.synchronize()
        for _ in range(args.rounds):
            for variant in variants:
                set_variant(model, variant, state)
                samples[variant].append(bench_pipelines.time_round(lambda: model(**inputs), args.iters))
        set_variant(model, "stock", state)
    ms = {v: statistics.median(s) for v, s in samples.items()}
    ref = outputs["stock"]
    diff = {v: ((outputs[v] - ref).abs().max() / ref.abs().max()).item() for v in variants[1:]}
    del model, inputs, outputs
    torch.cuda.empty_cache()
    return dict(name=name, shape=shape, gib=weight_bytes / 2**30, bytes=weight_bytes, ms=ms, diff=diff)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux,flux2", help=f"comma-separated: {', '.join(bench_pipelines.CASES)}")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, stock first: {VARIANTS}")
    args = p.parse_args()
    args.variants = tuple(args.variants.split(","))
    if args.variants[0] != "stock" or not set(args.variants) <= set(VARIANTS):
        print(f"--variants: stock first, then any of {VARIANTS[1:]}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_shard_weights.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}; bf16, batch 1, world size 1; "
          f"ms per forward, median of {args.rounds} rounds x {args.iters}, variants interleaved")
    print("| model | shape | weights GiB | stock ms | shard_weights=True ms (x stock) | FSDP2 on 1 rank ms (x stock) "
          "| max rel diff sharded / fsdp1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for name in args.model.split(","):
        r = bench(name, args, device)
        rows.append(r)
        ms = r["ms"]
        cells = [f"{ms[v]:.1f} ({ms[v] / ms['stock']:.3f})" if v in ms else "-" for v in VARIANTS[1:]]
        diffs = " / ".join(f"{r['diff'][v]:.1e}" if v in r["diff"] else "-" for v in VARIANTS[1:])
        print(f"| {name} | {r['shape']} | {r['gib']:.1f} | {ms['stock']:.1f} | {' | '.join(cells)} | {diffs} |",
              flush=True)
    print(f"\n# PROJECTION (not measured on several GPUs): per-rank weight all-gather per step at "
          f"{NVLINK_ALLGATHER_GBPS:.0f} GB/s vs the stock step / P")
    print("| model | P | all-gather GB per rank per step | link ms | compute ms (stock / P) | hidden? |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        for world in (2, 4, 8):
            gb = r["bytes"] * (world - 1) / world / 1e9
            link = gb / NVLINK_ALLGATHER_GBPS * 1e3
            compute = r["ms"]["stock"] / world
            print(f"| {r['name']} | {world} | {gb:.1f} | {link:.0f} | {compute:.0f} | "
                  f"{'yes' if link <= compute else f'no: {link / compute:.1f}x the compute'} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
