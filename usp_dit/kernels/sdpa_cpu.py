"""PyTorch's fused CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``).

Returns the exact natural-log LSE and has a backward that accepts an external out/LSE, so it serves
ring attention on CPU. Layout quirk: the op works in (B, H, S, D); ``_sdpa_layout`` converts.
Key masks (``key_mask``) go in as an additive mask of the query dtype (``_sdpa_layout``).
"""
from __future__ import annotations

import torch

from usp_dit.kernels._sdpa_layout import (
    additive_key_mask, grads_to_bshd, keyless_rows, lse_to_bhs, lse_to_bsh, to_bhsd,
)
from usp_dit.kernels.protocol import BackendCaps
from usp_dit.kernels.registry import register_backend

_aten = torch.ops.aten


class SDPACPUBackend:
    name = "sdpa_cpu"
    caps = BackendCaps(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16}),
        max_head_dim=1 << 16,
        supports_backward=True,
        causal=True,
        key_mask=True,
    )

    def available(self) -> bool:
        return hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu")

    def require(self) -> None:
        if not self.available():
            raise RuntimeError("sdpa_cpu needs PyTorch >= 2.3: pip install -U 'torch>=2.3'")

    def forward(self, q, k, v, scale, causal=False, key_mask=None):
        qt, kt, vt = to_bhsd(q, k, v)
        out, lse = torch._scaled_dot_product_flash_attention_for_cpu(
            qt, kt, vt, 0.0, causal, attn_mask=additive_key_mask(key_mask, q.dtype), scale=scale
        )
        return keyless_rows(out.transpose(1, 2), lse_to_bsh(lse, q.shape[1], q.dtype), key_mask)

    def backward(self, dout, q, k, v, out, lse, scale, causal=False, key_mask=None):
        qt, kt, vt = to_bhsd(q, k, v)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), qt, kt, vt, out.transpose(1, 2), lse_to_bhs(lse, q.dtype), 0.0, causal,
            attn_mask=additive_key_mask(key_mask, q.dtype), scale=scale,
        )
        return grads_to_bshd(dq, dk, dv, k.shape[2])


register_backend(SDPACPUBackend())
