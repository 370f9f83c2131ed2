"""SageAttention (``sageattention`` 1.0.x, Triton, INT8 Q·K): forward only, no log-sum-exp.

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D); the kernel reads this "NHD" layout.

Quirks kept here:
- 1.0.x returns no LSE at all (``returns_lse=False``), so it cannot take part in a ring merge;
  ``usp_attention`` refuses it when ring_degree > 1 or return_lse=True. With Ulysses only (and at
  world size 1) it is exact to its own quantisation. Its K smoothing (subtracting the mean key)
  shifts every score of a query by the same amount: the output is unchanged, the LSE would not be.
- It is built for head_dim 64, 96 and 128 only, fp16/bf16 only, and no GQA: K/V are expanded.
- INT8 quantisation makes it approximate: it is never chosen by ``backend="auto"``; ask for it.
"""
from __future__ import annotations

import importlib.util

import torch

from usp_dit.kernels.base import BackendCaps, expand_kv, register_backend

INSTALL = "pip install sageattention==1.0.6"


class SageBackend:
    name = "sage"
    caps = BackendCaps(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=128,
        supports_backward=False,
        head_dims=frozenset({64, 96, 128}),
        returns_lse=False,
    )

    def available(self) -> bool:
        return torch.cuda.is_available() and importlib.util.find_spec("sageattention") is not None

    def require(self) -> None:
        if not self.available():
            raise RuntimeError(f"backend 'sage' needs the sageattention package and a CUDA GPU: {INSTALL}")

    def forward(self, q, k, v, scale):
        from sageattention import sageattn

        h = q.shape[2]
        out = sageattn(
            q.contiguous(), expand_kv(k, h).contiguous(), expand_kv(v, h).contiguous(),
            tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=True,
        )
        return out, None

    def backward(self, *args):
        raise NotImplementedError("backend 'sage' has no backward")


register_backend(SageBackend())
