"""Autograd for one kernel call: the same forward and backward, eager or compiled.

Layout as in ``usp_dit.kernels.protocol``: q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (B, Sq, H, D),
lse (B, Sq, H) (float32; float64 for float64 inputs). The LSE is not differentiable.

``attend`` is the one entry point (``usp_attention`` calls nothing else): it picks the path below.
Eager calls go through ``KernelAttention`` (an ``autograd.Function``: no dispatcher cost, a few
microseconds less per call than a custom op). Compiled code goes through the custom ops
``usp_dit::attention`` / ``usp_dit::attention_backward``, whose fake implementations give output
shapes without running anything so that ``torch.compile`` traces through them (``usp_attention``
is chosen by ``torch.compiler.is_compiling()``). Both paths run ``kernel_backward`` for the gradient, so
the eager and the compiled gradient are the same code; a call needing no gradient skips autograd.
"""
from __future__ import annotations

import torch

from usp_dit.kernels.protocol import AttentionBackend, lse_dtype
from usp_dit.kernels.registry import get_backend


def _options(causal: bool, key_mask) -> dict:
    """The optional keywords of one call, only those given (protocol: a backend without a causal
    mode or key masks keeps the four-argument signature)."""
    opts = {}
    if causal:
        opts["causal"] = True
    if key_mask is not None:
        opts["key_mask"] = key_mask
    return opts


def kernel_forward(backend: AttentionBackend, q, k, v, scale: float, causal: bool = False, key_mask=None):
    """``(out, lse)`` of one call; ``causal`` / ``key_mask`` as in ``usp_dit.kernels.protocol``."""
    return backend.forward(q, k, v, scale, **_options(causal, key_mask))


def kernel_backward(backend: AttentionBackend, dout, q, k, v, out, lse, scale: float, causal: bool = False,
                    key_mask=None):
    """``(dq, dk, dv)`` of one call through ``backend``; NotImplementedError for a forward-only one."""
    if not backend.caps.supports_backward:
        raise NotImplementedError(f"backend {backend.name!r} has no backward")
    return backend.backward(dout, q, k, v, out, lse, scale, **_options(causal, key_mask))


def refuse_lse_gradient(dlse) -> None:
    """NotImplementedError when a gradient reached a returned log-sum-exp (eager only: traced, it is
    always materialised as zeros, and ``usp_attention`` refuses a compiled call whose LSE could
    reach a loss)."""
    if dlse is not None and not torch.compiler.is_compiling():
        raise NotImplementedError("backpropagating through the returned log-sum-exp is not supported")


class KernelAttention(torch.autograd.Function):
    """Attention of one block through a backend, with the backend's own backward.

    Returns ``(out, lse)``; ``lse`` is not differentiable (a gradient reaching it raises).
    """

    @staticmethod
    def forward(ctx, q, k, v, backend: AttentionBackend, scale: float, causal: bool = False):
        out, lse = kernel_forward(backend, q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.scale, ctx.causal = backend, scale, causal
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dlse is not None:
            raise NotImplementedError("backpropagating through the returned log-sum-exp is not supported")
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            return None, None, None, None, None, None
        dq, dk, dv = kernel_backward(ctx.backend, dout, q, k, v, out, lse, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None


@torch.library.custom_op("usp_dit::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = kernel_forward(get_backend(backend), q, k, v, scale, causal)
    if lse is None:  # a backend without LSE: a placeholder keeps the op's signature fixed
        lse = q.new_zeros(q.shape[:3], dtype=lse_dtype(q.dtype))
    return out.contiguous(), lse.contiguous()


@attention_op.register_fake
def _attention_fake(q, k, v, scale, backend, causal=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("usp_dit::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    scale: float, backend: str, causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = kernel_backward(get_backend(backend), dout, q, k, v, out, lse, scale, causal)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, scale, backend, causal=False):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, scale, backend, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.backend, ctx.causal = scale, backend, causal


def _backward(ctx, dout, dlse):
    # dlse is materialised as zeros by the custom-op machinery; a non-zero one cannot be told apart
    # cheaply here, so compiled code documents the LSE as non-differentiable like eager code does.
    q, k, v, out, lse = ctx.saved_tensors
    if not get_backend(ctx.backend).caps.supports_backward:  # raise before tracing the backward op
        raise NotImplementedError(f"backend {ctx.backend!r} has no backward")
    dq, dk, dv = attention_backward_op(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.backend, ctx.causal)
    return dq, dk, dv, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Autograd is on and one of ``tensors`` requires a gradient."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: AttentionBackend, scale: float,
           causal: bool = False):
    """``(out, lse)`` of one kernel call: the custom op under ``torch.compile``, the autograd.Function
    when a gradient is needed, the bare forward otherwise (no autograd bookkeeping: no P = 1 tax).
    ``causal``: the square diagonal block of causal attention (``usp_dit.kernels.protocol``)."""
    if torch.compiler.is_compiling():  # traced as an opaque custom op with a fake implementation
        return torch.ops.usp_dit.attention(q, k, v, scale, backend.name, causal)
    if needs_grad(q, k, v):
        return KernelAttention.apply(q, k, v, backend, scale, causal)
    return kernel_forward(backend, q, k, v, scale, causal)


def attend_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: AttentionBackend, scale: float):
    """``out`` of one kernel call whose LSE nobody reads (one rank, no merge, ``return_lse=False``):
    the backend's ``forward_out`` where it has one and no gradient is needed outside a trace (it
    skips the LSE's work), else ``attend``'s first result."""
    forward_out = getattr(backend, "forward_out", None)
    if forward_out is None or torch.compiler.is_compiling() or needs_grad(q, k, v):
        return attend(q, k, v, backend, scale)[0]
    return forward_out(q, k, v, scale)
