"""One-pass e4m3 quantisation with one scale per tensor (the ``fp8_cudnn`` backend's inputs, Note
[fp8 attention, cuDNN]): the same values and scale as ``fp8_quant.tensor_quant``, bit for bit, in
two passes over the input instead of PyTorch's six (cast, abs, max, divide, clamp, cast); and the
dequantisation of its e4m3 output in one pass. Imported only where Triton and a CUDA GPU are present.

Layout: any tensor (it is read as its contiguous flattening) -> e4m3 of the same shape and a 0-d
float32 scale.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from usp_dit.kernels.fp8_quant import E4M3_MAX
_BLOCK = 4096


@triton.jit
def _scale_cast(X, S, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    # IEEE division as PyTorch's (Triton's "/" is an approximate one), clamp, round to nearest even
    y = tl.math.div_rn(x, tl.load(S))
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(Y + offs, y.to(tl.float8e4nv), mask=inside)


@triton.jit
def _descale(X, S, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x * tl.load(S)).to(Y.dtype.element_ty), mask=inside)


def dequant(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x8`` (contiguous e4m3) times the 0-d float32 ``scale``, rounded once to ``dtype``: as
    ``(x8.float() * scale).to(dtype)`` in one pass."""
    y = torch.empty(x8.shape, dtype=dtype, device=x8.device)
    n = x8.numel()
    if n:
        _descale[(triton.cdiv(n, _BLOCK),)](x8, scale, y, n, BLOCK=_BLOCK)
    return y


def tensor_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, CUDA, bf16 / fp16 / fp32) -> e4m3 values (contiguous, x's shape) and the
    float32 scale max|x| / 448 (1 for an all-zero tensor), as ``fp8_quant.tensor_quant``."""
    x = x.contiguous()
    # the largest |x| in x's own dtype is exact (no rounding in abs or max); one reduction pass
    amax = torch.linalg.vector_norm(x, float("inf")).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = x.numel()
    if n:
        _scale_cast[(triton.cdiv(n, _BLOCK),)](x, scale, y, n, BLOCK=_BLOCK)
    return y, scale
