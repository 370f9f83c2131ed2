"""Attention backends behind one protocol, registered by name with capability flags.

    protocol.py   what an adapter implements (``AttentionBackend``, ``BackendCaps``) and shared helpers
    registry.py   the backends by name
    policy.py     what ``backend="auto"`` picks (its preference table as data)
    autograd.py   one kernel call (``attend``): eager (``KernelAttention``) or compiled (custom ops), one backward
    <kernel>.py   one adapter per kernel; its quirks stay in it

Nothing here knows about distribution: the ring, Ulysses and the one-device ring simulator
(``usp_dit.testing.blockwise``) sit above.
"""
from __future__ import annotations

from usp_dit.kernels import autograd, flash2, flash3, flash4, flashinfer, fp8, fp8_cudnn, fp8_fa3, fp8_flashinfer, reference, sage, sdpa_cpu, sdpa_cuda  # noqa: F401  (register the backends and ops)
from usp_dit.kernels.autograd import KernelAttention, attend, attend_out
from usp_dit.kernels.policy import select_backend
from usp_dit.kernels.protocol import AttentionBackend, BackendCaps
from usp_dit.kernels.registry import get_backend, list_backends, register_backend

__all__ = [
    "AttentionBackend",
    "BackendCaps",
    "KernelAttention",
    "attend",
    "attend_out",
    "get_backend",
    "list_backends",
    "register_backend",
    "select_backend",
]
