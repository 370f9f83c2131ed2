"""Where a non-finite value first appears in one forward, stock bf16 vs the FP8 step recipe (GPU).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/diag_fp8_nonfinite.py --model hunyuan_video --backend fp8_fa3 --compile

Why: ``bench_fp8_step.py`` reported a NaN error for the recipe at HunyuanVideo 129x720x1280
(compiled blocks) while 33 frames gave finite outputs. This runs one stock forward and one recipe
forward (``enable_usp(backend=...)`` + ``quantize_fp8_linears``, blocks compiled with ``--compile``)
with a forward hook on every block of the plan that records its first output's count of
non-finite values and its largest finite magnitude, and prints the blocks in order, so the first
block that overflows (and whether stock overflows too) can be read off.

Layout: the models' own (``benchmarks/pipeline_cases.py``: released configs, random weights, bf16).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_pipelines  # this folder, put on sys.path above

import usp_dit
from usp_dit.pipelines.base import find_adapter


def blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) of every block list of the family's plan, in list order."""
    return [(f"{name}.{i}", b) for name in find_adapter(model).plan.block_lists
            for i, b in enumerate(getattr(model, name))]


def record(module: torch.nn.Module, args, out) -> None:
    """Forward hook: stores the output's non-finite count and finite amax on the module (tensors, so
    a compiled block keeps them without a host sync)."""
    t = out[0] if isinstance(out, (tuple, list)) else out
    finite = torch.isfinite(t)
    module._diag = ((~finite).sum(), torch.where(finite, t, 0).abs().amax().float())


def report(label: str, model: torch.nn.Module, out: torch.Tensor) -> dict:
    rows = []
    for name, b in blocks(model):
        nf, amax = b._diag
        rows.append({"block": name, "nonfinite": int(nf), "amax": float(amax)})
    first = next((r["block"] for r in rows if r["nonfinite"]), None)
    bad = ~torch.isfinite(out)
    result = {"output_nonfinite": int(bad.sum()), "output_numel": out.numel(), "first_bad_block": first,
              "amax_by_block": [round(r["amax"], 1) for r in rows]}
    print(f"# {label}: {json.dumps(result)}", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="hunyuan_video")
    p.add_argument("--backend", default="fp8_fa3")
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    kwargs = {"frames": args.frames} if args.frames else {}
    model, inputs, shape = bench_pipelines.CASES[args.model](device, **kwargs)
    print(f"# {args.model} {shape}", flush=True)
    for _, b in blocks(model):  # before compile, so the hook is traced into each compiled block
        b.register_forward_hook(record)
    results = {"shape": shape}
    with torch.inference_mode():
        results["stock"] = report("stock", model, model(**inputs)[0])
    usp_dit.enable_usp(model, backend=args.backend)
    if args.compile:
        for _, b in blocks(model):
            b.compile()
    with torch.no_grad():
        usp_dit.quantize_fp8_linears(model)
    with torch.inference_mode():
        results["recipe"] = report("recipe", model, model(**inputs)[0])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
