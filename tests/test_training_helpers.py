"""``usp_dit.training`` helpers: reductions, shared noise, objectives, data items, loud failures.

The distributed part runs in one spawned gloo group of 4 ranks on two meshes: "dp", Ulysses 2 with
two data-parallel replicas (ranks {0, 1} and {2, 3}); "cfg", ring 2 x cfg 2, one replica of all four
ranks spanning the cfg axis too. Each rank records what it saw; the parent asserts.
"""
from __future__ import annotations

import pytest
import torch

from usp_dit import init_usp, single_rank_mesh
from usp_dit.testing import assert_no_crash, run_spawned
from usp_dit.training import (
    broadcast_from_group_leader,
    check_same_on_replica,
    mean_over_data_parallel,
    reduction_groups,
    replica_generator,
    replica_seed,
    sync_grads,
)
from usp_dit.training.data import BadItem, agree_on_replica, list_items, read_latents, stream_index, write_synthetic_latents
from usp_dit.training.objectives import mse_loss, noise_batch, scaled_linear_alphas_cumprod

WORLD = 4


def _raises(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return ""


def _mesh_checks(mesh) -> dict:
    rank = torch.distributed.get_rank()
    value = torch.full((3,), float(rank))
    broadcast_from_group_leader(value, mesh)
    flag = torch.tensor([rank % 2 == 0])
    broadcast_from_group_leader(flag, mesh)
    draw = torch.randn(4, generator=replica_generator(5, mesh, step=3))
    # A model whose second parameter has a gradient on rank 0 only, the third on no rank.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    for p in model[0].parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    if rank == 0:
        for p in model[1].parameters():
            p.grad = torch.full_like(p, 8.0)
    sync_grads(model, mesh)
    grads = [None if p.grad is None else p.grad.flatten()[0].item() for p in model.parameters()]
    replica_only = torch.nn.Linear(1, 1)
    replica_only.weight.grad = torch.full_like(replica_only.weight, float(rank + 1))
    sync_grads([replica_only.weight], mesh, over="replica")
    return {
        "broadcast": value.tolist(), "flag": bool(flag.item()), "draw": draw.tolist(),
        "grads": grads, "replica_grad": replica_only.weight.grad.item(),
        "same_ok": _raises(lambda: check_same_on_replica(torch.ones(5), mesh, "ones")),
        "differs": _raises(lambda: check_same_on_replica(torch.full((5,), float(rank)), mesh, "noise")),
        "dp_mean": mean_over_data_parallel(torch.tensor(float(rank)), mesh).item(),
        "agree": agree_on_replica(rank != 1, mesh),
        "requires_grad": _raises(lambda: broadcast_from_group_leader(torch.ones(1, requires_grad=True), mesh)),
    }


def _spawned() -> dict:
    return {"dp": _mesh_checks(init_usp(ulysses_degree=2)), "cfg": _mesh_checks(init_usp(ring_degree=2, cfg_degree=2))}


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    results = run_spawned(_spawned, WORLD)
    assert_no_crash(results)
    return results


def test_broadcast_takes_each_replica_leaders_value(per_rank):
    # "dp": replicas {0, 1} and {2, 3}; "cfg": one replica of all 4 ranks (leader 0).
    assert [r["dp"]["broadcast"][0] for r in per_rank] == [0.0, 0.0, 2.0, 2.0]
    assert [r["cfg"]["broadcast"][0] for r in per_rank] == [0.0] * 4
    assert [r["dp"]["flag"] for r in per_rank] == [True] * 4  # bool tensors too


def test_replica_generator_same_in_replica_different_across_dp(per_rank):
    draws = [r["dp"]["draw"] for r in per_rank]
    assert draws[0] == draws[1] and draws[2] == draws[3] and draws[0] != draws[2]
    assert all(r["cfg"]["draw"] == per_rank[0]["cfg"]["draw"] for r in per_rank)


def test_sync_grads_is_the_world_mean_and_agrees_on_missing_grads(per_rank):
    for r in per_rank:
        for key in ("dp", "cfg"):
            w, b, w1, b1, w2, b2 = r[key]["grads"]
            assert w == b == pytest.approx(2.5)  # mean of 1, 2, 3, 4
            assert w1 == b1 == pytest.approx(2.0)  # 8 on rank 0, zeros filled in elsewhere
            assert w2 is None and b2 is None  # no gradient anywhere: left alone
    assert [r["dp"]["replica_grad"] for r in per_rank] == pytest.approx([1.5, 1.5, 3.5, 3.5])
    assert [r["cfg"]["replica_grad"] for r in per_rank] == pytest.approx([2.5] * 4)


def test_consistency_check_and_agreement(per_rank):
    for rank, r in enumerate(per_rank):
        for key in ("dp", "cfg"):
            assert r[key]["same_ok"] == ""
            assert "noise differs between the ranks of one model replica" in r[key]["differs"]
            assert "requires grad" in r[key]["requires_grad"]
        assert r["dp"]["agree"] == (rank >= 2)  # rank 1 said no: its replica {0, 1} skips
        assert r["cfg"]["agree"] is False
    assert [r["dp"]["dp_mean"] for r in per_rank] == pytest.approx([1.0, 2.0, 1.0, 2.0])  # ranks 0,2 / 1,3


# ---- single process ------------------------------------------------------------------------


def test_single_rank_helpers_are_no_ops():
    mesh = single_rank_mesh()
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    sync_grads([p], mesh)
    assert p.grad.tolist() == [3.0, 3.0]
    assert broadcast_from_group_leader(torch.ones(2), mesh).tolist() == [1.0, 1.0]
    check_same_on_replica(torch.ones(2), mesh, "x")
    assert reduction_groups(mesh, "world") == []


def test_bad_arguments_raise_value_error():
    mesh = single_rank_mesh()
    with pytest.raises(ValueError, match="over must be one of"):
        sync_grads([], mesh, over="dp")
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        replica_seed(-1, mesh)
    with pytest.raises(ValueError, match="objective must be one of"):
        noise_batch(torch.zeros(1, 2), "v", torch.Generator())
    with pytest.raises(ValueError, match="needs a process group"):
        from usp_dit.training.fsdp import fsdp_device_mesh

        fsdp_device_mesh(mesh)
    with pytest.raises(ValueError, match="kind must be one of"):
        fsdp_device_mesh(mesh, kind="zero3")


def test_objectives_follow_their_formulas():
    x0 = torch.randn(3, 2, 4)
    flow = noise_batch(x0, "flow", torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    noise, t = torch.randn(x0.shape, generator=g), torch.rand(3, generator=g)
    assert torch.allclose(flow.noisy, (1 - t[:, None, None]) * x0 + t[:, None, None] * noise)
    assert torch.allclose(flow.target, noise - x0) and torch.allclose(flow.timestep, t * 1000)
    eps = noise_batch(x0, "epsilon", torch.Generator().manual_seed(1))
    a = scaled_linear_alphas_cumprod()[eps.timestep].float()[:, None, None]
    assert torch.allclose(eps.noisy, a.sqrt() * x0 + (1 - a).sqrt() * eps.target, atol=1e-6)
    assert mse_loss(eps.target, eps.target).item() == 0.0


def test_data_items_and_bad_files(tmp_path):
    paths = write_synthetic_latents(tmp_path, 3, (2, 4, 4, 4), text_shape=(5, 8))
    (tmp_path / "garbage.pt").write_bytes(b"not a tensor")
    torch.save(torch.zeros(4, 4), tmp_path / "flat.pt")
    items = list_items(tmp_path)
    assert len(items) == 5
    clip = read_latents(paths[0])
    assert clip.pixels_or_latents.shape == (2, 4, 4, 4) and clip.prompt_embeds.shape == (5, 8)
    for name, why in (("garbage.pt", "cannot be read"), ("flat.pt", r"shape \(frames, channels, height, width\)")):
        with pytest.raises(BadItem, match=why) as info:
            read_latents(tmp_path / name)
        assert info.value.path == tmp_path / name
    with pytest.raises(ValueError, match="is not a directory"):
        list_items(tmp_path / "missing")
    seen = [stream_index(s, 0, d, 2, 5, seed=0) for s in range(5) for d in range(2)]
    assert sorted(seen) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # two epochs of 5, each a permutation
    assert stream_index(3, 1, 0, 2, 5, 0) == stream_index(4, 0, 0, 2, 5, 0)  # a retry takes the next item
