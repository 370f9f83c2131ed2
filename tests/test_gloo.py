"""Gloo groups with one worker thread (Note [gloo all-gather race] in usp_dit/distributed/gloo.py).

In this process, without spawning: groups are built directly on a ``HashStore`` (world size 1),
so the options torch's group factory would pass are checked on the object it gets back. That the
groups of a real 4-rank mesh run on one thread is checked in tests/test_mesh_comm.py; that two
all-gathers in flight then stop corrupting the heap is a stress run, not a CI test
(``benchmarks/stress_gloo.py``; figures in docs/TESTING.md).
"""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from usp_dit.distributed import gloo

c10d = dist.distributed_c10d


@pytest.fixture
def one_thread(monkeypatch):
    """``serialize_gloo_groups()`` installed; torch's own class is put back after the test."""
    base = c10d.ProcessGroupGloo
    monkeypatch.setattr(c10d, "ProcessGroupGloo", base)  # restored at teardown
    assert gloo.serialize_gloo_groups() is True
    return base


def test_groups_built_after_the_call_run_one_worker_thread(one_thread):
    base = one_thread
    built = c10d.ProcessGroupGloo
    assert built is not base and issubclass(built, base)
    torch_default = base(dist.HashStore(), 0, 1, timeout=datetime.timedelta(seconds=5))
    assert torch_default.options._threads == 2  # what torch gives (one device, two threads)
    pg = built(dist.HashStore(), 0, 1, timeout=datetime.timedelta(seconds=7))  # as torch's factory calls it
    assert isinstance(pg, base)  # torch's own isinstance checks still hold
    assert pg.options._threads == 1
    assert pg.options._timeout == datetime.timedelta(seconds=7)  # the group's timeout is kept
    assert len(pg.options._devices) == 1
    x = torch.arange(3.0)
    pg.allreduce([x]).wait()  # a working group
    assert torch.equal(x, torch.arange(3.0))


def test_every_constructor_form_gets_one_thread(one_thread, monkeypatch):
    base, built = one_thread, c10d.ProcessGroupGloo
    positional = built(dist.HashStore(), 0, 1, datetime.timedelta(seconds=9))
    assert (positional.options._threads, positional.options._timeout) == (1, datetime.timedelta(seconds=9))
    options = base._Options()
    options._threads = 4
    options._devices = [base.create_default_device()]
    assert built(dist.HashStore(), 0, 1, options).options._threads == 1  # explicit options: clamped
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")  # torch's rule: one device per named interface
    two = built(dist.HashStore(), 0, 1)
    assert (len(two.options._devices), two.options._threads) == (2, 1)
    with pytest.raises(TypeError, match="unexpected arguments"):
        built(dist.HashStore(), 0, 1, threads=3)


def test_installing_twice_keeps_one_subclass(one_thread):
    built = c10d.ProcessGroupGloo
    assert gloo.serialize_gloo_groups() is True
    assert c10d.ProcessGroupGloo is built


def test_a_torch_without_the_hooks_is_left_as_it_is(monkeypatch):
    class Bare:  # no _Options / create_default_device: nothing to build options with
        pass

    monkeypatch.setattr(c10d, "ProcessGroupGloo", Bare)
    assert gloo.serialize_gloo_groups() is False
    assert c10d.ProcessGroupGloo is Bare


def _torch_class() -> type:
    cls = c10d.ProcessGroupGloo
    return cls.__mro__[1] if getattr(cls, "usp_dit_one_thread", False) else cls


def test_a_mesh_over_a_users_two_thread_default_group_gets_groups_of_its_own(monkeypatch):
    """A user's own ``init_process_group("gloo")`` (torch's two threads) before ``init_usp``: the
    mesh's axes get one-thread groups, even those spanning the world (size 1 here: every axis),
    which DeviceMesh would otherwise hand the default group."""
    from usp_dit import init_usp
    from usp_dit.distributed.mesh import mesh_axes, release_groups

    monkeypatch.setattr(c10d, "ProcessGroupGloo", _torch_class())  # as torch ships it; restored after
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert gloo.gloo_threads() == 2
        mesh = init_usp(ulysses_degree=1)
        axes, seq_axes = mesh_axes(mesh.config)
        groups = [mesh.device_mesh.get_group(a) for a in axes] + [mesh.seq_mesh.get_group(a) for a in seq_axes]
        assert len(groups) == 7
        assert [gloo.gloo_threads(g) for g in groups] == [1] * 7
        assert all(g is not c10d._get_default_group() for g in groups)
        x = torch.arange(4.0)
        dist.all_reduce(x, group=groups[-1])  # the groups work
        assert torch.equal(x, torch.arange(4.0))
    finally:
        release_groups()
        dist.destroy_process_group()
