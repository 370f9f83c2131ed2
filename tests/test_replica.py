"""``usp_dit.distributed.replica`` (communication within one model replica) and ``usp_dit.distributed.groups`` (teardown).

The distributed part runs in one spawned gloo group of 4 ranks on one replica of cfg 2 x ring 2:
rank = cfg_rank * 2 + ring_rank, cfg groups {0, 2} and {1, 3}, sequence groups {0, 1} and {2, 3}.
Each rank records what it saw; the parent asserts. The one-rank and teardown tests run here.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from usp_dit import init_usp, single_rank_mesh
from usp_dit.distributed import groups
from usp_dit.distributed.replica import (
    all_true_on_replica,
    broadcast_from_first_rank,
    comm_device,
    replica_groups,
    same_on_replica,
)
from usp_dit.testing import assert_no_crash, run_spawned

WORLD = 4


def _spawned() -> dict:
    mesh = init_usp(ring_degree=2, cfg_degree=2)
    rank = dist.get_rank()
    values = torch.full((2, 3), float(rank), dtype=torch.float16)
    permuted = torch.tensor([1.0, 2.0]) if rank == 1 else torch.tensor([2.0, 1.0])  # same sum, other order
    return {
        "groups": [dist.get_process_group_ranks(g) for g in replica_groups(mesh)],
        "broadcast": broadcast_from_first_rank(values, mesh),
        "bool": broadcast_from_first_rank(torch.tensor([rank % 2 == 1, True]), mesh),
        "same": same_on_replica(torch.arange(6.0).reshape(2, 3), mesh),
        # Only the cfg group {1, 3} disagrees: every rank must still answer (and answer False).
        "one_cfg_pair_differs": same_on_replica(torch.full((4,), 2.0 if rank == 3 else 1.0), mesh),
        "permuted": same_on_replica(permuted, mesh),
        "all_true": all_true_on_replica(True, mesh),
        "one_false": all_true_on_replica(rank != 3, mesh),
    }


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    results = run_spawned(_spawned, WORLD)
    assert_no_crash(results)
    return results


def test_replica_groups_are_the_cfg_group_then_the_sequence_group(per_rank):
    for rank, r in enumerate(per_rank):
        cfg_rank, ring_rank = divmod(rank, 2)
        assert r["groups"] == [[ring_rank, ring_rank + 2], [2 * cfg_rank, 2 * cfg_rank + 1]]


def test_broadcast_gives_every_rank_the_first_ranks_tensor(per_rank):
    for r in per_rank:
        assert r["broadcast"].dtype == torch.float16 and r["broadcast"].shape == (2, 3)
        assert torch.equal(r["broadcast"], torch.zeros(2, 3, dtype=torch.float16))
        assert r["bool"].dtype == torch.bool and r["bool"].tolist() == [False, True]


def test_checksum_answers_the_same_on_every_rank(per_rank):
    assert [r["same"] for r in per_rank] == [True] * WORLD
    assert [r["one_cfg_pair_differs"] for r in per_rank] == [False] * WORLD
    assert [r["permuted"] for r in per_rank] == [False] * WORLD  # the position-weighted sum sees the order


def test_all_true_on_replica(per_rank):
    assert [r["all_true"] for r in per_rank] == [True] * WORLD
    assert [r["one_false"] for r in per_rank] == [False] * WORLD


def test_one_rank_replica_communicates_nothing():
    mesh = single_rank_mesh()
    x = torch.arange(4.0, requires_grad=True)
    assert replica_groups(mesh) == []
    copy = broadcast_from_first_rank(x, mesh)
    assert torch.equal(copy, x.detach()) and not copy.requires_grad and copy.data_ptr() != x.data_ptr()
    assert same_on_replica(x, mesh) is True
    assert all_true_on_replica(False, mesh) is False
    assert comm_device(mesh, x) == torch.device("cpu")


class _Holder:
    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


class _DeviceMeshLike:
    def __init__(self) -> None:
        self._pg_registry = {"ulysses": object()}


def test_release_groups_clears_caches_then_releases_holders_and_device_meshes(monkeypatch):
    import weakref

    monkeypatch.setattr(groups, "_GROUP_HOLDERS", weakref.WeakSet())
    monkeypatch.setattr(groups, "_DEVICE_MESHES", weakref.WeakSet())
    order: list[str] = []
    monkeypatch.setattr(groups, "_CACHE_CLEARS", [lambda: order.append("cache")])
    holder, device_mesh = groups.hold_groups(_Holder()), groups.register_device_mesh(_DeviceMeshLike())
    groups.release_groups()
    assert order == ["cache"] and holder.released and device_mesh._pg_registry == {}


def test_mesh_registers_its_cache_and_reexports_teardown():
    import usp_dit.distributed.mesh as mesh_module

    assert mesh_module._forget_meshes in groups._CACHE_CLEARS
    assert mesh_module.release_groups is groups.release_groups
    assert mesh_module.register_device_mesh is groups.register_device_mesh


def test_a_released_mesh_refuses_to_answer():
    mesh = single_rank_mesh()
    mesh.release()
    with pytest.raises(RuntimeError, match="release_groups"):
        mesh.seq_group
