"""GroupNorm over row pieces: statistics of the whole image, summed over the ranks.

Layout: (batch, channels, *spatial), rows among the spatial dims (split over the ranks).

``nn.GroupNorm`` normalises each (sample, group) over its channels and every spatial position. A
rank holding some rows sums its part: the sums go through one all-reduce (the mean), then the sums
of squared deviations from that mean (two passes, as stable as the stock kernel), then one more.
Statistics are accumulated in float32 (float64 for float64 input), as the stock kernels do, without
a float32 copy of the whole activation: the sum casts as it reads, the squared deviations are
taken a slice of groups at a time (``_slices``: each float32 temporary at most an eighth of the
activation's own size), and the output is one ``addcmul`` (x * scale + shift, computed in float32
and rounded once, like the stock kernel's).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from usp_dit.pipelines.vae.halo import active


def _all_sum(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def _slices(groups: int, x: torch.Tensor, acc: torch.dtype) -> list[slice]:
    """Slices of groups whose ``acc`` copy takes at most an eighth of ``x``'s bytes."""
    ratio = torch.empty((), dtype=acc).element_size() / x.element_size()  # acc bytes per x byte
    per = max(1, int(groups / (8 * ratio)))
    return [slice(g, min(g + per, groups)) for g in range(0, groups, per)]


def group_norm_forward(norm: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` with statistics over every rank's rows inside a parallel decode, stock outside."""
    rows = active()
    if rows is None:
        return F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    b, c, groups = x.shape[0], x.shape[1], norm.num_groups
    xg = x.reshape(b, groups, c // groups, -1)  # (batch, group, channel in group, position)
    parts = _slices(groups, x, acc)
    count = torch.tensor([float(xg[0, 0].numel())], dtype=acc, device=x.device)
    sums = _all_sum(torch.cat([xg.sum((2, 3), dtype=acc).reshape(-1), count]), rows.group)
    n = sums[-1]
    mean = (sums[:-1] / n).reshape(b, groups, 1, 1)
    squares = torch.cat([(xg[:, s].to(acc) - mean[:, s]).square().sum((2, 3)) for s in parts], 1)
    rstd = torch.rsqrt(_all_sum(squares, rows.group).reshape(b, groups, 1, 1) / n + norm.eps)
    scale, shift = rstd, -mean * rstd  # (batch, group, 1, 1), then per channel with the affine
    if norm.affine:
        weight, bias = norm.weight.to(acc).reshape(1, groups, -1, 1), norm.bias.to(acc).reshape(1, groups, -1, 1)
        scale, shift = scale * weight, shift * weight + bias
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    og = out.view(xg.shape)
    for s in parts:  # computed in float32, rounded once on the way out
        og[:, s] = xg[:, s].to(acc) * scale[:, s] + shift[:, s]
    return out
