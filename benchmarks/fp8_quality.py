"""Quality gate of the FP8 Ulysses exchange (``comm_dtype="fp8"``): attention-level error against
float64, beside bf16's own error, on realistic activations.

Layout: (batch, seq, heads, head_dim).

    python benchmarks/fp8_quality.py                       # CPU, 1024 tokens per shape (minutes)
    python benchmarks/fp8_quality.py --tokens 4096 --device cuda

For each model's attention shape (heads and head_dim of Flux.1, Wan 2.1-14B, HunyuanVideo; the
sequence cut to ``--tokens``: the error is per (token, head) row and does not grow with length)
it draws DiT-like activations: Q and K with per-channel offsets and scales and a few heavy
channels (keys of trained DiTs have both; a plain Gaussian hides what FP8 loses), V Gaussian with
per-channel scales. It then measures, against attention computed in float64 from the same
float32 inputs:

- bf16: the inputs rounded to bfloat16, attention in float32 (what a bf16 model computes);
- fp8-QVO: bf16 as above with Q, V and the output passed through the FP8 wire (what
  ``comm_dtype="fp8"`` does on a Ulysses grid: ``usp_dit.distributed.fp8_wire.roundtrip``);
- fp8-QKVO: K through the wire too (NOT what we ship: it shows why K stays in bf16).

Reported: cosine similarity and relative L1 (sum |err| / sum |ref|), and the worst row's
relative L2. Which grid runs them does not matter: each row's wire encoding depends on that row
alone (Note [fp8 wire]), so a one-process simulation is the grid's result.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from usp_dit.distributed.fp8_wire import roundtrip

SHAPES = {"flux": (24, 128), "wan14b": (40, 128), "hunyuan_video": (24, 128)}  # (heads, head_dim)


def dit_like(batch: int, seq: int, heads: int, dim: int, g: torch.Generator, heavy: bool) -> torch.Tensor:
    """(batch, seq, heads, dim) float32 activations with per-channel offsets and scales; ``heavy``:
    a few channels 10-30x the rest (as in trained DiT keys and queries)."""
    scale = torch.exp(0.5 * torch.randn(heads, dim, generator=g))
    offset = 0.5 * torch.randn(heads, dim, generator=g)
    if heavy:
        idx = torch.randint(0, dim, (heads, 3), generator=g)
        scale.scatter_(1, idx, 10 + 20 * torch.rand(heads, 3, generator=g))
    return torch.randn(batch, seq, heads, dim, generator=g) * scale + offset


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = F.scaled_dot_product_attention(*(t.to(dtype).transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    got, ref = got.double(), ref.double()
    rows = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    return {"cosine": float(F.cosine_similarity(got.flatten(), ref.flatten(), dim=0)),
            "rel_l1": float((got - ref).abs().sum() / ref.abs().sum()), "worst_row_rel_l2": float(rows.max())}


def measure(name: str, tokens: int, device: torch.device, seed: int = 0) -> dict:
    heads, dim = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    q, k = (dit_like(1, tokens, heads, dim, g, heavy=True) for _ in range(2))
    v = dit_like(1, tokens, heads, dim, g, heavy=False)
    q, k, v = (t.to(device) for t in (q, k, v))
    ref = attend(q, k, v, torch.float64)
    bf = [t.bfloat16() for t in (q, k, v)]
    compute = torch.float32 if device.type == "cpu" else torch.bfloat16  # CPU bf16 SDPA is slow; same inputs
    out = {"bf16": errors(attend(*bf, compute).bfloat16(), ref)}
    qvo = attend(roundtrip(bf[0]), bf[1], roundtrip(bf[2]), compute).bfloat16()
    out["fp8-QVO (shipped)"] = errors(roundtrip(qvo), ref)
    qkvo = attend(roundtrip(bf[0]), roundtrip(bf[1]), roundtrip(bf[2]), compute).bfloat16()
    out["fp8-QKVO (not shipped)"] = errors(roundtrip(qkvo), ref)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="sequence length per shape (default 1024)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args()
    device = torch.device(args.device)
    results = {name: measure(name, args.tokens, device, seed=i) for i, name in enumerate(SHAPES)}
    print(f"{'shape':15s} {'path':24s} {'cosine':>10s} {'rel L1':>10s} {'worst row':>10s}")
    for name, paths in results.items():
        for path, e in paths.items():
            print(f"{name:15s} {path:24s} {e['cosine']:10.6f} {e['rel_l1']:10.2e} {e['worst_row_rel_l2']:10.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "device": str(device), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
