"""PyTorch's CUDA SDPA kernels that return a log-sum-exp: cuDNN, flash (FA2) and mem-efficient.

Each is called through its ``aten`` op so that the LSE comes back and the backward can be fed an
external out/LSE (ring attention). Quirks kept here:
- the ops work in (B, H, S, D); ``_sdpa_layout`` converts (views, no copy);
- cuDNN returns LSE as (B, H, S, 1); mem-efficient pads it along S to a multiple of 32 and its
  backward reads that padded shape;
- the backward ops take the RNG / varlen bookkeeping tensors the forward returned; with no dropout
  their values are never read, so zeros of the latest forward's shapes and dtypes stand in (no
  tensor is kept across calls: CUDA graph captures forbid it);
- cuDNN's backward wants ``out`` and ``dout`` with the same strides;
- key masks (``key_mask``, mem-efficient only) go in as an additive bias (``_sdpa_layout``) of
  stride-0 views over heads and queries;
- the ops want head_dim a multiple of 8: any other is zero-padded (Note [padded head_dim]).

Note [padded head_dim]
    PyTorch's public SDPA runs a head_dim that is not a multiple of 8 (DreamLite's 20) on its
    flash kernel by zero-padding the last dim; the aten ops we call refuse it, and "auto" fell
    back to the float32 reference kernel (1.3x stock's time and 4.5x its memory on DreamLite).
    So every method of these backends pads q, k, v (and dout, out in the backward) with zeros to
    the next multiple of 8 and cuts the results back, with the caller's scale (the unpadded
    head_dim's): exact, because a zero column adds 0 to every q.k score (so the softmax and LSE
    are unchanged), the padded output columns are sums of zero values, and the padded gradient
    columns are cut away. The price is the copy of q, k, v, as in PyTorch's own SDPA.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from usp_dit.kernels._sdpa_layout import additive_key_mask, grads_to_bshd, keyless_rows, lse_to_bhs, lse_to_bsh, to_bhsd
from usp_dit.kernels.protocol import BackendCaps, folded_forward_stack
from usp_dit.kernels.registry import register_backend

# The forward ops are called through their generated Python bindings (``torch._scaled_dot_product_*``,
# the same aten functions): less host time than ``torch.ops.aten``'s schema-driven argument parsing
# (2.7 us a call on an H100's host, benchmarks/bench_call_host.py), which a host-bound model pays on
# every attention call (PixArt: 28 a forward, docs/PERFORMANCE.md). The backward ops have no such
# binding and go through ``torch.ops.aten``.
_aten = torch.ops.aten
_HALF = frozenset({torch.float16, torch.bfloat16})


_MULTIPLE = 8  # the head_dim granularity of the aten ops (Note [padded head_dim])


def _padded(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(..., head_dim) -> (..., head_dim rounded up to a multiple of 8), zero columns appended."""
    return F.pad(x, (0, -head_dim % _MULTIPLE))


def _pad_forward(method):
    """``forward(q, k, v, scale, ...) -> (out, lse)`` for any head_dim (Note [padded head_dim])."""
    @functools.wraps(method)
    def forward(self, q, k, v, scale, *args, **kwargs):
        d = q.shape[-1]
        if d % _MULTIPLE == 0:
            return method(self, q, k, v, scale, *args, **kwargs)
        out, lse = method(self, _padded(q, d), _padded(k, d), _padded(v, d), scale, *args, **kwargs)
        return out[..., :d], lse
    return forward


def _pad_forward_out(method):
    """``forward_out(q, k, v, scale) -> out`` for any head_dim (Note [padded head_dim])."""
    @functools.wraps(method)
    def forward_out(self, q, k, v, scale):
        d = q.shape[-1]
        if d % _MULTIPLE == 0:
            return method(self, q, k, v, scale)
        return method(self, _padded(q, d), _padded(k, d), _padded(v, d), scale)[..., :d]
    return forward_out


def _pad_backward(method):
    """``backward(dout, q, k, v, out, lse, scale, ...) -> (dq, dk, dv)`` for any head_dim."""
    @functools.wraps(method)
    def backward(self, dout, q, k, v, out, lse, scale, *args, **kwargs):
        d = q.shape[-1]
        if d % _MULTIPLE == 0:
            return method(self, dout, q, k, v, out, lse, scale, *args, **kwargs)
        grads = method(self, *(_padded(t, d) for t in (dout, q, k, v, out)), lse, scale, *args, **kwargs)
        return tuple(g[..., :d] for g in grads)
    return backward


class _CudaSDPA:
    """The shared plumbing of the aten SDPA backends; every subclass's ``forward``, ``forward_out``
    and ``backward`` take any head_dim (wrapped at class creation: Note [padded head_dim])."""

    name = "sdpa"
    op_name = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for attr, wrap in (("forward", _pad_forward), ("forward_out", _pad_forward_out), ("backward", _pad_backward)):
            if attr in vars(cls):
                setattr(cls, attr, wrap(vars(cls)[attr]))

    def __init__(self) -> None:
        self._aux: dict[str, tuple] = {}

    def _keep_aux(self, device: torch.device, *tensors: torch.Tensor | None) -> None:
        """Remember the shapes, dtypes and devices of the forward's RNG / varlen tensors, not the tensors:
        a tensor kept past the call would outlive a CUDA graph capture (torch.compile's
        "reduce-overhead" refuses a pool tensor that is not an output)."""
        self._aux[str(device)] = tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in tensors)

    def _aux_like(self, device: torch.device) -> tuple:
        """Stand-ins for the kept tensors (zeros, where they were: without dropout their values are
        never read; flash's RNG state lives on the host outside a capture)."""
        return tuple(None if m is None else torch.zeros(m[0], dtype=m[1], device=m[2]) for m in self._aux[str(device)])

    def available(self) -> bool:
        return torch.cuda.is_available() and hasattr(_aten, self.op_name)

    def require(self) -> None:
        if not self.available():
            raise RuntimeError(
                f"{self.name} needs a CUDA build of PyTorch and a GPU: pip install torch (CUDA build)"
            )


def _bhsd_contiguous(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B, H, S, D) view of a (B, S, H, D)-contiguous tensor."""
    return x.contiguous().transpose(1, 2)


class SDPACuDNNBackend(_CudaSDPA):
    name = "sdpa_cudnn"
    op_name = "_scaled_dot_product_cudnn_attention"
    # head_dim 256 forward: PyTorch's own SDPA picks cuDNN there for inference (AuraFlow's 12 x 256),
    # 1.9x faster than flash on the H100 (docs/PERFORMANCE.md); its backward is kept to <= 128, where
    # it was measured.
    caps = BackendCaps(
        frozenset({"cuda"}), _HALF, max_head_dim=256, supports_backward=True, causal=True,
        max_head_dim_backward=128,
    )

    def forward(self, q, k, v, scale, causal=False):
        qt, kt, vt = to_bhsd(q, k, v)
        res = torch._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = res
        self._keep_aux(q.device, seed, offset, cum_q, cum_k)
        return out.transpose(1, 2), lse_to_bsh(lse, q.shape[1], q.dtype)

    def forward_out(self, q, k, v, scale):
        """Without the LSE (compute_log_sumexp=False), as PyTorch's own SDPA runs inference."""
        qt, kt, vt = to_bhsd(q, k, v)
        return torch._scaled_dot_product_cudnn_attention(qt, kt, vt, None, False, 0.0, False, False, scale=scale)[0].transpose(1, 2)

    def forward_stack(self, q, k_blocks, v_blocks, scale):
        """G blocks in one call; cuDNN reads the stride-0 repeated ``q`` in place (no copy at batch
        1), checked on the H200 on 2026-12-02."""
        return folded_forward_stack(self, q, k_blocks, v_blocks, scale)

    def backward(self, dout, q, k, v, out, lse, scale, causal=False):
        qt, kt, vt = to_bhsd(q, k, v)
        seed, offset, cum_q, cum_k = self._aux_like(q.device)
        lse_bhs = lse_to_bhs(lse, q.dtype).unsqueeze(-1)
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd_contiguous(dout), qt, kt, vt, _bhsd_contiguous(out), lse_bhs, seed, offset, None,
            cum_q, cum_k, q.shape[1], k.shape[1], 0.0, causal, scale=scale,
        )
        return grads_to_bshd(dq, dk, dv, k.shape[2])


class SDPAFlashBackend(_CudaSDPA):
    name = "sdpa_flash"
    op_name = "_scaled_dot_product_flash_attention"
    caps = BackendCaps(
        frozenset({"cuda"}), _HALF, max_head_dim=256, supports_backward=True, causal=True
    )

    def forward(self, q, k, v, scale, causal=False):
        qt, kt, vt = to_bhsd(q, k, v)
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch._scaled_dot_product_flash_attention(
            qt, kt, vt, 0.0, causal, False, scale=scale
        )
        self._keep_aux(q.device, cum_q, cum_k, seed, offset)
        return out.transpose(1, 2), lse_to_bsh(lse, q.shape[1], q.dtype)

    def backward(self, dout, q, k, v, out, lse, scale, causal=False):
        qt, kt, vt = to_bhsd(q, k, v)
        cum_q, cum_k, seed, offset = self._aux_like(q.device)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            _bhsd_contiguous(dout), qt, kt, vt, _bhsd_contiguous(out), lse_to_bhs(lse, q.dtype),
            cum_q, cum_k, q.shape[1], k.shape[1], 0.0, causal, seed, offset, scale=scale,
        )
        return grads_to_bshd(dq, dk, dv, k.shape[2])


def _bias(key_mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The mem-efficient kernel's attention bias for a (B, Sk) key mask, broadcast over heads and
    queries by stride-0 views (no (B, H, Sq, Sk) tensor)."""
    bias = additive_key_mask(key_mask, q.dtype)
    return None if bias is None else bias.expand(q.shape[0], q.shape[2], q.shape[1], key_mask.shape[1])


class SDPAEfficientBackend(_CudaSDPA):
    name = "sdpa_efficient"
    op_name = "_scaled_dot_product_efficient_attention"
    caps = BackendCaps(
        frozenset({"cuda"}), _HALF | {torch.float32}, max_head_dim=512, supports_backward=True,
        causal=True, key_mask=True,
    )

    def forward(self, q, k, v, scale, causal=False, key_mask=None):
        qt, kt, vt = to_bhsd(q, k, v)
        out, lse, seed, offset = torch._scaled_dot_product_efficient_attention(
            qt, kt, vt, _bias(key_mask, q), True, 0.0, causal, scale=scale
        )
        self._keep_aux(q.device, seed, offset)
        return keyless_rows(out.transpose(1, 2), lse_to_bsh(lse, q.shape[1], q.dtype), key_mask)

    def forward_out(self, q, k, v, scale):
        """Without the LSE (compute_log_sumexp=False), as PyTorch's own SDPA runs inference."""
        qt, kt, vt = to_bhsd(q, k, v)
        return torch._scaled_dot_product_efficient_attention(qt, kt, vt, None, False, 0.0, False, scale=scale)[0].transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, scale, causal=False, key_mask=None):
        qt, kt, vt = to_bhsd(q, k, v)
        seed, offset = self._aux_like(q.device)
        sq = q.shape[1]
        padded = (sq + 31) // 32 * 32  # the kernel reads its LSE with a padded row stride
        lse_bhs = lse.new_zeros((lse.shape[0], lse.shape[2], padded), dtype=torch.float32)
        lse_bhs[:, :, :sq] = lse.transpose(1, 2)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            _bhsd_contiguous(dout), qt, kt, vt, _bias(key_mask, q), _bhsd_contiguous(out), lse_bhs, seed, offset,
            0.0, [True, True, True, False], causal, scale=scale,
        )
        return grads_to_bshd(dq, dk, dv, k.shape[2])


for _backend in (SDPACuDNNBackend(), SDPAFlashBackend(), SDPAEfficientBackend()):
    register_backend(_backend)
