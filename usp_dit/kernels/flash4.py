"""FlashAttention 4 (``flash-attn-4``, CuTe DSL kernels compiled at first use): forward with LSE
and a backward that takes an external out/LSE, on Hopper (SM90) and Blackwell.

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D): the kernel's own "bshd" layout,
grouped K/V read natively (no expansion), dk/dv returned per K/V head.

Quirks kept here:
- its private ``_flash_attn_fwd`` / ``_flash_attn_bwd`` are called (the public function hides the
  backward behind its own autograd and cannot take a merged out/LSE, which the ring needs);
- LSE comes back (B, H, S) float32, natural log, scale applied; the backward reads that layout;
- the package's ``cutlass`` module is put on ``sys.path`` by a ``.pth`` file, so an install with
  ``pip install --target`` needs ``<target>/nvidia_cutlass_dsl/dsl_packages`` on PYTHONPATH;
- each new (head_dim, dtype, tile) is compiled on first call (seconds): warm up before timing.
"""
from __future__ import annotations

import functools

import torch

from usp_dit.kernels._sdpa_layout import lse_to_bhs, lse_to_bsh
from usp_dit.kernels.protocol import BackendCaps, folded_forward_stack, import_optional
from usp_dit.kernels.registry import register_backend

INSTALL = "pip install --pre flash-attn-4 'nvidia-cutlass-dsl[cu13]'"  # PyPI has only 4.0.0 betas (and a 0.0.1 placeholder)
_HALF = frozenset({torch.float16, torch.bfloat16})


@functools.cache
def _interface():
    """The ``flash_attn.cute.interface`` module, or ``None`` when it cannot be imported."""
    return import_optional("flash_attn.cute.interface")


# Its Python call path costs about 0.15-0.2 ms of CPU per call (H200 host, 2026-12-02), against
# about 0.05 ms for a cuDNN SDPA call: in eager ring runs it lost to cuDNN in 5 of 6 cases with
# calls below 1e11 flops (Flux gather R = 2: 0.95 vs 0.54 ms) and won all 11 with calls above
# 2.4e11 (CogVideoX, Mochi blocks). "auto" takes it from 1.5e11 flops per call (docs/PERFORMANCE.md).
_MIN_CALL_FLOPS = 1.5e11


class FlashAttn4Backend:
    name = "flash_attn_4"
    caps = BackendCaps(
        frozenset({"cuda"}), _HALF, max_head_dim=256, supports_backward=True, head_dim_multiple=8,
        min_call_flops=_MIN_CALL_FLOPS, causal=True,
    )

    def available(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and _interface() is not None

    def require(self) -> None:
        if not self.available():
            raise RuntimeError(
                f"backend 'flash_attn_4' needs the flash-attn-4 package and a Hopper or newer GPU: {INSTALL}"
            )

    def forward(self, q, k, v, scale, causal=False):
        out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
        return out, lse_to_bsh(lse, q.shape[1], q.dtype)

    def forward_stack(self, q, k_blocks, v_blocks, scale):
        """G blocks in one call (folded into the batch; the kernel copies the repeated ``q``)."""
        return folded_forward_stack(self, q, k_blocks, v_blocks, scale)

    def backward(self, dout, q, k, v, out, lse, scale, causal=False):
        dq, dk, dv = _interface()._flash_attn_bwd(
            q, k, v, out.contiguous(), dout.contiguous(), lse_to_bhs(lse, q.dtype), softmax_scale=scale,
            causal=causal,
        )[:3]
        return dq, dk, dv


register_backend(FlashAttn4Backend())
