"""Compile FlashInfer's prefill kernel for one (dtype, head_dim) into its JIT cache, so that the tests
and benchmarks that follow find it built (about 70 s each on the H200 host; run several at once).

    python3 scripts/gpu_backends/warm_flashinfer.py bfloat16 128
"""
from __future__ import annotations

import sys
import time

import torch

from usp_dit.kernels import get_backend


def main(dtype: str, head_dim: str) -> None:
    start = time.perf_counter()
    q = torch.randn(1, 256, 4, int(head_dim), device="cuda", dtype=getattr(torch, dtype))
    get_backend("flashinfer").forward(q, q, q, 0.1)
    torch.cuda.synchronize()
    print(f"flashinfer {dtype} head_dim {head_dim}: built in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
