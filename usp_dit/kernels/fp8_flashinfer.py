"""The ``fp8_flashinfer`` backend: FlashInfer's Hopper (FA3-template) prefill kernel on e4m3 Q, K
and V, with its LSE; forward only, opt-in, never picked by ``auto``.

Layout: q (B, S, H, D), k/v (B, S, Hk, D) -> out (B, S, H, D) in q's dtype, lse (B, S, H) float32.

Note [fp8 attention, per head]
    FlashInfer's FP8 prefill takes one float32 scale per head for each of Q, K and V
    (``scale_q`` (H,), ``scale_k`` / ``scale_v`` (Hk,)): here s = max|x| / 448 over a batch
    element's tokens and channels of that head (``fp8_quant.head_quant``), so the kernel's scores
    are ``scale * s_q[h] * s_k[h] * (q8 . k8)`` and its LSE is the LSE of exactly these scores
    (base 2 in FlashInfer, converted as in ``usp_dit.kernels.flashinfer``): ring blocks merge
    exactly. A block's K scale depends on the block's keys; the LSE stays that of the scores the
    block used, so the merge is exact to what the blocks computed (as for the ``fp8`` backend's V).
    Per-head scales are coarser than ``fp8``'s per-row ones: a head's heavy token sets the step
    for all of them; e4m3 is a float format (3 mantissa bits at every magnitude down to
    2^-6 of the scale), so only values below about 1/28000 of the head's maximum lose relative
    precision. The error is measured beside ``fp8``'s in docs/FP8.md.

Install: ``pip install flashinfer-python`` and nvcc (it compiles the FP8 kernel on first use), an
sm90 GPU (H100 / H200).
"""
from __future__ import annotations

import torch

from usp_dit.kernels.flashinfer import BUILD, INSTALL, _module, can_build_kernels, prefill_each
from usp_dit.kernels.fp8_quant import head_quant
from usp_dit.kernels.protocol import BackendCaps
from usp_dit.kernels.registry import register_backend


class FP8FlashInferBackend:
    name = "fp8_flashinfer"
    caps = BackendCaps(
        devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}), max_head_dim=256,
        supports_backward=False, head_dims=frozenset({64, 128, 256}), returns_lse=True,
    )

    def available(self) -> bool:
        return (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
                and _module() is not None and can_build_kernels())

    def require(self) -> None:
        if not self.available():
            raise RuntimeError(
                f"backend 'fp8_flashinfer' needs flashinfer-python, nvcc and a GPU of compute capability 9.0+: "
                f"{INSTALL}; {BUILD}"
            )

    def forward(self, q, k, v, scale, causal=False):
        if causal:
            raise NotImplementedError("backend 'fp8_flashinfer' has no causal mode")
        if k.shape[1] == 0:  # no key: out 0 and lse -inf, as every backend
            return torch.zeros_like(q), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        (q8, sq), (k8, sk), (v8, sv) = head_quant(q), head_quant(k), head_quant(v)
        return prefill_each(q8, k8, v8, lambda b: {"scale_q": sq[b], "scale_k": sk[b], "scale_v": sv[b]},
                            o_dtype=q.dtype, sm_scale=scale, backend="fa3")


register_backend(FP8FlashInferBackend())
