"""The attention-kernel protocol, capability flags and the registry of named backends.

Layout (every backend, both directions):
    q, out, dq: (batch, seq_q, heads, head_dim)
    k, v, dk, dv: (batch, seq_k, kv_heads, head_dim), heads % kv_heads == 0; query head i reads
        K/V head i // (heads // kv_heads) (grouped-query attention)
    lse: (batch, seq_q, heads), float32 (float64 for float64 inputs, so that a float64 run is a
        float64 reference end to end), natural log, softmax scale applied:
        lse[b, i, h] = log(sum_j exp(scale * q[b, i, h] . k[b, j, h // group]))
    It may be a strided view (kernels produce (batch, heads, seq)); callers must not assume it is
    contiguous.

An adapter may also offer ``forward_stack(q, k_blocks, v_blocks, scale)``: ``q`` against G K/V
blocks of one length, (G, batch, seq_k, kv_heads, head_dim), in one kernel call, returning
(G, batch, seq_q, heads, head_dim) outputs and (G, batch, seq_q, heads) LSEs; ``forward_stack``
below falls back to one call per block.

A backend's quirks (its own layout, LSE shape, padding, version differences) stay in its adapter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import importlib
import importlib.util
import logging
import math

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BackendCaps:
    """What a backend can do: devices, dtypes, largest head_dim, and whether it has a backward."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_head_dim: int
    supports_backward: bool
    head_dim_multiple: int = 1
    head_dims: frozenset[int] | None = None  # an explicit list, for kernels built for a few sizes
    returns_lse: bool = True  # False: out only (usable without a ring, never merged)
    # "auto" passes this backend over for kernel calls of fewer flops: its per-call CPU cost would
    # then exceed the GPU work (explicitly naming the backend still uses it).
    min_call_flops: float = 0.0

    def why_not(self, device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool) -> str | None:
        """The reason this backend cannot run the case, or ``None`` when it can."""
        if device not in self.devices:
            return f"device {device!r} not in {sorted(self.devices)}"
        if dtype not in self.dtypes:
            return f"dtype {dtype} not in {sorted(str(d) for d in self.dtypes)}"
        if head_dim > self.max_head_dim or head_dim % self.head_dim_multiple:
            return f"head_dim={head_dim} not supported (max {self.max_head_dim}, multiple of {self.head_dim_multiple})"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"head_dim={head_dim} not in {sorted(self.head_dims)}"
        if needs_grad and not self.supports_backward:
            return "it has no backward (forward only) but gradients are needed"
        return None


class AttentionBackend(Protocol):
    """One attention kernel behind the protocol above."""

    name: str
    caps: BackendCaps

    def available(self) -> bool:
        """True when the kernel can run in this process (package installed, op present)."""
        ...

    def require(self) -> None:
        """Raise ``RuntimeError`` naming the install line when ``available()`` is false."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(out, lse)``: out like ``q``; lse ``(batch, seq_q, heads)`` float32, or
        ``None`` for a backend whose caps say ``returns_lse=False``."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients ``(dq, dk, dv)`` given the final ``out`` and ``lse`` of these queries.

        ``out`` and ``lse`` may come from a merge over more keys than ``k`` holds (ring attention):
        the result is then the contribution of this K/V block, which is what makes ring backward exact.
        """
        ...


def import_optional(module: str):
    """``module`` of an optional kernel package, or ``None`` when its top-level package is absent or
    the import fails (a broken or partial install counts as not installed)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001  (any failure of a third-party import means "not available")
        return None


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-sum-exp (and of ring merges) for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, S, kv_heads, D)`` -> ``(B, S, num_heads, D)``, each K/V head repeated for its query group."""
    group = num_heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def reduce_kv(dx: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Adjoint of ``expand_kv``: sums the gradients of each query group onto its K/V head."""
    b, s, h, d = dx.shape
    group = h // num_kv_heads
    return dx if group == 1 else dx.view(b, s, num_kv_heads, group, d).sum(dim=3)


_REGISTRY: dict[str, AttentionBackend] = {}
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


# The preference table of backend="auto", per device type: the first row that applies whose backend
# is installed and can run the case (dtype, head_dim, a backward where gradients are needed, a call
# big enough for its per-call cost: BackendCaps.min_call_flops) wins.
# Measured on one NVIDIA H200 (torch 2.11, cu130), all kernels side by side in one run on
# 2026-12-03 (docs/PERFORMANCE.md, "All kernels side by side"), TF/s at Flux / CogVideoX / Mochi /
# Wan (head_dim 128 / 64 / 128 / 128):
# - forward+backward: FlashAttention 4 (flash-attn-4 4.0.0b36) 555 / 524 / 625 / 622, FlashAttention
#   3 (xformers 0.0.34's build) 548 / 513 / 615 / 598, cuDNN 501 / 410 / 526 / 532, flash-attn 2
#   303 / 306 / 344: FA4 first for training, for calls of >= 1.5e11 flops (below, its ~0.15 ms of
#   Python per call loses: Flux forward at N = 8 ranks 0.148 ms against FA3's 0.059), then FA3;
# - forward: FA3 627 / 515 / 669 / 661, FA4 617 / 533 / 654 / 653, FlashInfer (forward only)
#   649 / 494 / 644 / 659, cuDNN 586 / 409 / 562 / 557, Sage 287 / 381 / 437 / 446. FA3 first,
#   except at head_dim 64 where FA4 led at every CogVideoX call size (one rank's queries against all
#   keys, N = 1, 2, 4, 8: 7.13 vs 7.50 ms ... 1.016 vs 1.043). At Flux FA3, FA4 and FlashInfer
#   are within their spread (whole call 0.417 / 0.418 / 0.445 ms in 5 interleaved rounds, 0.42 /
#   0.42 / 0.40 in 3); FlashInfer compiles each (dtype, head_dim) on first use, so it follows both.
# Sage (INT8, approximate) is never taken. On CPU the fused flash kernel of PyTorch beats the
# reference by avoiding the S x S score matrix.
_AUTO_ORDER: dict[str, tuple[AutoRule, ...]] = {
    "cuda": (
        AutoRule("flash_attn_4", training=True),
        AutoRule("flash_attn_4", training=False, max_head_dim=64),
        AutoRule("flash_attn_3"),
        AutoRule("flash_attn_4"),
        AutoRule("flashinfer"),
        AutoRule("sdpa_cudnn"),
        AutoRule("flash_attn_2"),
        AutoRule("sdpa_flash"),
        AutoRule("sdpa_efficient"),
        AutoRule("reference"),
    ),
    "cpu": (AutoRule("sdpa_cpu"), AutoRule("reference")),
}


# Resolved selections, so that the per-call cost of ``select_backend`` is one dict lookup.
_SELECTED: dict[tuple, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Add ``backend`` to the registry under ``backend.name`` (a later one replaces an earlier)."""
    _REGISTRY[backend.name] = backend
    _SELECTED.clear()
    return backend


def list_backends() -> list[str]:
    """Names of the registered backends."""
    return sorted(_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    """The registered backend called ``name``.

    Raises:
        ValueError: no backend has that name.
    """
    if name not in _REGISTRY:
        raise ValueError(f"backend={name!r} is not registered; choose 'auto' or one of {list_backends()}")
    return _REGISTRY[name]


def backends_with_lse() -> list[str]:
    """Names of the registered backends that return a log-sum-exp (usable in a ring)."""
    return sorted(n for n, b in _REGISTRY.items() if b.caps.returns_lse)


def _with_backward(device: str, dtype: torch.dtype, head_dim: int) -> list[str]:
    return [n for n, b in _REGISTRY.items() if b.caps.why_not(device, dtype, head_dim, True) is None]


def select_backend(
    name: str, device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool, call_flops: float | None = None
) -> AttentionBackend:
    """Resolve ``name`` ("auto" or a registered name) to a backend that can run this case.

    ``call_flops``, the estimated work of one kernel call, lets "auto" skip backends whose
    ``caps.min_call_flops`` it does not reach (decided once per power-of-two size class).

    Raises:
        ValueError: unknown name.
        RuntimeError: the backend's package is not installed (its adapter says how to install it).
        NotImplementedError: the backend cannot run this device / dtype / head_dim, or has no
            backward while gradients are needed (the message names backends that have one).
    """
    size_class = None if call_flops is None or name != "auto" else int(math.log2(max(call_flops, 1.0)))
    key = (name, device, dtype, head_dim, needs_grad, size_class)
    if key in _SELECTED and _REGISTRY.get(_SELECTED[key].name) is _SELECTED[key]:
        return _SELECTED[key]
    backend = _select(name, device, dtype, head_dim, needs_grad, call_flops)
    _SELECTED[key] = backend
    if name == "auto":
        _log_choice(backend, device, dtype, head_dim, needs_grad)
    return backend


def _log_choice(backend: AttentionBackend, device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool) -> None:
    """Say once (per case, on rank 0) which backend "auto" chose."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    _log.info(
        "usp_dit: backend='auto' chose %r for device=%s dtype=%s head_dim=%d backward=%s",
        backend.name, device, dtype, head_dim, needs_grad,
    )


def _fits_auto(backend: AttentionBackend | None, device, dtype, head_dim, needs_grad, call_flops) -> bool:
    """``backend`` is installed, can run the case, and the call is big enough for its per-call cost."""
    if backend is None or not backend.available() or backend.caps.why_not(device, dtype, head_dim, needs_grad):
        return False
    return call_flops is None or call_flops >= backend.caps.min_call_flops


def _select(name: str, device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool, call_flops=None) -> AttentionBackend:
    if name == "auto":
        for rule in _AUTO_ORDER.get(device, (AutoRule("reference"),)):
            backend = _REGISTRY.get(rule.backend)
            if rule.applies(head_dim, needs_grad) and _fits_auto(backend, device, dtype, head_dim, needs_grad, call_flops):
                return backend
        raise NotImplementedError(f"no registered backend runs device={device!r}, dtype={dtype}, head_dim={head_dim}")
    backend = get_backend(name)
    reason = backend.caps.why_not(device, dtype, head_dim, needs_grad)
    if reason is not None:
        hint = f"; backends with a backward here: {_with_backward(device, dtype, head_dim)}" if needs_grad else ""
        raise NotImplementedError(f"backend={name!r} cannot run this case: {reason}{hint}")
    if not backend.available():
        backend.require()
    return backend


def forward_stack(backend: AttentionBackend, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, scale: float):
    """``q`` (B, Sq, H, D) against G K/V blocks of one length, ``k_blocks``/``v_blocks``
    (G, B, Sk, Hk, D); returns ``outs`` (G, B, Sq, H, D) and ``lses`` (G, B, Sq, H), the blocks'
    partial results before merging (forward only).

    One kernel call where the adapter has a ``forward_stack`` method (the G blocks folded into the
    batch: G times the thread blocks of one short call, which fills the GPU), else one call per block.
    """
    own = getattr(backend, "forward_stack", None)
    if own is not None:
        return own(q, k_blocks, v_blocks, scale)
    parts = [backend.forward(q, kb, vb, scale) for kb, vb in zip(k_blocks, v_blocks)]
    return torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts])


def folded_forward_stack(
    backend: AttentionBackend, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, scale: float,
    copy_q: bool = False,
):
    """``forward_stack`` for kernels that take any batch: the G blocks become G x B batch entries,
    ``q`` repeated by a stride-0 view (a kernel that needs contiguous inputs copies it), or by a
    copy with ``copy_q`` for a kernel that must not be handed a zero batch stride."""
    g, b = k_blocks.shape[:2]
    qs = q.unsqueeze(0).expand(g, *q.shape).reshape(g * b, *q.shape[1:])
    if copy_q:
        qs = qs.contiguous()
    out, lse = backend.forward(qs, k_blocks.reshape(g * b, *k_blocks.shape[2:]),
                               v_blocks.reshape(g * b, *v_blocks.shape[2:]), scale)
    return out.unflatten(0, (g, b)), lse.unflatten(0, (g, b))


class KernelAttention(torch.autograd.Function):
    """Attention of one block through a backend, with the backend's own backward.

    Returns ``(out, lse)``; ``lse`` is not differentiable (a gradient reaching it raises).
    """

    @staticmethod
    def forward(ctx, q, k, v, backend: AttentionBackend, scale: float):
        out, lse = backend.forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.scale = backend, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dlse is not None:
            raise NotImplementedError("backpropagating through the returned log-sum-exp is not supported")
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            return None, None, None, None, None
        dq, dk, dv = ctx.backend.backward(dout, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None, None
