"""GroupNorm over row pieces: statistics of the whole image, summed over the ranks.

Layout: (batch, channels, *spatial), rows among the spatial dims (split over the ranks).

``nn.GroupNorm`` normalises each (sample, group) over its channels and every spatial position. A
rank holding some rows sums its part: the sums go through one all-reduce (the mean), then the sums
of squared deviations from that mean (two passes, as stable as the stock kernel), then one more.
Statistics are accumulated in float32 (float64 for float64 input), as the stock kernels do, and
without a float32 copy of the whole activation:

    on CUDA   torch's own kernels for SyncBatchNorm, with (sample, group) as the channel:
              ``batch_norm_stats`` (Welford, float32) of this rank's part, every rank's
              statistics gathered and merged by ``batch_norm_gather_stats_with_counts``, the
              output in one fused ``batch_norm_elemt`` (float32 inside, rounded once);
    elsewhere the two passes in float32 a slice of groups at a time (``_slices``: each float32
              temporary at most an eighth of the activation's own size).

The CPU path runs in the CI's grids; the CUDA path is checked against ``nn.GroupNorm`` by
tests/gpu/test_vae_gpu.py on the lent GPU.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from usp_dit.pipelines.vae.halo import active


def _all_sum(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def _gather_stats(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``t`` (n,) stacked: (ranks, n)."""
    out = t.new_empty((dist.get_world_size(group),) + tuple(t.shape))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def local_stats(norm: torch.nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """CUDA: this rank's (mean, invstd) per (sample, group) and its count, in one float32 vector."""
    b, c, groups = x.shape[0], x.shape[1], norm.num_groups
    mean, invstd = torch.batch_norm_stats(x.reshape(1, b * groups, -1), norm.eps)
    count = torch.full((1,), float(x[0, 0].numel() * (c // groups)), dtype=mean.dtype, device=x.device)
    return torch.cat([mean, invstd, count])


def _group_norm_cuda(norm: torch.nn.GroupNorm, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The CUDA path (module docstring): SyncBatchNorm's kernels over (sample, group) channels."""
    b, c, groups = x.shape[0], x.shape[1], norm.num_groups
    x = x.contiguous()
    every = _gather_stats(local_stats(norm, x), group)
    k = b * groups
    stats = every[:, :k]  # (its first argument gives only the dtype the counts must have: float32)
    mean, invstd = torch.batch_norm_gather_stats_with_counts(
        stats, stats, every[:, k:2 * k], None, None, 0.0, norm.eps, every[:, -1])
    per_channel = (lambda t: t.view(b, groups, 1).expand(b, groups, c // groups).reshape(b * c))
    weight = norm.weight.to(mean.dtype).repeat(b) if norm.affine else None  # float32, as the kernel
    bias = norm.bias.to(mean.dtype).repeat(b) if norm.affine else None  # takes it beside float32 stats
    out = torch.batch_norm_elemt(x.view(1, b * c, -1), weight, bias, per_channel(mean), per_channel(invstd), norm.eps)
    return out.view(x.shape)


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
    if x.is_cuda:
        return _group_norm_cuda(norm, x, rows.group)
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
