"""The FP8 step recipe on one GPU (issue 32, item 3): one transformer forward (a denoising step's
call) of stock bf16 Diffusers against FP8 attention, FP8 linears, and both, with each one's
model-level error against the bf16 step.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fi/*.whl .whl/diff/*.whl .whl/tao/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_fp8_step.py --model wan --json $OUT/fp8_step_wan.json

Layout: the models' own (``benchmarks/pipeline_cases.py``: full-size transformers at the released
configs, random weights, bf16, batch 1, world size 1).

Variants, timed on one model in this order (the linears are quantized in place, so it is last):

- ``stock``: Diffusers as shipped (its SDPA call, PyTorch's kernel choice);
- ``fp8-attn``: ``enable_usp(model, backend=--backend)`` (default ``fp8_flashinfer``);
- ``fp8-attn+linear``: the recipe, ``usp_dit.quantize_fp8_linears(model)`` (torchao float8, per-row
  weight and per-token activation scales, the blocks' projections and MLPs) under the same backend;
- ``fp8-linear``: the quantized linears with usp_dit's bf16 ``auto`` attention.

With ``--compile`` the blocks of the enabled model are ``torch.compile``d for the FP8 variants
(stock stays Diffusers' eager call), and ``fp8-linear`` is skipped; ``--recipe-only`` skips
``fp8-attn`` and ``fp8-linear`` too (the blocks then compile once, for the recipe).

Each variant: ``--warmup`` untimed forwards, then the median of ``--rounds`` rounds of ``--iters``
forwards between CUDA events (ms per forward). Error of each variant's output against ``stock``'s:
cosine similarity and relative L1 (sum |got - ref| / sum |ref|) in float64. Random weights make
the activations less heavy-tailed than a trained model's, so read the errors as indicative
(docs/FP8.md says what was measured and what a user can rely on).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_pipelines  # this folder, put on sys.path above
import fp8_step_error

import usp_dit


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """``fp8_step_error.errors`` (cosine, relative L1 in float64), rounded for the JSON."""
    e = fp8_step_error.errors(got, ref)
    # NaN or inf anywhere makes both figures NaN: count them, in the output and in the reference,
    # so a NaN says which side overflowed
    return {"cosine": round(e["cosine"], 6), "rel_l1": round(e["rel_l1"], 5),
            "nonfinite": int((~torch.isfinite(got)).sum()), "ref_nonfinite": int((~torch.isfinite(ref)).sum())}


def timed(forward, args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    """(median ms per forward, the last output)."""
    for _ in range(args.warmup):
        out = forward()
    torch.cuda.synchronize()
    samples = [bench_pipelines.time_round(forward, args.iters) for _ in range(args.rounds)]
    return statistics.median(samples), out


def compile_blocks(model: torch.nn.Module) -> None:
    """``torch.compile`` each block of the family's plan (graph breaks allowed): torchao's per-token
    activation quantization and usp_dit's Q/K/V quantization then fuse into the kernels around
    them instead of running as separate eager passes."""
    from usp_dit.pipelines.base import find_adapter

    for list_name in find_adapter(model).plan.block_lists:
        for block in getattr(model, list_name):
            block.compile()


def run(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    start = time.perf_counter()
    kwargs = {"frames": args.frames} if args.frames else {}
    model, inputs, shape = bench_pipelines.CASES[name](device, **kwargs)
    print(f"# {name} {shape}: built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    def forward() -> torch.Tensor:
        return model(**inputs)[0]

    ms, outs = {}, {}

    def variant(label: str) -> None:
        with torch.inference_mode():
            ms[label], outs[label] = timed(forward, args)
        print(f"# {name} {label}: {ms[label]:.1f} ms", file=sys.stderr, flush=True)

    variant("stock")
    usp_dit.enable_usp(model, backend=args.backend)
    if args.compile:
        compile_blocks(model)
    if not args.recipe_only:
        variant("fp8-attn")
    with torch.no_grad():  # outside inference mode: the quantized weights are ordinary parameters
        quantized = usp_dit.quantize_fp8_linears(model)
    variant("fp8-attn+linear")
    usp_dit.disable_usp(model)
    if not args.compile and not args.recipe_only:  # compiled, the recipe's parts are the two rows above
        usp_dit.enable_usp(model)
        variant("fp8-linear")
        usp_dit.disable_usp(model)
    ref = outs["stock"]
    result = {"shape": shape, "backend": args.backend, "compiled_blocks": args.compile, "quantized_linears": len(quantized),
              "ms": {k: round(v, 1) for k, v in ms.items()},
              "speedup": {k: round(ms["stock"] / v, 3) for k, v in ms.items() if k != "stock"},
              "error_vs_stock": {k: errors(v, ref) for k, v in outs.items() if k != "stock"}}
    return result  # the model and its outputs go with this frame; main() empties the cache


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wan", help="comma-separated cases of bench_pipelines (wan, hunyuan_video, flux)")
    p.add_argument("--backend", default="fp8_flashinfer")
    p.add_argument("--frames", type=int, default=None, help="video frames (default: the case's, 720p full length)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the blocks for the FP8 variants (stock stays eager)")
    p.add_argument("--recipe-only", action="store_true",
                   help="time stock and fp8-attn+linear alone (one compile of the blocks: what fits one call "
                        "at HunyuanVideo 720p)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}; ms per forward, "
          f"median of {args.rounds} x {args.iters}", flush=True)
    results = {}
    for name in args.model.split(","):
        results[name] = r = run(name, args, device)
        print(json.dumps({name: r}), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(device), "date": time.strftime("%Y-%m-%d"),
                                               "args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
