"""Attention backends behind one protocol (see ``base``), registered by name with capability flags."""
from __future__ import annotations

from usp_dit.kernels import flash2, flash3, flash4, flashinfer, ops, reference, sage, sdpa_cpu, sdpa_cuda  # noqa: F401  (register the backends and ops)
from usp_dit.kernels.base import (
    AttentionBackend,
    BackendCaps,
    KernelAttention,
    get_backend,
    list_backends,
    register_backend,
    select_backend,
)

__all__ = [
    "AttentionBackend",
    "BackendCaps",
    "KernelAttention",
    "get_backend",
    "list_backends",
    "register_backend",
    "select_backend",
]
