"""Joint (text) tokens under a key mask: their own kernel call, merged by log-sum-exp.

Layout: q, out, dq (batch, seq_q, heads, head_dim); k, v (batch, seq_k, kv_heads, head_dim);
joint k / v (batch, seq_joint, kv_heads, head_dim); joint mask (batch, seq_joint) bool, True where
the token is a key; lse (batch, seq_q, heads), float32 (float64 for float64 inputs).

Note [masked joint tokens]
    The prompt-masked families (Mochi, HunyuanVideo, Qwen-Image, Chroma) attend batch element b
    over [video; the prompt tokens where mask[b] is set]. Dropping the padded tokens, as stock does
    (and usp_dit's eager adapters, one call per element), makes the number of keys a *value* of the
    mask: a data-dependent shape that torch.compile cannot hold in one graph. Here the padded
    tokens stay and are masked as keys instead: the joint K/V get a call of their own with
    ``key_mask`` (the protocol's key padding mask) and are merged by LSE with the video part,
    whose calls are unchanged (any kernel, any ring schedule: the joint call replaces the joint
    tokens' place at ring step 0). A masked key has weight exp(-inf) = 0, so the result is exact
    for every query; a padded token's own query row is still computed (over the valid keys) and
    the caller discards it (stock leaves it no output).

    The joint call runs on the call's kernel when it has ``caps.key_mask``, else on PyTorch's
    kernel that takes one (the CPU flash kernel; on CUDA the mem-efficient one), else on the
    reference: the joint part is a few hundred keys, so it costs little beside the video part.
    Backward, as in ring attention: each part's gradient is its kernel's backward given the
    *final* out and LSE of the queries (and the final LSE's gradient: Note [LSE gradient] in
    ``usp_dit.kernels.lse_grad``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from usp_dit.attention.merge import LSEMerger
from usp_dit.kernels.autograd import kernel_backward, kernel_forward
from usp_dit.kernels.lse_grad import lse_cotangent
from usp_dit.kernels.protocol import AttentionBackend, lse_dtype
from usp_dit.kernels.registry import get_backend


class JointKV(NamedTuple):
    """The joint K/V of one call: (B, T, Hk, D) each; ``mask`` (B, T) bool or ``None`` (all keys)."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None


def joint_backend(backend: AttentionBackend, q: torch.Tensor) -> AttentionBackend:
    """The kernel of a masked joint call (Note [masked joint tokens])."""
    if backend.caps.key_mask:
        return backend
    device, dtype, head_dim = q.device.type, q.dtype, q.shape[3]
    for name in ("sdpa_cpu", "sdpa_efficient"):  # PyTorch's kernels that take a mask, by device
        kernel = get_backend(name)
        if kernel.caps.why_not(device, dtype, head_dim, True) is None and kernel.available():
            return kernel
    return get_backend("reference")


def joint_forward(q, joint: JointKV, backend: AttentionBackend, scale: float):
    """``(out, lse)`` of ``q`` against the masked joint keys alone (no autograd)."""
    return kernel_forward(joint_backend(backend, q), q, joint.k, joint.v, scale, key_mask=joint.mask)


def joint_grads(dout, q, joint: JointKV, out, lse, backend: AttentionBackend, scale: float, dlse=None):
    """``(dq, djoint_k, djoint_v)`` of the masked joint part, ``out``/``lse`` being the queries'
    final (merged) results and ``dlse`` the final LSE's gradient (``None``: none)."""
    kernel = joint_backend(backend, q)
    return kernel_backward(kernel, dout, q, joint.k, joint.v, out, lse, scale, key_mask=joint.mask, dlse=dlse)


def add_masked_joint(merger: LSEMerger, q, joint: JointKV | None, backend: AttentionBackend, scale: float) -> None:
    """Merge the masked joint part into ``merger`` (nothing for no joint, an unmasked one, or no queries)."""
    if joint is not None and joint.mask is not None and q.shape[1]:
        merger.add(*joint_forward(q, joint, backend, scale))


class JointMaskedAttention(torch.autograd.Function):
    """``q`` against ``k``/``v`` and the masked joint K/V (no ring: one rank, or Ulysses only).

    Returns ``(out, lse)``, both differentiable; ``lse_grad``: the caller may read ``lse`` (as
    ``RingAttention``'s).
    """

    @staticmethod
    def forward(ctx, q, k, v, joint_k, joint_v, joint_mask, backend: AttentionBackend, scale: float,
                lse_grad: bool = False):
        merger = LSEMerger()
        if q.shape[1] and k.shape[1]:
            merger.add(*kernel_forward(backend, q, k, v, scale))
        add_masked_joint(merger, q, JointKV(joint_k, joint_v, joint_mask), backend, scale)
        if merger.out is None:  # no queries
            out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))
        else:
            out, lse = merger.result(q.dtype)
        ctx.save_for_backward(q, k, v, joint_k, joint_v, joint_mask, out, lse)
        ctx.backend, ctx.scale, ctx.lse_grad = backend, scale, lse_grad
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, joint_k, joint_v, joint_mask, out, lse = ctx.saved_tensors
        dlse = lse_cotangent(dlse, ctx.lse_grad)
        if (dout is None and dlse is None) or not q.shape[1]:
            return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                    torch.zeros_like(joint_k), torch.zeros_like(joint_v), None, None, None, None)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        joint = JointKV(joint_k, joint_v, joint_mask)
        dq, djk, djv = joint_grads(dout, q, joint, out, lse, ctx.backend, ctx.scale, dlse)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        if k.shape[1]:
            dq_v, dk, dv = kernel_backward(ctx.backend, dout, q, k, v, out, lse, ctx.scale, dlse=dlse)
            acc = lse_dtype(q.dtype)  # the two shares summed once, in the dtype of the merges
            dq = (dq.to(acc) + dq_v.to(acc)).to(q.dtype)
        return dq, dk, dv, djk, djv, None, None, None, None
