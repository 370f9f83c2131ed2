"""A float64 model of what the ``fp8_cudnn`` backend's quantisation alone does to attention, at
growing key lengths (CPU, no cuDNN): does our rounding explain the error growth measured on the GPU
(Note [fp8 attention, cuDNN, long calls])?

The model: Q, K, V in e4m3 with one scale per tensor (``fp8_quant.tensor_quant``), scores and
softmax in float64 with the row max subtracted, P multiplied by 448 and rounded to e4m3 for P.V,
the row sum from the unrounded P, the output rounded to e4m3 in units of 9/8 of V's step (as the
backend asks cuDNN to write it). Everything else (the tensor cores' sums) is exact. Inputs: the GPU
tests' DiT-like distribution (``usp_dit.testing.activations.dit_like_qkv``), 2 heads of 128, the
first 256 queries against all keys. Prints cosine and relative L1 against exact float64 attention.

    PYTHONPATH=. python3 benchmarks/model_fp8_cudnn.py --lengths 3001,30001,118877
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from usp_dit.kernels.fp8_cudnn import HEADROOM
from usp_dit.kernels.fp8_quant import E4M3_MAX, tensor_quant
from usp_dit.testing.activations import dit_like_qkv


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()


def model(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, S, H, D) inputs -> the modelled output (B, S, H, D) float64."""
    (q8, sq), (k8, sk), (v8, sv) = tensor_quant(q), tensor_quant(k), tensor_quant(v)
    qd, kd, vd = q8.double() * sq.double(), k8.double() * sk.double(), v8.double() * sv.double()
    s = torch.einsum("bihd,bjhd->bhij", qd, kd) * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    out = (e4m3(p * E4M3_MAX) / E4M3_MAX) @ vd.transpose(1, 2) / p.sum(-1, keepdim=True)
    step = sv.double() * HEADROOM
    return (e4m3(out / step) * step).transpose(1, 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="3001,30001,118877")
    args = p.parse_args()
    print("| keys | cosine | rel L1 |\n|---|---|---|")
    for n in map(int, args.lengths.split(",")):
        q, k, v = dit_like_qkv(1, n, 2, 2, 128, device="cpu")
        q = q[:, :256]
        scale = 128 ** -0.5
        exact = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), scale=scale)
        got, ref = model(q, k, v, scale).flatten(), exact.transpose(1, 2).flatten()
        cos = F.cosine_similarity(got, ref, dim=0).item()
        l1 = ((got - ref).abs().sum() / ref.abs().sum()).item()
        print(f"| {n} | {cos:.6f} | {l1:.3e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
