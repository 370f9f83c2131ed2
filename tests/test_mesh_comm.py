"""Mesh coordinates, uneven all-to-all, ring exchange and sharding on 4 CPU ranks (one spawned group).

Each check returns a value computed on its rank; the parent asserts on all ranks' values. Exact
equality is asserted where data is only moved (no arithmetic), so the tolerance there is zero.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from usp_dit import gather_sequence, init_usp, set_default_mesh, shard_sequence, usp_attention
from usp_dit.distributed.comm import A2APlan, RingExchanger, heads_to_seq, seq_to_heads
from usp_dit.distributed.gloo import gloo_threads
from usp_dit.distributed.mesh import release_groups, resolve_mesh
from usp_dit.sharding.partition import head_plan, split_sizes
from usp_dit.testing import assert_no_crash, run_spawned

WORLD = 4


def _coords():
    out = {}
    for u, r, c in [(2, 2, 1), (4, 1, 1), (1, 4, 1), (2, 1, 1), (1, 2, 2), (1, 1, 1)]:
        m = init_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        out[(u, r, c)] = (m.dp_degree, m.dp_rank, m.cfg_rank, m.ring_rank, m.ulysses_rank, m.seq_rank)
    return out


def _degree_error():
    try:
        init_usp(ulysses_degree=3)
    except ValueError as exc:
        return str(exc)
    return None


def _missing_mesh_error():
    set_default_mesh(None)
    try:
        resolve_mesh(None)
    except ValueError as exc:
        return str(exc)
    return None


def _a2a_round_trip():
    """seq_to_heads then heads_to_seq gives back x bit for bit; adjointness with overlapping heads."""
    mesh = init_usp(ulysses_degree=4)
    g = torch.Generator().manual_seed(1)
    results = {}
    for seq, heads, kv in [(13, 30, 30), (3, 5, 5), (9, 8, 1), (17, 10, 2)]:
        sizes = tuple(split_sizes(seq, 4))
        plan = head_plan(heads, kv, 4)
        x_full = torch.randn(2, seq, kv, 5, generator=g, dtype=torch.float64)
        y_full = torch.randn(2, seq, heads, 5, generator=g, dtype=torch.float64)
        x = shard_sequence(x_full, mesh)
        qp = A2APlan(mesh.ulysses_group, mesh.ulysses_rank, sizes, plan.q_ranges, heads)
        kvp = A2APlan(mesh.ulysses_group, mesh.ulysses_rank, sizes, plan.kv_ranges, kv)
        y = shard_sequence(y_full, mesh)
        round_trip = torch.equal(heads_to_seq(seq_to_heads(y, qp), qp), y)
        # <S x, z> == <x, S^T z> summed over ranks, with S = seq_to_heads on (possibly shared) K/V heads
        z = torch.randn(2, seq, *seq_to_heads(x, kvp).shape[2:], generator=g, dtype=torch.float64)
        lhs = torch.tensor([(seq_to_heads(x, kvp) * z).sum().item()], dtype=torch.float64)
        rhs = torch.tensor([(x * heads_to_seq(z, kvp)).sum().item()], dtype=torch.float64)
        dist.all_reduce(lhs)
        dist.all_reduce(rhs)
        results[(seq, heads, kv)] = (round_trip, abs(lhs.item() - rhs.item()) / abs(lhs.item()))
    return results


def _ring_pass():
    mesh = init_usp(ring_degree=4)
    ex = RingExchanger(mesh.ring_group)
    send = torch.full((3,), float(dist.get_rank()))
    recv = torch.empty(3)
    ex.wait(ex.start(send, recv))
    return recv.tolist()


def _sharding():
    mesh = init_usp(ulysses_degree=2, ring_degree=2)
    ok = []
    for n in range(0, 10):
        x = torch.randn(2, n, 3, generator=torch.Generator().manual_seed(n))
        local = shard_sequence(x, mesh)
        ok.append(torch.equal(gather_sequence(local, mesh), x) and torch.equal(gather_sequence(local, mesh, seq_len=n), x))
        ok.append(local.shape[1] == split_sizes(n, 4)[mesh.seq_rank])
    # dim other than 1
    x = torch.randn(5, 3, 7, generator=torch.Generator().manual_seed(0))  # same on every rank
    ok.append(torch.equal(gather_sequence(shard_sequence(x, mesh, dim=2), mesh, dim=2), x))
    # backward of gather: every rank's loss reads the gathered tensor -> shard gets the sum over ranks
    x = torch.arange(6.0).reshape(1, 6, 1)
    local = shard_sequence(x, mesh).clone().requires_grad_()
    full = gather_sequence(local, mesh)
    (full * (dist.get_rank() + 1)).sum().backward()
    ok.append(torch.equal(local.grad, torch.full_like(local, 1.0 + 2 + 3 + 4)))
    try:
        gather_sequence(shard_sequence(torch.zeros(1, 7, 1), mesh), mesh, seq_len=11)  # wrong on every rank
        ok.append(False)
    except ValueError as exc:
        ok.append("seq_len=11" in str(exc))
    return ok


def _seq_len_mismatch():
    mesh = init_usp(ring_degree=4)
    q = torch.randn(1, 3, 2, 8)
    try:
        usp_attention(q, q, q, mesh=mesh, seq_len=20)  # 20 tokens give every rank 5, not 3
    except ValueError as exc:
        return str(exc)
    return None


def _worker():
    res = {"coords": _coords(), "degree_error": _degree_error(), "a2a": _a2a_round_trip(), "ring": _ring_pass(),
           "sharding": _sharding(), "missing_mesh": _missing_mesh_error()}
    res["seq_len_mismatch"] = _seq_len_mismatch()
    res["timeouts"] = _group_timeouts()
    res["gloo_threads"] = _group_threads()
    res["released"] = _released_mesh()  # last: it releases every mesh built above
    return res


@pytest.fixture(scope="module")
def results():
    res = run_spawned(_worker, WORLD, fresh=True)  # it checks teardown (release_groups)
    assert_no_crash(res)
    return res


def test_mesh_coordinates(results):
    for rank, r in enumerate(results):
        c = r["coords"]
        # (dp_degree, dp_rank, cfg_rank, ring_rank, ulysses_rank, seq_rank); ulysses innermost
        assert c[(2, 2, 1)] == (1, 0, 0, rank // 2, rank % 2, rank)
        assert c[(4, 1, 1)] == (1, 0, 0, 0, rank, rank)
        assert c[(1, 4, 1)] == (1, 0, 0, rank, 0, rank)
        assert c[(2, 1, 1)] == (2, rank // 2, 0, 0, rank % 2, rank % 2)  # leftover ranks: data parallel
        assert c[(1, 2, 2)] == (1, 0, rank // 2, rank % 2, 0, rank % 2)
        assert c[(1, 1, 1)] == (4, rank, 0, 0, 0, 0)


def test_degree_errors(results):
    for r in results:
        assert "world_size=4 is not a multiple of" in r["degree_error"]
        assert "call usp_dit.init_usp" in r["missing_mesh"]


def test_uneven_all_to_all_is_exact_and_adjoint(results):
    for r in results:
        for key, (round_trip, adjoint_err) in r["a2a"].items():
            assert round_trip, key
            assert adjoint_err < 1e-12, key  # float64 sums of a few hundred products


def test_ring_passes_to_next_rank(results):
    for rank, r in enumerate(results):
        assert r["ring"] == [float((rank - 1) % WORLD)] * 3


def test_shard_gather_round_trip_bitwise(results):
    for r in results:
        assert all(r["sharding"]), r["sharding"]


def test_seq_len_mismatch_raises(results):
    for r in results:
        msg = r["seq_len_mismatch"]
        assert "seq_len=20" in msg and all(f"rank {i} holds 3 (expected 5)" in msg for i in range(4)), msg


def _group_timeouts():
    mesh = init_usp(ulysses_degree=2, ring_degree=2)
    groups = [mesh.ulysses_group, mesh.ring_group, mesh.seq_group]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def test_mesh_groups_inherit_the_job_timeout(results):
    """run_spawned starts the job with a 120 s timeout; the mesh's groups must not fall back to 30 min."""
    for r in results:
        assert r["timeouts"] == [120.0, 120.0, 120.0], r["timeouts"]


def _group_threads():
    mesh = init_usp(ulysses_degree=2, ring_degree=2)
    groups = [None, mesh.ulysses_group, mesh.ring_group, mesh.seq_group, mesh.cfg_group]
    return [gloo_threads(g) for g in groups]


def test_gloo_groups_run_one_collective_at_a_time(results):
    """Note [gloo all-gather race]: the default group (the test ranks') and every mesh group run
    on one gloo worker thread, so two all-gathers posted together never run at once."""
    for r in results:
        assert r["gloo_threads"] == [1, 1, 1, 1, 1], r["gloo_threads"]


def _released_mesh():
    mesh = init_usp(ulysses_degree=2, ring_degree=2)
    _ = mesh.ring_exchanger  # cached: it holds the ring group too
    release_groups()
    out = {"fields": (mesh.device_mesh, mesh.seq_mesh, "ring_exchanger" in mesh.__dict__)}
    for name in ("ring_group", "ulysses_rank"):
        try:
            getattr(mesh, name)
        except RuntimeError as exc:
            out[name] = str(exc)
    try:
        resolve_mesh(None)
    except ValueError as exc:
        out["default"] = str(exc)
    fresh = init_usp(ulysses_degree=2, ring_degree=2)  # a new mesh after a release works
    out["fresh"] = (fresh.ring_rank, fresh.ulysses_rank)
    return out


def test_release_groups_lets_go_of_every_mesh_group(results):
    """What runs at exit: released meshes hold no group and refuse to be used (never a silent
    single-rank answer); the default mesh is cleared; a mesh built afterwards works. That no gloo
    thread survives destroy_process_group plus this release is checked by run_spawned (this
    module's group included) wherever check_groups is on."""
    for rank, r in enumerate(results):
        rel = r["released"]
        assert rel["fields"] == (None, None, False)
        assert "release_groups" in rel["ring_group"] and "init_usp" in rel["ulysses_rank"]
        assert "call usp_dit.init_usp" in rel["default"]
        assert rel["fresh"] == (rank // 2, rank % 2)
