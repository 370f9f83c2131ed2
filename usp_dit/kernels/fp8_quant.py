"""The quantisation of the ``fp8`` attention backend, and its float64 reference (no GPU needed).

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D), lse (B, S, H), like every backend.

Note [fp8 attention]
    Q and K: one float32 scale per (token, head) row, s = max|row| / 448, values e4m3. A score is
    then ``scale * s_q[i] * s_k[j] * (q8[i] . k8[j])``, and the kernel's log-sum-exp is the LSE of
    exactly these scores (it keeps the softmax's running sum from the float32 probabilities). The
    scales depend on a row alone, never on which other keys share a call, so a ring block's LSE is
    the LSE of the scores the whole call would use for those keys, and blocks merge by LSE exactly
    as bf16 ones do (no smoothing by a block's mean key, which would shift every score of a row by
    an amount that differs between blocks).

    V: one float32 scale per (K/V head, channel) over the call's keys, s_v = max|V[:, c]| / 448, so
    that it factors out of the sum over keys: out[i, c] = s_v[c] * sum_j p_j v8[j, c] / sum_j p_j.
    The probabilities enter P.V in e4m3 (p in (0, 1]: values below 2^-6 keep an absolute error of
    2^-10), their sum in float32. A block's V scale depends on its keys: that changes the block's
    output within e4m3's error, never the LSE, so the merge stays exact to what the blocks computed.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0


def _e4m3(x: torch.Tensor, dims: int | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in e4m3 with one float32 scale per slice over ``dims``, s = max|slice| / 448 (1 for an
    all-zero slice); the scales have ``dims`` removed."""
    work = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    amax = work.abs().amax(dim=dims, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(torch.float32)
    values = (work / scale.to(work.dtype)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values, scale.squeeze(dims)


def row_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., D) -> e4m3 values (..., D) and float32 scales (...,) per row (Note [fp8 attention])."""
    return _e4m3(x, -1)


def channel_quant(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` (B, S, Hk, D) -> e4m3 values (B, S, Hk, D) and float32 scales (B, Hk, D): one per
    (K/V head, channel) over the keys (Note [fp8 attention])."""
    return _e4m3(v, 1)


def head_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (B, S, H, D) -> e4m3 values (B, S, H, D) and float32 scales (B, H): one per (element,
    head) over all its tokens and channels (the ``fp8_flashinfer`` backend's scales, Note [fp8
    attention, per head])."""
    return _e4m3(x, (1, 3))


def kv_head_quant(x: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (B, S, H, D) with H a multiple of ``kv_heads`` -> e4m3 values (B, S, H, D) and float32
    scales (B, kv_heads): one per (element, K/V head) over the tokens, channels and the query heads
    that share it (the ``fp8_fa3`` backend's scales, Note [fp8 attention, FA3]; = ``head_quant``
    when H == kv_heads)."""
    b, s, h, d = x.shape
    values, scale = _e4m3(x.reshape(b, s, kv_heads, h // kv_heads, d), (1, 3, 4))
    return values.reshape(b, s, h, d), scale


def tensor_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape) -> e4m3 values (same shape) and one float32 scale (a 0-d tensor) over the
    whole tensor (the ``fp8_cudnn`` backend's scales, Note [fp8 attention, cuDNN])."""
    return _e4m3(x, tuple(range(x.dim())))


def reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the ``fp8`` kernel computes (Note [fp8 attention]), in float64 on any device: the same
    e4m3 inputs and scales, the probabilities rounded to e4m3 for P.V, their sum unrounded.
    Returns ``(out, lse)``: out like ``q`` (its dtype), lse (B, S, H) float64."""
    h, hk = q.shape[2], k.shape[2]
    q8, sq = row_quant(q)
    k8, sk = row_quant(k)
    v8, sv = channel_quant(v)
    group = h // hk
    qd = q8.double() * (sq.double() * scale)[..., None]
    kd = (k8.double() * sk.double()[..., None]).repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", qd, kd)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq)
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m)
    p8 = p.to(torch.float8_e4m3fn).double()
    vd = v8.double().repeat_interleave(group, dim=2)
    num = torch.einsum("bhij,bjhd->bihd", p8, vd)
    out = num / p.sum(dim=-1).transpose(1, 2)[..., None] * sv.double().repeat_interleave(group, dim=1)[:, None]
    return out.to(q.dtype), lse.transpose(1, 2)
