"""The Triton kernel of the ``fp8`` backend: a flash-attention forward over e4m3 Q, K, V with
per-row Q/K scales and per-channel V scales, returning the LSE (Note [fp8 attention] in
``usp_dit.kernels.fp8_quant``). Imported only where Triton and a CUDA GPU are present.

Layout: q8 (B, H, Sq, D) and k8 (B, Hk, Sk, D) e4m3, rows contiguous; v8t (B, Hk, D, Sk) e4m3 (V
transposed, so that P.V's reduction axis, the keys, is contiguous: Hopper's FP8 tensor-core
instructions read both operands K-major); sq (B, H, Sq) and sk (B, Hk, Sk) float32 row scales, sq
with the softmax scale and log2(e) folded in; sv (B, Hk, D) float32. Out: o (B, Sq, H, D) in the
caller's dtype, lse (B, H, Sq) float32 natural log.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = 1.4426950408889634

_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bm, bn, w, s in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 4))
]


@triton.autotune(configs=_CONFIGS, key=["SEQ_K", "HEAD_DIM"])
@triton.jit
def _forward(Q, K, VT, SQ, SK, SV, O, LSE,
             stride_ob, stride_os, stride_oh,
             H, HK, SEQ_Q, SEQ_K,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // (H // HK)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < SEQ_Q
    q = tl.load(Q + ((b * H + h) * SEQ_Q + offs_m[:, None]).to(tl.int64) * HEAD_DIM + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    sq = tl.load(SQ + (b * H + h) * SEQ_Q + offs_m, mask=row_ok, other=0.0)
    k_base = K + ((b * HK + hk) * SEQ_K).to(tl.int64) * HEAD_DIM
    v_base = VT + ((b * HK + hk) * HEAD_DIM).to(tl.int64) * SEQ_K
    sk_base = SK + (b * HK + hk) * SEQ_K
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, SEQ_K, BLOCK_N):
        n = start + offs_n
        key_ok = n < SEQ_K
        k = tl.load(k_base + n[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        sk = tl.load(sk_base + n, mask=key_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sq[:, None] * sk[None, :]  # scores in log2 units
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_d[None, :].to(tl.int64) * SEQ_K + n[:, None], mask=key_ok[:, None], other=0.0)
        acc = tl.dot(p.to(tl.float8e4nv), v, acc * alpha[:, None])
        m_i = m_new
    sv = tl.load(SV + (b * HK + hk) * HEAD_DIM + offs_d)
    out = acc / l_i[:, None] * sv[None, :]
    o_ptrs = O + b.to(tl.int64) * stride_ob + offs_m[:, None].to(tl.int64) * stride_os + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + (b * H + h) * SEQ_Q + offs_m, (m_i + tl.math.log2(l_i)) * _LN2, mask=row_ok)


def forward(q8, sq, k8, sk, v8t, sv, out: torch.Tensor, scale: float) -> torch.Tensor:
    """Run the kernel (inputs as in the module docstring, ``sq`` not yet scaled); fills ``out``
    (B, Sq, H, D) and returns the LSE (B, H, Sq)."""
    b, h, seq_q, d = q8.shape
    hk, seq_k = k8.shape[1], k8.shape[2]
    lse = torch.empty(b, h, seq_q, device=q8.device, dtype=torch.float32)
    sq = (sq * (scale * _LOG2E)).contiguous()
    grid = lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]), b * h)
    _forward[grid](q8, k8, v8t, sq, sk, sv, out, lse, out.stride(0), out.stride(1), out.stride(2),
                   h, hk, seq_q, seq_k, HEAD_DIM=d)
    return lse
