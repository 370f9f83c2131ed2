"""SageAttention (``sageattention`` 1.0.x, Triton, INT8 Q·K): forward only, no log-sum-exp.

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D); the kernel reads this "NHD" layout.

Quirks kept here (read off sageattention 1.0.6's ``core.py`` and its Triton kernels):
- 1.0.x returns no LSE at all (``returns_lse=False``), so it cannot take part in a ring merge;
  ``usp_attention`` refuses it when ring_degree > 1 or return_lse=True. With Ulysses only (and at
  world size 1) it is exact to its own quantisation. Its K smoothing (subtracting the mean key)
  shifts every score of a query by the same amount: the output is unchanged, the LSE would not be.
- Its own smoothing (``smooth_k=True``) subtracts the mean *in place* (``k -= km``), which would
  rewrite the caller's K (at world size 1, the model's own tensor): the adapter smooths a copy and
  passes ``smooth_k=False``.
- V runs through fp16: bf16 V is cast to fp16 (finite only below 65504) and P·V is summed in fp16
  over each block of 64 keys (up to 64 x max|V|). The adapter divides each K/V head's V by a power
  of two that brings max|V| to at most 2^9 (64 x 2^9 = 32768 < 65504), and multiplies the output
  back: exact (a power of two; only values some 2^24 below their head's largest reach fp16's
  subnormals), a factor of 1 for ordinary activations, and large values no longer come back as
  inf or NaN (measured on the H200: docs/PERFORMANCE.md, "All kernels side by side").
- It is built for head_dim 64, 96 and 128 only, fp16/bf16 only, and no GQA: K/V are expanded.
- INT8 quantisation makes it approximate: it is never chosen by ``backend="auto"``; ask for it.
"""
from __future__ import annotations

import functools

import torch

from usp_dit.kernels.protocol import BackendCaps, expand_kv, import_optional
from usp_dit.kernels.registry import register_backend

INSTALL = "pip install sageattention==1.0.6"
_V_LIMIT = 2.0 ** 9  # max |V| handed to the kernel: its fp16 block sums of 64 keys stay below 65504


@functools.cache
def _module():
    """The ``sageattention`` module, or ``None`` when it cannot be imported."""
    return import_optional("sageattention")


def fp16_safe_scale(v: torch.Tensor) -> torch.Tensor:
    """Per (batch, K/V head) power of two ``s >= 1`` with ``max|v / s| <= 2^9``, shape (B, 1, Hk, 1).

    Computed on the GPU (no host sync): dividing by a power of two is exact, so for ordinary
    activations (max|V| <= 512) ``s`` is 1 and nothing changes.
    """
    amax = torch.linalg.vector_norm(v, float("inf"), dim=(1, 3), keepdim=True, dtype=torch.float32)
    return torch.exp2(torch.ceil(torch.log2(amax / _V_LIMIT))).clamp_min(1.0)


class SageBackend:
    name = "sage"
    caps = BackendCaps(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=128,
        supports_backward=False,
        head_dims=frozenset({64, 96, 128}),
        returns_lse=False,
        causal=True,
    )

    def available(self) -> bool:
        return torch.cuda.is_available() and _module() is not None

    def require(self) -> None:
        if not self.available():
            raise RuntimeError(f"backend 'sage' needs the sageattention package and a CUDA GPU: {INSTALL}")

    def forward(self, q, k, v, scale, causal=False):
        h = q.shape[2]
        k_smooth = k - k.mean(dim=1, keepdim=True)  # a new tensor: the caller's K stays as it was
        s = fp16_safe_scale(v).to(v.dtype)  # powers of two: exact in fp16 and bf16
        v_safe = v / s
        out = _module().sageattn(
            q.contiguous(), expand_kv(k_smooth, h).contiguous(), expand_kv(v_safe, h).contiguous(),
            tensor_layout="NHD", is_causal=causal, sm_scale=scale, smooth_k=False,
        )
        return out * expand_kv(s, h), None

    def backward(self, *args):
        raise NotImplementedError("backend 'sage' has no backward")


register_backend(SageBackend())
