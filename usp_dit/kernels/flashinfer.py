"""FlashInfer (``flashinfer-python``, kernels compiled on first use): forward only, with LSE.

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D); each batch entry is one
``single_prefill_with_kv_cache`` call in its "NHD" layout ((S, H, D), a view: no copy), grouped
K/V read natively.

Quirks kept here:
- its LSE is base 2 (the kernels keep scores scaled by log2(e) and store ``m + log2(d)``):
  multiplied by ln(2) here to give our natural-log LSE;
- one call per batch entry (the single-request API has no batch); DiT batches are 1 or 2 (CFG);
- its backend "auto" takes its Hopper (FA3-style) kernels on SM90 for head dims 64, 128 and 256,
  its Ampere ones elsewhere; each (dtype, head_dim) is compiled with nvcc on first call (about 70 s
  on an H200 host, then cached): warm up before timing. Without nvcc (and without the prebuilt
  ``flashinfer-jit-cache``) that call would fail, so the backend then reads as unavailable;
- no backward (an inference kernel): ``supports_backward=False``, so training refuses it loudly.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os
import shutil

import torch

from usp_dit.kernels.protocol import BackendCaps, import_optional, lse_dtype
from usp_dit.kernels.registry import register_backend

INSTALL = "pip install flashinfer-python"
BUILD = "put CUDA's nvcc on PATH (or set CUDA_HOME), or pip install flashinfer-jit-cache (prebuilt kernels)"
_LN2 = math.log(2.0)


@functools.cache
def _module():
    """The ``flashinfer`` module, or ``None`` when it cannot be imported."""
    return import_optional("flashinfer")


def can_build_kernels() -> bool:
    """FlashInfer compiles its kernels with nvcc on first use (found as FlashInfer finds it: CUDA_HOME
    or CUDA_PATH, else nvcc on PATH, else /usr/local/cuda) unless ``flashinfer-jit-cache`` ships
    them prebuilt. Without either the first call fails, so "auto" must not pick it."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return True
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return os.path.exists(nvcc)


def prefill_each(q, k, v, element_kwargs=lambda b: {}, **kwargs):
    """``(out, lse)`` of one ``single_prefill_with_kv_cache`` call per batch entry ("NHD", with its
    LSE, converted from base 2 to our natural log), ``kwargs`` to every call and
    ``element_kwargs(b)`` to entry b's (per-entry scales)."""
    prefill = _module().single_prefill_with_kv_cache
    parts = [  # .contiguous(): a no-op for the usual layouts, a copy for exotic strides
        prefill(q[b].contiguous(), k[b].contiguous(), v[b].contiguous(), kv_layout="NHD", return_lse=True,
                **kwargs, **element_kwargs(b))
        for b in range(q.shape[0])
    ]
    if len(parts) == 1:
        out, lse = parts[0][0].unsqueeze(0), parts[0][1].unsqueeze(0)
    else:
        out, lse = torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts])
    return out, lse.to(lse_dtype(q.dtype)) * _LN2


class FlashInferBackend:
    name = "flashinfer"
    caps = BackendCaps(
        frozenset({"cuda"}), frozenset({torch.float16, torch.bfloat16}), max_head_dim=256,
        supports_backward=False, head_dims=frozenset({64, 128, 256}), causal=True,
    )

    def available(self) -> bool:
        return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
                and _module() is not None and can_build_kernels())

    def require(self) -> None:
        if self.available():
            return
        if _module() is not None and not can_build_kernels():
            raise RuntimeError(f"backend 'flashinfer' compiles its kernels on first use and finds no nvcc: {BUILD}")
        raise RuntimeError(f"backend 'flashinfer' needs the flashinfer-python package and an Ampere or newer GPU: {INSTALL}")

    def forward(self, q, k, v, scale, causal=False):
        return prefill_each(q, k, v, causal=causal, sm_scale=scale)

    def backward(self, *args):
        raise NotImplementedError("backend 'flashinfer' has no backward")


register_backend(FlashInferBackend())
