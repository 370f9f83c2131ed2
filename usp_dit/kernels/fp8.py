"""The ``fp8`` backend: FP8 (e4m3) attention with an exact LSE, forward only, opt-in (a Triton
kernel of ours: no build step, Hopper's FP8 tensor cores).

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D), lse (B, S, H) float32.

What it computes is ``usp_dit.kernels.fp8_quant.reference_forward`` (Note [fp8 attention]): Q and K
quantised per (token, head) row, V per (K/V head, channel), the probabilities in e4m3 for P.V; the
LSE is the LSE of the scores it used, so ring blocks merge exactly. Lossy: ``backend="auto"``
never picks it (``usp_dit.kernels.policy.AUTO_TABLE`` does not list it); ask for it with
``backend="fp8"``. Its error against bf16 is measured in docs/FP8.md. No backward: a call that
needs gradients is refused by its caps.

Install: Triton (with torch on Linux: ``pip install triton``) and an sm90 GPU (H100 / H200); the
kernel compiles on first use (a few seconds per head_dim, autotuned per key length).
"""
from __future__ import annotations

import functools

import torch

from usp_dit.kernels.fp8_quant import channel_quant, row_quant
from usp_dit.kernels.protocol import BackendCaps, import_optional
from usp_dit.kernels.registry import register_backend

INSTALL = "pip install triton (and an sm90 GPU: H100 / H200)"


@functools.cache
def _kernel():
    """``usp_dit.kernels._fp8_triton``, or ``None`` without Triton or an sm90+ GPU."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return None
    if import_optional("triton") is None:
        return None
    return import_optional("usp_dit.kernels._fp8_triton")


class FP8Backend:
    name = "fp8"
    caps = BackendCaps(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=256,
        supports_backward=False,
        head_dims=frozenset({64, 128, 256}),
        returns_lse=True,
    )

    def available(self) -> bool:
        return _kernel() is not None

    def require(self) -> None:
        if not self.available():
            raise RuntimeError(f"backend 'fp8' needs Triton and a CUDA GPU of compute capability 9.0+: {INSTALL}")

    def forward(self, q, k, v, scale, causal=False):
        if causal:
            raise NotImplementedError("backend 'fp8' has no causal mode")
        out = torch.empty_like(q)
        if k.shape[1] == 0:  # no key: out 0 and lse -inf, as every backend
            return out.zero_(), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        q8, sq = row_quant(q.transpose(1, 2))
        k8, sk = row_quant(k.transpose(1, 2))
        v8, sv = channel_quant(v)
        v8t = v8.permute(0, 2, 3, 1).contiguous()  # (B, Hk, D, Sk): the keys contiguous
        lse = _kernel().forward(q8.contiguous(), sq.contiguous(), k8.contiguous(), sk.contiguous(), v8t,
                                sv.contiguous(), out, scale)
        return out, lse.transpose(1, 2)


register_backend(FP8Backend())
