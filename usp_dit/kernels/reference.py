"""Pure-PyTorch reference attention: any device, float64-capable, returns LSE, has a backward.

Layout: q (B, Sq, H, D); k, v (B, Sk, Hk, D), H % Hk == 0; lse (B, Sq, H) float32 (float64 for float64 inputs).
Computes in float64 for float64 inputs and in float32 otherwise (bf16/fp16 inputs are upcast), so
it is the yardstick the fast kernels are measured against. It forms the full score matrix: use it
for tests and small shapes, not for speed.
"""
from __future__ import annotations

import torch

from usp_dit.kernels.protocol import BackendCaps, lse_dtype
from usp_dit.kernels.registry import register_backend


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, S, H, D) -> (B, Hk, G, S, D) so that group g of K/V head j is query head j*G+g."""
    b, s, h, d = q.shape
    return q.view(b, s, num_kv_heads, h // num_kv_heads, d).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """(B, Hk, G, S, D) -> (B, S, Hk*G, D)."""
    b, hk, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)


def _probs(q, k, scale, lse=None, causal=False, key_mask=None):
    """Scores and probabilities in the accumulation dtype: (B, Hk, G, Sq, Sk); ``causal`` masks
    keys after the query (top-left aligned: key j visible to query i when j <= i); ``key_mask``
    (B, Sk) bool masks the keys that are False (a row with no key left: p 0, lse -inf)."""
    acc = lse_dtype(q.dtype)
    qg = _grouped(q.to(acc), k.shape[2])
    kt = k.to(acc).permute(0, 2, 3, 1).unsqueeze(2)  # (B, Hk, 1, D, Sk)
    scores = torch.matmul(qg, kt) * scale
    if causal:
        hidden = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        lse = lse.to(acc).permute(0, 2, 1).reshape(scores.shape[:-1])
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # a row with no key: p 0, not nan
    return torch.exp(scores - finite.unsqueeze(-1)), lse


class ReferenceBackend:
    """The float64-capable yardstick; see the module docstring."""

    name = "reference"
    caps = BackendCaps(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16}),
        max_head_dim=1 << 16,
        supports_backward=True,
        causal=True,
        key_mask=True,
    )

    def available(self) -> bool:
        return True

    def require(self) -> None:
        return None

    def forward(self, q, k, v, scale, causal=False, key_mask=None):
        p, lse = _probs(q, k, scale, causal=causal, key_mask=key_mask)
        vg = v.to(p.dtype).permute(0, 2, 1, 3).unsqueeze(2)  # (B, Hk, 1, Sk, D)
        out = _ungrouped(torch.matmul(p, vg)).to(q.dtype)
        b, hk, g, sq = lse.shape
        lse = lse.permute(0, 3, 1, 2).reshape(b, sq, hk * g).to(lse_dtype(q.dtype))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale, causal=False, key_mask=None):
        acc = lse_dtype(q.dtype)
        hk = k.shape[2]
        p, _ = _probs(q, k, scale, lse, causal, key_mask)
        dog = _grouped(dout.to(acc), hk)  # (B, Hk, G, Sq, D)
        og = _grouped(out.to(acc), hk)
        kg = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)  # (B, Hk, 1, Sk, D)
        vg = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
        dv = torch.matmul(p.transpose(-1, -2), dog).sum(dim=2)  # (B, Hk, Sk, D)
        dp = torch.matmul(dog, vg.transpose(-1, -2))
        delta = (dog * og).sum(dim=-1, keepdim=True)
        ds = p * (dp - delta)
        dq = _ungrouped(torch.matmul(ds, kg) * scale)
        dk = (torch.matmul(ds.transpose(-1, -2), _grouped(q.to(acc), hk)) * scale).sum(dim=2)
        return dq.to(q.dtype), dk.permute(0, 2, 1, 3).to(k.dtype), dv.permute(0, 2, 1, 3).to(v.dtype)


register_backend(ReferenceBackend())
