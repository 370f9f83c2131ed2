"""The ``backend="auto"`` policy: a preference table per device type, and ``select_backend``.

Layout: see ``usp_dit.kernels.protocol``.

The table is data (``AUTO_TABLE``): the first row that applies whose backend is installed and can
run the case (dtype, head_dim, a backward where gradients are needed, a call big enough for its
per-call cost: ``BackendCaps.min_call_flops``) wins. Where each row's place comes from, with the
measured rates of every kernel side by side: docs/PERFORMANCE.md, "All kernels side by side".
Sage (INT8, approximate) is never taken by "auto". On CPU PyTorch's fused flash kernel beats the
reference by never forming the S x S score matrix.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp_dit.kernels.protocol import AttentionBackend
from usp_dit.kernels.registry import generation, get_backend, registered, with_backward

_log = logging.getLogger("usp_dit")


@dataclass(frozen=True)
class AutoRule:
    """One row of the preference table of ``backend="auto"``: try ``backend`` for the cases the row
    names (``training``: True only where gradients are needed, False only for inference, None both;
    ``max_head_dim``: only up to that head_dim)."""

    backend: str
    training: bool | None = None
    max_head_dim: int | None = None

    def applies(self, head_dim: int, needs_grad: bool) -> bool:
        return ((self.training is None or self.training == needs_grad)
                and (self.max_head_dim is None or head_dim <= self.max_head_dim))


AUTO_TABLE: dict[str, tuple[AutoRule, ...]] = {
    "cuda": (
        AutoRule("flash_attn_4", training=True),  # fastest fwd+bwd at every shape measured
        AutoRule("flash_attn_4", training=False, max_head_dim=64),  # led CogVideoX's forward at every call size
        AutoRule("flash_attn_3"),  # fastest forward at head_dim 128, and FA4's fallback for small calls
        AutoRule("flash_attn_4"),
        AutoRule("flashinfer"),  # forward only; compiles each (dtype, head_dim) on first use
        AutoRule("sdpa_cudnn"),
        AutoRule("flash_attn_2"),
        AutoRule("sdpa_flash"),
        AutoRule("sdpa_efficient"),
        AutoRule("reference"),
    ),
    "cpu": (AutoRule("sdpa_cpu"), AutoRule("reference")),
}

# Note [small calls on one rank go to PyTorch's dispatcher]
#     A one-rank call with no mask, joint tokens, LSE or merge is the call a stock processor makes,
#     and PyTorch's ``F.scaled_dot_product_attention`` runs it with about 11 us less host time than
#     our chain (the backend choice, the adapter's layout, its binding: 17.0 against 28.2 us a call
#     at PixArt's shape on an H100, docs/PERFORMANCE.md "One rank, host time"). Below
#     ``TORCH_DISPATCH_FLOPS`` a call's kernel is short (4096 tokens x 16 heads x 72: 7.7e10 flops,
#     ~0.2 ms), its block's host time is of its order, and the models making such calls (PixArt,
#     DiT, DreamLite) are host-bound: the host microseconds are the step's. Above it a kernel of
#     ours that beats PyTorch's pick (FA3 over cuDNN: 672 against 562 TF/s at Wan's shape) gains
#     more than the host time costs. Same maths either way (both are exact attention kernels).
TORCH_DISPATCH_FLOPS = 1e11


def attention_flops(batch: int, queries: float, keys: float, heads: int, head_dim: int) -> float:
    """Dense flops of one attention call, 4 B S_q S_k H D: the call size "auto" weighs (and the
    planner prices)."""
    return 4.0 * batch * queries * keys * heads * head_dim


def auto_uses_torch_dispatch(call_flops: float) -> bool:
    """``backend="auto"`` runs a plain one-rank call of ``call_flops`` (4 B S_q S_k H D) through
    PyTorch's own SDPA dispatcher (Note [small calls on one rank go to PyTorch's dispatcher])."""
    return call_flops < TORCH_DISPATCH_FLOPS


# Resolved selections, so that the per-call cost of ``select_backend`` is one dict lookup.
_SELECTED: dict[tuple, AttentionBackend] = {}


def select_backend(
    name: str, device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool, call_flops: float | None = None,
    causal: bool = False,
) -> AttentionBackend:
    """Resolve ``name`` ("auto" or a registered name) to a backend that can run this case.

    ``call_flops``, the estimated work of one kernel call, lets "auto" skip backends whose
    ``caps.min_call_flops`` it does not reach (decided once per power-of-two size class).
    ``causal``: the calls include causal diagonal blocks (``caps.causal`` needed).

    Raises:
        ValueError: unknown name.
        RuntimeError: the backend's package is not installed (its adapter says how to install it).
        NotImplementedError: the backend cannot run this device / dtype / head_dim, or has no
            backward while gradients are needed (the message names backends that have one).
    """
    size_class = None if call_flops is None or name != "auto" else int(math.log2(max(call_flops, 1.0)))
    key = (name, device, dtype, head_dim, needs_grad, size_class, causal, generation())
    if key in _SELECTED and registered(_SELECTED[key].name) is _SELECTED[key]:
        return _SELECTED[key]
    backend = _select(name, device, dtype, head_dim, needs_grad, call_flops, causal)
    if not torch.compiler.is_compiling():  # a traced write would be a side effect (refused inside
        _SELECTED[key] = backend  # activation checkpointing); the graph fixes the choice anyway
    if name == "auto":
        _log_choice(backend, device, dtype, head_dim, needs_grad)
    return backend


def _log_choice(backend: AttentionBackend, device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool) -> None:
    """Say once (per case, on rank 0) which backend "auto" chose (not from a traced call: a log
    call would break the graph, and on rank 0 only)."""
    if torch.compiler.is_compiling() or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _log.info(
        "usp_dit: backend='auto' chose %r for device=%s dtype=%s head_dim=%d backward=%s",
        backend.name, device, dtype, head_dim, needs_grad,
    )


def _fits_auto(backend: AttentionBackend | None, device, dtype, head_dim, needs_grad, call_flops, causal=False) -> bool:
    """``backend`` is installed, can run the case, and the call is big enough for its per-call cost."""
    if backend is None or not backend.available() or backend.caps.why_not(device, dtype, head_dim, needs_grad, causal):
        return False
    return call_flops is None or call_flops >= backend.caps.min_call_flops


def _select(
    name: str, device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool, call_flops=None, causal=False
) -> AttentionBackend:
    if name == "auto":
        for rule in AUTO_TABLE.get(device, (AutoRule("reference"),)):
            backend = registered(rule.backend)
            if rule.applies(head_dim, needs_grad) and _fits_auto(backend, device, dtype, head_dim, needs_grad, call_flops, causal):
                return backend
        raise NotImplementedError(f"no registered backend runs device={device!r}, dtype={dtype}, head_dim={head_dim}")
    backend = get_backend(name)
    reason = backend.caps.why_not(device, dtype, head_dim, needs_grad, causal)
    if reason is not None:
        hint = f"; backends with a backward here: {with_backward(device, dtype, head_dim)}" if needs_grad else ""
        raise NotImplementedError(f"backend={name!r} cannot run this case: {reason}{hint}")
    if not backend.available():
        backend.require()
    return backend
