"""GroupNorm over row pieces: statistics of the whole image, summed over the ranks.

Layout: (batch, channels, *spatial), rows among the spatial dims (split over the ranks).

``nn.GroupNorm`` normalises each (sample, group) over its channels and every spatial position. A
rank holding some rows sums its part; the sums go through one all-reduce, then the sums of squared
deviations from the mean (two passes, as stable as the stock kernel's), then one more. Computed in
float32 (float64 for float64 input) and cast back, as the stock kernels do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from usp_dit.pipelines.vae.halo import active


def _all_sum(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def group_norm_forward(norm: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` with statistics over every rank's rows inside a parallel decode, stock outside."""
    rows = active()
    if rows is None:
        return F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    b, c = x.shape[:2]
    xg = x.reshape(b, norm.num_groups, -1).to(dtype)
    count = torch.tensor([float(xg.shape[-1])], dtype=dtype, device=x.device)
    sums = _all_sum(torch.cat([xg.sum(-1).reshape(-1), count]), rows.group)
    mean = (sums[:-1] / sums[-1]).reshape(b, norm.num_groups, 1)
    var = _all_sum((xg - mean).square().sum(-1), rows.group).reshape(b, norm.num_groups, 1) / sums[-1]
    y = ((xg - mean) * torch.rsqrt(var + norm.eps)).reshape(x.shape)
    if norm.affine:
        shape = (1, c) + (1,) * (x.dim() - 2)
        y = y * norm.weight.to(dtype).reshape(shape) + norm.bias.to(dtype).reshape(shape)
    return y.to(x.dtype)
