"""``benchmarks/fake_peak.py``'s counter (the planner's HunyuanVideo 1.5 decode figure comes from it):
on fake tensors, the peak of the live bytes its ops create, by hand. Exact byte counts (no tolerance:
sizes are integers); views, in-place results and storages that existed before are not counted."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.fake_peak import LiveBytes

MIB = 2**20


def _region(x: torch.Tensor) -> None:
    a = x * 2  # 4 MiB live
    b = a.view(-1)  # a view: nothing new
    b.add_(1)  # in place: nothing new
    c = torch.cat([a, a])  # 8 MiB more: 12 MiB live, the peak
    del b, c  # back to 4 MiB
    d = a.sum(dim=0)  # 4 KiB
    del a, d


def test_live_bytes_counts_what_the_ops_create():
    with FakeTensorMode():
        x = torch.empty(1024, 1024)  # 4 MiB float32, made before the region: not counted
        tracker = LiveBytes()
        tracker.seen[x.untyped_storage()] = True
        with tracker:
            _region(x)
    assert tracker.peak == 12 * MIB
    assert tracker.live == 0  # every storage the region made was freed
