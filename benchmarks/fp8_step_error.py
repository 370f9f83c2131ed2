"""Model-level error of the FP8 Ulysses exchange (``comm_dtype="fp8"``): one denoising step of
Flux.1-dev, Wan 2.1-14B and HunyuanVideo at their released configs (random weights), on one GPU.

Layout: (batch, seq, heads, head_dim) inside attention; the models' own layouts outside.

    python benchmarks/fp8_step_error.py --cases flux,wan,hunyuan_video --json out.json   # GPU

Why one GPU gives the grid's answer: the FP8 wire encodes each (token, head) row of Q, V and the
output by itself (Note [fp8 wire]), so what a Ulysses grid of any size computes is what one
process computes with those rows passed through ``fp8_wire.roundtrip``; the joint (text) tokens,
K and the cross-attention keep bf16 on a grid, and here too. This script runs the model enabled at
world size 1 three ways, by wrapping usp_dit's one-rank attention path:

- ``bf16``: as shipped (the step a bf16 grid computes, up to the order of sums);
- ``fp32-attn``: Q, K, V upcast to float32 for the attention (the reference: what attention
  would give without bf16's rounding of its inputs and output);
- ``fp8``: Q, V and the output through the FP8 wire, the kernel as in ``bf16``.

and prints each output's cosine similarity and relative L1 against ``fp32-attn``, so FP8's error
stands beside bf16's own. Sizes default to a reduced video length so each case runs in about a
minute on an H100 (``--frames`` to change).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import usp_dit.attention.usp as usp_core
from usp_dit import disable_usp, enable_usp
from usp_dit.distributed.fp8_wire import roundtrip
from usp_dit.kernels import select_backend


@contextlib.contextmanager
def attention_mode(mode: str):
    """Wrap the one-rank attention path (``usp_dit.attention.usp._single_rank``) for ``mode``."""
    original = usp_core._single_rank

    def fp8(q, k, v, joint, kernel, scale, frame=None, joint_mask=None):
        main, joint_res = original(roundtrip(q), k, roundtrip(v), joint, kernel, scale, frame, joint_mask)
        return (roundtrip(main[0]), main[1]), joint_res

    def fp32(q, k, v, joint, kernel, scale, frame=None, joint_mask=None):
        up = [t.float() for t in (q, k, v)]
        joint32 = None if joint is None else tuple(t.float() for t in joint)
        k32 = select_backend("auto", q.device.type, torch.float32, q.shape[-1], False, None)
        main, joint_res = original(*up, joint32, k32, scale, frame, joint_mask)
        main = (main[0].to(q.dtype), main[1])
        if joint_res is not None:
            joint_res = (joint_res[0].to(q.dtype), joint_res[1])
        return main, joint_res

    usp_core._single_rank = {"bf16": original, "fp8": fp8, "fp32-attn": fp32}[mode]
    try:
        yield
    finally:
        usp_core._single_rank = original


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    got, ref = got.double().flatten(), ref.double().flatten()
    return {"cosine": float(F.cosine_similarity(got, ref, dim=0)),
            "rel_l1": float((got - ref).abs().sum() / ref.abs().sum())}


def run_case(name: str, device: torch.device, frames: int | None) -> dict:
    import bench_pipelines

    case = bench_pipelines.CASES[name]
    kwargs = {} if frames is None or name == "flux" else {"frames": frames}
    model, inputs, shape = case(device, **kwargs)
    enable_usp(model)
    outs, seconds = {}, {}
    with torch.no_grad():
        for mode in ("fp32-attn", "bf16", "fp8"):
            start = time.perf_counter()
            with attention_mode(mode):
                outs[mode] = model(**inputs)[0].float().cpu()  # .cpu() waits for the GPU
            seconds[mode] = round(time.perf_counter() - start, 2)
    disable_usp(model)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ref = outs["fp32-attn"]
    return {"shape": shape, "seconds": seconds,
            "bf16_vs_fp32attn": errors(outs["bf16"], ref), "fp8_vs_fp32attn": errors(outs["fp8"], ref),
            "fp8_vs_bf16": errors(outs["fp8"], outs["bf16"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="flux,wan,hunyuan_video")
    p.add_argument("--frames", type=int, default=33, help="video frames (default 33: ~1 min a case on an H100)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    results = {}
    for name in args.cases.split(","):
        results[name] = run_case(name, device, args.frames)
        r = results[name]
        print(f"{name} {r['shape']}: bf16 {r['bf16_vs_fp32attn']} | fp8 {r['fp8_vs_fp32attn']} | "
              f"fp8 vs bf16 {r['fp8_vs_bf16']} | s {r['seconds']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
