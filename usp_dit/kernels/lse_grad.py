"""A kernel's backward with a gradient on its log-sum-exp, through any backend that has a backward.

Layout: q, out, dout, dq (batch, seq_q, heads, head_dim); k, v, dk, dv (batch, seq_k, kv_heads,
head_dim); lse, dlse (batch, seq_q, heads).

Note [LSE gradient]
    For one query row i, s_ij = scale q_i . k_j, P = softmax_j(s), O = P V, L_i = logsumexp_j s_ij.
    Given the upstream dO and dL (dL_i/ds_ij = P_ij):

        dS_ij = P_ij (dP_ij - D_i + dL_i),   dP = dO V^T,   D_i = sum_d dO_id O_id
        dq = scale dS K,   dk = scale dS^T Q,   dv = P^T dO

    so the LSE's gradient changes only the row term: D'_i = D_i - dL_i. Every block of a split key
    set (a ring step, a staircase plan's call, the masked joint call) gets the queries' FINAL out
    and lse, which makes P its exact share of the final softmax; with the final L = logsumexp_b
    L_b, dL reaches block b's own L_b with weight exp(L_b - L), and P_b exp(L_b - L) is that same
    share, so each block's backward simply takes D' with the final dL. Nothing else changes.

    Kernel backwards compute D themselves from ``dout`` and ``out`` (the only use of ``out``:
    protocol), and take no D. Two exact ways to hand them D' without new kernel code:

    - augmented (one call): one or two zero columns appended to the head dim, so that
          q' = [q, 0]   k' = [k, 0]   v' = [v, 0]   dout' = [dout, 1]   out' = [out, -dL]
      gives scores, P and dP unchanged (the scale is passed explicitly) and D' = D - dL; the first
      head_dim columns of dq', dk', dv' are the answer. The width is head_dim + columns rounded up
      to what the backend takes (a multiple of 8 on GPUs; the next of its listed head dims).
    - two calls, where no augmented width fits the backend (cuDNN's backward stops at head_dim
      128, FlashAttention's at 256): the plain backward, plus one call with v = 0 (so dP = 0),
      out = e (ones in the first columns) and dout = -dL in those columns (so D = -dL):
      dS = P dL, exactly the term the LSE adds to dq and dk (its dv is dropped). About twice
      the backward's work, against the augmented call's (head_dim + pad) / head_dim.

    Which, on a GPU: the augmented call costs (head_dim + pad) / head_dim only while the wider
    head dim stays in the kernel's tile class (GPU kernels are built for head dims up to 64, 128
    and 256 and pad up to the next). Crossing one costs more than a second call: measured on an
    H100 at head_dim 128 (width 136), augmented / plain 1.92-2.03x on PyTorch's flash kernel and
    4.4-5.1x on its mem-efficient one (its generic-width path), two calls 2.0-2.2x on both
    (docs/PERFORMANCE.md, "Sixth session's GPU figures"). So a GPU takes the augmented call only
    within the class (e.g. head_dim 72 at width 80), two calls otherwise; the CPU kernels have no
    such classes.

    Precision: -dL travels in ``out``'s dtype. In float32 / float64 one column holds it exactly.
    In bfloat16 / float16 it is split in two columns, hi = dL rounded and lo = (dL - hi) rounded,
    which the kernel sums in float32 with the rest of D: about 16 bits of dL, finer than D
    itself, which the kernel forms from the half-precision ``out`` and ``dout`` (8 bits each).

    Cost: only when a gradient reaches the LSE. Eagerly that is when the loss read it (``dlse``
    is None otherwise, and the plain backward runs). A traced backward always gets a tensor (zeros
    where the loss did not read it), and cannot look at its values without a sync: there callers
    pass the LSE's gradient only where the call returns the LSE (``return_lse=True``), whose
    compiled backward so always pays the augmented call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from usp_dit.kernels.protocol import AttentionBackend, lse_dtype

_GPU_ALIGN = 8  # GPU kernels work in head_dim multiples of 8 (the SDPA adapters pad to it themselves)
_GPU_TILE_CLASSES = (64, 128, 256)  # the head dims GPU attention kernels are built for (Note [LSE gradient])


def _tile_class(head_dim: int) -> int:
    """The smallest of ``_GPU_TILE_CLASSES`` holding ``head_dim`` (larger: itself)."""
    return next((c for c in _GPU_TILE_CLASSES if head_dim <= c), head_dim)


def lse_columns(dtype: torch.dtype) -> int:
    """How many columns of ``dtype`` carry -dL (Note [LSE gradient], precision): one where the
    dtype holds a float32 exactly, two (hi, lo) for half types."""
    return 1 if dtype in (torch.float32, torch.float64) else 2


def augmented_width(backend: AttentionBackend, q: torch.Tensor, columns: int, causal: bool = False) -> int | None:
    """The smallest head dim >= head_dim + ``columns`` on which ``backend`` has a backward for
    ``q``'s device and dtype, or ``None`` where there is none (then: two calls)."""
    caps, head_dim = backend.caps, q.shape[-1]
    need = head_dim + columns
    if caps.head_dims is not None:
        candidates = sorted(w for w in caps.head_dims if w >= need)
    else:
        align = caps.head_dim_multiple if q.device.type == "cpu" else max(_GPU_ALIGN, caps.head_dim_multiple)
        candidates = [-(-need // align) * align]
    if q.device.type != "cpu":  # within the kernel's tile class, or two calls (Note [LSE gradient], which)
        candidates = [w for w in candidates if _tile_class(w) == _tile_class(head_dim)]
    for width in candidates:
        if caps.why_not(q.device.type, q.dtype, width, True, causal) is None:
            return width
    return None


def _split(dlse: torch.Tensor, dtype: torch.dtype, columns: int) -> torch.Tensor:
    """(B, S, H) float32/64 -> (B, S, H, columns) of ``dtype`` summing to it (hi, lo)."""
    hi = dlse.to(dtype)
    if columns == 1:
        return hi.unsqueeze(-1)
    lo = (dlse - hi.to(dlse.dtype)).to(dtype)
    return torch.stack([hi, lo], dim=-1)


def _with_columns(x: torch.Tensor, cols: torch.Tensor | float, width: int) -> torch.Tensor:
    """[x, cols, 0 ...] of last dim ``width``: ``cols`` (..., c) or a scalar for c = 1 column."""
    d = x.shape[-1]
    out = F.pad(x, (0, width - d))
    if torch.is_tensor(cols):
        out[..., d:d + cols.shape[-1]] = cols
    else:
        out[..., d] = cols
    return out


def backward_augmented(backend: AttentionBackend, dout, q, k, v, out, lse, dlse, scale: float, width: int,
                       opts: dict):
    """``(dq, dk, dv)`` with the LSE's gradient ``dlse``, in one call at head dim ``width``
    (Note [LSE gradient]); ``opts``: the call's ``causal`` / ``key_mask`` keywords."""
    d = q.shape[-1]
    minus_dl = _split(-dlse, out.dtype, lse_columns(out.dtype))
    c = minus_dl.shape[-1]
    ones = torch.ones((*dout.shape[:-1], c), dtype=dout.dtype, device=dout.device)
    grads = backend.backward(
        _with_columns(dout, ones, width), *(F.pad(t, (0, width - d)) for t in (q, k, v)),
        _with_columns(out, minus_dl, width), lse, scale, **opts,
    )
    return tuple(g[..., :d] for g in grads)


def backward_two_calls(backend: AttentionBackend, dout, q, k, v, out, lse, dlse, scale: float, opts: dict):
    """``(dq, dk, dv)`` with the LSE's gradient ``dlse``: the plain backward plus the LSE's term
    from a second call (Note [LSE gradient]), summed in the dtype of the merges."""
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, scale, **opts)
    minus_dl = _split(-dlse, out.dtype, min(lse_columns(out.dtype), q.shape[-1]))
    c = minus_dl.shape[-1]
    e = torch.zeros_like(out)
    e[..., :c] = 1
    g = torch.zeros_like(dout)
    g[..., :c] = minus_dl
    dq_l, dk_l, _ = backend.backward(g, q, k, torch.zeros_like(v), e, lse, scale, **opts)
    acc = lse_dtype(q.dtype)
    return (dq.to(acc) + dq_l.to(acc)).to(q.dtype), (dk.to(acc) + dk_l.to(acc)).to(k.dtype), dv


def backward_with_lse_grad(backend: AttentionBackend, dout, q, k, v, out, lse, dlse, scale: float,
                           causal: bool = False, opts: dict | None = None):
    """``(dq, dk, dv)`` of one call given ``dout`` and ``dlse`` (B, Sq, H), the gradients of the
    queries' final ``out`` and ``lse``: one augmented call where a width fits ``backend``, else
    two calls (Note [LSE gradient])."""
    opts = opts or {}
    width = augmented_width(backend, q, lse_columns(out.dtype), causal)
    if width is None:
        return backward_two_calls(backend, dout, q, k, v, out, lse, dlse, scale, opts)
    return backward_augmented(backend, dout, q, k, v, out, lse, dlse, scale, width, opts)


def lse_cotangent(dlse: torch.Tensor | None, lse_grad: bool) -> torch.Tensor | None:
    """The LSE gradient a backward must pass on (Note [LSE gradient], cost): eagerly the one
    autograd gave (``None``: nothing read the LSE); traced, only where the caller may read the LSE
    (``lse_grad``), since a trace materialises an unread one as zeros."""
    if dlse is None or (torch.compiler.is_compiling() and not lse_grad):
        return None
    return dlse
