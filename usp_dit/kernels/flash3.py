"""FlashAttention 3 (the Hopper kernels of flash-attention's ``hopper/`` build, ``flash_attn_3._C``):
forward with LSE and a backward that takes an external out/LSE, on SM90 GPUs.

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D): the kernel's own layout, grouped
K/V read natively (no expansion), dk/dv returned per K/V head.

Quirks kept here:
- the ops ``torch.ops.flash_attn_3.fwd`` / ``.bwd`` are called, registered by ``flash_attn_3._C``
  (what ``flash_attn_interface`` itself calls; the H200 tests ran xformers 0.0.34's copy of that
  build installed under this name, see scripts/flash_attn3). The public ``flash_attn_func`` hides
  the backward behind its own autograd and cannot take a merged out/LSE, which the ring needs.
  Arguments go by keyword: the op's long positional list has grown between releases;
- LSE comes back (B, H, S) float32, natural log, scale applied; the backward reads that layout;
- the kernel has a split-KV forward (``num_splits``, partials combined inside the op); we leave
  the count to its own heuristic (0), which splits only short query blocks. Forcing splits where
  a call's query tiles fill the SMs in a badly quantized number of waves (a rank's quarter of
  Flux: 216 tiles on 132 SMs, 1.64 waves) was no faster on the H200 in any case (within 0.2%)
  (Flux quarter 0.119 ms unsplit, 0.147 ms in 3 splits: benchmarks/bench_attention.py --suite splits);
- head_dim a multiple of 8, at most 256; the last dim contiguous.
"""
from __future__ import annotations

import functools

import torch

from usp_dit.kernels._sdpa_layout import lse_to_bhs, lse_to_bsh
from usp_dit.kernels.protocol import BackendCaps, folded_forward_stack, import_optional
from usp_dit.kernels.registry import register_backend

INSTALL = (
    "git clone https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && "
    "pip install . --no-build-isolation  (or a prebuilt flash_attn_3 wheel matching your torch and CUDA)"
)


@functools.cache
def _ops():
    """``torch.ops.flash_attn_3`` once ``flash_attn_3._C`` (which registers ``fwd``/``bwd``) imports,
    else ``None``."""
    if import_optional("flash_attn_3._C") is not None and hasattr(torch.ops.flash_attn_3, "bwd"):
        return torch.ops.flash_attn_3
    return None


def fa3_forward(q, k, v, scale: float, num_splits: int = 0, causal: bool = False):
    """``(out, lse)`` of one FA3 forward; ``num_splits`` 0 is the kernel's own split-KV heuristic
    (what the backend uses), a positive count forces it (``bench_attention.py --suite splits``)."""
    out, lse, *_ = _ops().fwd(q, k, v, softmax_scale=scale, is_causal=causal, num_splits=num_splits)
    return out, lse_to_bsh(lse, q.shape[1], q.dtype)


class FlashAttn3Backend:
    name = "flash_attn_3"
    caps = BackendCaps(
        frozenset({"cuda"}), frozenset({torch.float16, torch.bfloat16}), max_head_dim=256,
        supports_backward=True, head_dim_multiple=8, causal=True,
    )
    def available(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and _ops() is not None

    def require(self) -> None:
        if not self.available():
            raise RuntimeError(f"backend 'flash_attn_3' needs the FlashAttention 3 kernels and a Hopper (SM90) GPU: {INSTALL}")

    def forward(self, q, k, v, scale, causal=False):
        return fa3_forward(q, k, v, scale, causal=causal)

    def forward_stack(self, q, k_blocks, v_blocks, scale):
        """G blocks in one call, folded into the batch. The repeated ``q`` is copied: a zero batch
        stride is no layout FA3 documents (its loads are TMA descriptors built from the strides)."""
        return folded_forward_stack(self, q, k_blocks, v_blocks, scale, copy_q=True)

    def backward(self, dout, q, k, v, out, lse, scale, causal=False):
        dq, dk, dv, *_ = _ops().bwd(
            dout.contiguous(), q, k, v, out.contiguous(), lse_to_bhs(lse, q.dtype), softmax_scale=scale, is_causal=causal
        )
        return dq, dk, dv


register_backend(FlashAttn3Backend())
