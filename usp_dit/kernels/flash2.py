"""FlashAttention 2 (the ``flash-attn`` package, 2.7 or newer): forward with LSE and a backward that
takes an external out/LSE, on Ampere and newer GPUs.

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D): the kernel's own layout, grouped
K/V read natively (no expansion), dk/dv returned per K/V head.

Quirks kept here:
- its private ``_flash_attn_forward`` / ``_flash_attn_backward`` are called: the public
  ``flash_attn_func`` hides the backward behind its own autograd and cannot take a merged out/LSE,
  which the ring needs. Their argument lists changed in 2.7 (``window_size`` split into left/right,
  the backward fills caller-allocated dq/dk/dv), so older releases are refused, not guessed at;
- LSE comes back (B, H, S) float32, natural log, scale applied; the backward reads that layout;
- the kernels need the last dim contiguous and head_dim a multiple of 8 (the public function pads,
  the private ones do not), at most 256.
"""
from __future__ import annotations

import functools

import torch

from usp_dit.kernels._sdpa_layout import lse_to_bhs, lse_to_bsh
from usp_dit.kernels.protocol import BackendCaps, folded_forward_stack, import_optional
from usp_dit.kernels.registry import register_backend

INSTALL = "pip install 'flash-attn>=2.7' --no-build-isolation"
_MIN_VERSION = (2, 7)


def _version_tuple(text: str) -> tuple[int, int]:
    """'2.8.3.post2' -> (2, 8); an unparsable version gives (0, 0)."""
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


@functools.cache
def _interface():
    """``flash_attn.flash_attn_interface`` of a 2.7+ release, or ``None`` (absent, older, or broken;
    FA4's ``flash_attn.cute`` namespace alone has no ``flash_attn_interface``)."""
    interface = import_optional("flash_attn.flash_attn_interface")
    package = import_optional("flash_attn")
    if interface is None or _version_tuple(getattr(package, "__version__", "0")) < _MIN_VERSION:
        return None
    return interface


class FlashAttn2Backend:
    name = "flash_attn_2"
    caps = BackendCaps(
        frozenset({"cuda"}), frozenset({torch.float16, torch.bfloat16}), max_head_dim=256,
        supports_backward=True, head_dim_multiple=8, causal=True,
    )

    def available(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8 and _interface() is not None

    def require(self) -> None:
        if not self.available():
            raise RuntimeError(f"backend 'flash_attn_2' needs flash-attn 2.7 or newer and an Ampere or newer GPU: {INSTALL}")

    def forward(self, q, k, v, scale, causal=False):
        out, lse, _, _ = _interface()._flash_attn_forward(
            q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False
        )
        return out, lse_to_bsh(lse, q.shape[1], q.dtype)

    def forward_stack(self, q, k_blocks, v_blocks, scale):
        """G blocks in one call, folded into the batch (the repeated ``q`` is a stride-0 view)."""
        return folded_forward_stack(self, q, k_blocks, v_blocks, scale)

    def backward(self, dout, q, k, v, out, lse, scale, causal=False):
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))  # contiguous
        _interface()._flash_attn_backward(
            dout, q, k, v, out, lse_to_bhs(lse, q.dtype), dq, dk, dv,
            0.0, scale, causal, -1, -1, 0.0, None, False,
        )
        return dq, dk, dv


register_backend(FlashAttn2Backend())
