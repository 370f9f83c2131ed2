"""DiT-like attention inputs for the FP8 kernels' GPU tests and their length diagnosis (one
distribution, so that the tests' and the benchmark's figures compare).

Layout: q (B, S, H, D), k/v (B, S, Hk, D), bf16.
"""
from __future__ import annotations

import torch


def dit_like_qkv(b: int, s: int, h: int, hk: int, d: int, seed: int = 0,
                 device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V with per-channel offsets and scales, three heavy channels per head in Q and K (scores
    then span about +-10, as trained DiTs' do); drawn from one generator on ``device`` in the order
    Q, K, V, so a seed gives the same tensors on every call."""
    g = torch.Generator(device=device).manual_seed(seed)

    def t(heads: int, heavy: bool) -> torch.Tensor:
        scale = torch.exp(0.5 * torch.randn(heads, d, generator=g, device=device))
        if heavy:
            idx = torch.randint(0, d, (heads, 3), generator=g, device=device)
            scale.scatter_(1, idx, 4.0)
        offset = 0.5 * torch.randn(heads, d, generator=g, device=device)
        return (torch.randn(b, s, heads, d, generator=g, device=device) * scale + offset).bfloat16()

    return t(h, True), t(hk, True), t(hk, False)
