"""Autograd for one kernel call: the same forward and backward, eager or compiled.

Layout as in ``usp_dit.kernels.protocol``: q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (B, Sq, H, D),
lse (B, Sq, H) (float32; float64 for float64 inputs). Both are differentiable: a gradient on the
LSE reaches the kernel's backward through ``usp_dit.kernels.lse_grad`` (Note [LSE gradient]).

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

from usp_dit.kernels.lse_grad import backward_with_lse_grad, lse_cotangent
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
                    key_mask=None, dlse=None):
    """``(dq, dk, dv)`` of one call through ``backend``; NotImplementedError for a forward-only one.
    ``out`` / ``lse``: the queries' final results; ``dlse`` (B, Sq, H): the gradient of that final
    LSE, or ``None`` (none reached it: the plain backward, no extra work; Note [LSE gradient])."""
    if not backend.caps.supports_backward:
        raise NotImplementedError(f"backend {backend.name!r} has no backward")
    opts = _options(causal, key_mask)
    if dlse is None:
        return backend.backward(dout, q, k, v, out, lse, scale, **opts)
    return backward_with_lse_grad(backend, dout, q, k, v, out, lse, dlse, scale, causal, opts)


class KernelAttention(torch.autograd.Function):
    """Attention of one block through a backend, with the backend's own backward.

    Returns ``(out, lse)``, both differentiable (a gradient on ``lse``: Note [LSE gradient]).
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
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None, None, None
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = kernel_backward(ctx.backend, dout, q, k, v, out, lse, ctx.scale, ctx.causal, dlse=dlse)
        return dq, dk, dv, None, None, None


@torch.library.custom_op("usp_dit::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str, causal: bool = False,
    lse_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    # lse_grad: the caller may read the LSE, so the backward passes its gradient on (Note [LSE gradient])
    out, lse = kernel_forward(get_backend(backend), q, k, v, scale, causal)
    if lse is None:  # a backend without LSE: a placeholder keeps the op's signature fixed
        lse = q.new_zeros(q.shape[:3], dtype=lse_dtype(q.dtype))
    return out.contiguous(), lse.contiguous()


@attention_op.register_fake
def _attention_fake(q, k, v, scale, backend, causal=False, lse_grad=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("usp_dit::attention_backward", mutates_args=())
def attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    scale: float, backend: str, causal: bool = False, dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = kernel_backward(get_backend(backend), dout, q, k, v, out, lse, scale, causal, dlse=dlse)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, scale, backend, causal=False, dlse=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, scale, backend, causal, lse_grad = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.backend, ctx.causal, ctx.lse_grad = scale, backend, causal, lse_grad


def _backward(ctx, dout, dlse):
    # A traced dlse is zeros where nothing read the LSE; it is passed on only where the caller
    # may read it (lse_grad), so a call that does not return the LSE keeps the plain backward.
    q, k, v, out, lse = ctx.saved_tensors
    if not get_backend(ctx.backend).caps.supports_backward:  # raise before tracing the backward op
        raise NotImplementedError(f"backend {ctx.backend!r} has no backward")
    dlse = lse_cotangent(dlse, ctx.lse_grad)
    dq, dk, dv = attention_backward_op(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.backend, ctx.causal,
                                       None if dlse is None else dlse.contiguous())
    return dq, dk, dv, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Autograd is on and one of ``tensors`` requires a gradient."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: AttentionBackend, scale: float,
           causal: bool = False, lse_grad: bool = False):
    """``(out, lse)`` of one kernel call: the custom op under ``torch.compile``, the autograd.Function
    when a gradient is needed, the bare forward otherwise (no autograd bookkeeping: no P = 1 tax).
    ``causal``: the square diagonal block of causal attention (``usp_dit.kernels.protocol``).
    ``lse_grad``: the caller may read ``lse`` in a loss (a compiled backward then passes the LSE's
    gradient on; eagerly autograd tells: Note [LSE gradient])."""
    if torch.compiler.is_compiling():  # traced as an opaque custom op with a fake implementation
        return torch.ops.usp_dit.attention(q, k, v, scale, backend.name, causal, lse_grad)
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
