"""Kernels as ``torch.library`` custom ops, so that ``torch.compile`` traces through them.

Layout as in ``base``: q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (B, Sq, H, D) contiguous,
lse (B, Sq, H) contiguous (float32; float64 for float64 inputs).

``usp_dit::attention`` runs a registered backend by name; its fake implementation gives the output
shapes without running anything, and its autograd formula calls ``usp_dit::attention_backward``.
Eager calls skip this layer (a custom op costs a few microseconds of dispatch); compiled code goes
through it (``usp_attention`` checks ``torch.compiler.is_compiling()``).
"""
from __future__ import annotations

import torch

from usp_dit.kernels.base import get_backend, lse_dtype


@torch.library.custom_op("usp_dit::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = get_backend(backend).forward(q, k, v, scale)
    if lse is None:  # a backend without LSE: a placeholder keeps the op's signature fixed
        lse = q.new_zeros(q.shape[:3], dtype=lse_dtype(q.dtype))
    return out.contiguous(), lse.contiguous()


@attention_op.register_fake
def _attention_fake(q, k, v, scale, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("usp_dit::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    scale: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = get_backend(backend).backward(dout, q, k, v, out, lse, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, scale, backend):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.backend = scale, backend


def _backward(ctx, dout, dlse):
    # dlse is materialised as zeros by the custom-op machinery; a non-zero one cannot be told apart
    # cheaply here, so compiled code documents the LSE as non-differentiable like eager code does.
    q, k, v, out, lse = ctx.saved_tensors
    if not get_backend(ctx.backend).caps.supports_backward:
        raise NotImplementedError(f"backend {ctx.backend!r} has no backward")
    dq, dk, dv = attention_backward_op(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)
