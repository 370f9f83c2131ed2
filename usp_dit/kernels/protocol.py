"""The attention-kernel protocol: what every backend adapter implements, and its capability flags.

Layout (every backend, both directions):
    q, out, dq: (batch, seq_q, heads, head_dim)
    k, v, dk, dv: (batch, seq_k, kv_heads, head_dim), heads % kv_heads == 0; query head i reads
        K/V head i // (heads // kv_heads) (grouped-query attention)
    causal: an optional keyword of forward and backward (``causal=True``, only where
        ``caps.causal``): the diagonal block of causal attention, seq_q == seq_k, query i attending
        to keys j <= i (top-left and bottom-right alignments agree on a square). Callers pass it only
        when true, so a backend without causal support keeps the four-argument signature.
    key_mask: an optional keyword of forward and backward (``key_mask=...``, only where
        ``caps.key_mask``): (batch, seq_k) bool, True where the key is attended, the same for every
        query and head (a key padding mask: the masked joint tokens of ``usp_dit.attention.masked_joint``). A
        query whose keys are all masked gets out 0 and lse -inf. Passed only when given.
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

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch


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
    causal: bool = False  # takes ``causal=True`` (the square diagonal block of causal attention)
    key_mask: bool = False  # takes ``key_mask=`` (a (batch, seq_k) key padding mask)
    # The largest head_dim of the backward where it is below the forward's (None: ``max_head_dim``).
    max_head_dim_backward: int | None = None

    def why_not(
        self, device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool, causal: bool = False
    ) -> str | None:
        """The reason this backend cannot run the case, or ``None`` when it can."""
        if causal and not self.causal:
            return "it has no causal mode (causal=True)"
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
        if needs_grad and self.max_head_dim_backward is not None and head_dim > self.max_head_dim_backward:
            return f"head_dim={head_dim} has a forward only (backward up to head_dim {self.max_head_dim_backward})"
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

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(out, lse)``: out like ``q``; lse ``(batch, seq_q, heads)`` float32, or
        ``None`` for a backend whose caps say ``returns_lse=False``. ``causal``: see the module
        docstring (passed only when true)."""
        ...

    # Optional: ``forward_out(q, k, v, scale) -> out``, the same attention without computing the
    # LSE, for a call that needs neither the LSE nor a gradient (one rank, no merge). A kernel
    # whose LSE costs work defines it (cuDNN, mem-efficient); ``usp_dit.kernels.autograd.attend_out``
    # falls back to ``forward`` where it is absent.

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
        causal: bool = False,
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
