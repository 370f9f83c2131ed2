"""Causal and block-causal usp_attention in every layout, against a float64 masked reference.

Index maths first, without processes: every layout's shards tile the sequence and each ring block
is increasing; every plan (``usp_dit.attention.masks``) covers exactly the mask (brute force over small
lengths, ring and Ulysses degrees, frames); the per-rank work is balanced (max / mean <= 1.05 at
P = 8 for zigzag and stripe, the issue's bar) and the causal plans make at most two kernel calls
per block pair.

Then one spawned group per world size (2 and 4 gloo ranks here; the 8-rank grids run in
tests/test_world8.py's group of 8, which computes ``run_grid(8)`` beside the families' cases: one
8-rank start-up in CI, not two) runs every 2-D grid of that size, every
layout, causal and block-causal (frames of 3 tokens, which straddle every block edge), both masked
ring schedules, float64 through the reference kernel and float32 through "auto" (PyTorch's CPU
flash kernel), on prime lengths, GQA and MQA, batch 2, and fewer tokens than ranks. Each case
checks out, LSE, dq, dk and dv against ``tests.reference.masked_attention_ref``.

Tolerances (max |err| / max |ref|): float64 1e-10 (only float64 rounding remains); float32 1e-5
(float32 rounding of 16- to 32-long dot products and a few merges stays near 1e-6).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from tests.reference import frame_causal_mask, masked_attention_ref
from usp_dit import gather_sequence, init_usp, shard_sequence, single_rank_mesh, usp_attention
from usp_dit.attention.masks import plan_calls, rank_work, ring_plans, visible_counts
from usp_dit.sharding.layouts import LAYOUTS, block_positions, shard_pieces, shard_sizes
from usp_dit.testing import rel_err, run_spawned_worlds

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


# ---- index maths (no processes) ------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_tiles_the_sequence(layout):
    for seq, ring, ulysses in itertools.product((0, 1, 2, 5, 7, 13, 31, 64), (1, 2, 3, 4, 8), (1, 2, 3)):
        blocks = block_positions(seq, ring, ulysses, layout)
        assert sorted(torch.cat(blocks).tolist()) == list(range(seq)), (seq, ring, ulysses)
        assert all(bool((torch.diff(b) > 0).all()) for b in blocks), "ring blocks must be increasing"
        sizes = shard_sizes(seq, ring, ulysses, layout)
        assert max(sizes, default=0) - min(sizes, default=0) <= 2


def test_zigzag_and_stripe_match_their_definitions_on_a_ring():
    """With U = 1: zigzag rank r holds chunks r and 2P-1-r of 2P; stripe rank r holds i = r mod P."""
    seq, p = 37, 4
    chunks = torch.arange(seq).tensor_split(2 * p)  # sizes differ by at most one, longest first
    for r in range(p):
        zig = block_positions(seq, p, 1, "zigzag")[r]
        assert zig.tolist() == torch.cat([chunks[r], chunks[2 * p - 1 - r]]).tolist()
        assert block_positions(seq, p, 1, "stripe")[r].tolist() == list(range(r, seq, p))


def _mask_from_plan(plan, n_q, n_k):
    covered = torch.zeros(n_q, n_k, dtype=torch.int64)
    for c in plan:
        block = torch.ones(c.q1 - c.q0, c.k1 - c.k0, dtype=torch.int64)
        if c.causal:
            assert c.q1 - c.q0 == c.k1 - c.k0, "causal calls must be square"
            block = block.tril()
        covered[c.q0:c.q1, c.k0:c.k1] += block
    return covered


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plans_cover_the_mask_exactly(layout):
    """Every (query, key) pair the mask shows is computed exactly once, and no other."""
    for seq, ring, ulysses, frame in itertools.product((1, 3, 7, 13, 29, 40), (1, 2, 3, 4), (1, 2), (1, 2, 3, 5)):
        blocks = block_positions(seq, ring, ulysses, layout)
        for r in range(ring):
            for j, plan in enumerate(ring_plans(seq, ring, ulysses, layout, frame, r)):
                qp, kp = blocks[r], blocks[j]
                want = ((kp[None, :] // frame) <= (qp[:, None] // frame)).long()
                assert torch.equal(_mask_from_plan(plan, len(qp), len(kp)), want), (seq, ring, ulysses, frame, r, j)


def test_plan_of_arbitrary_staircases():
    """Random non-decreasing visible counts, with diagonal runs, flats and jumps."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, m = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 30, (1,), generator=g))
        steps = torch.randint(0, 3, (n,), generator=g)
        c = torch.cumsum(steps, 0).clamp(max=m)
        want = (torch.arange(m)[None, :] < c[:, None]).long()
        assert torch.equal(_mask_from_plan(plan_calls(c), n, m), want)


@pytest.mark.parametrize("layout", ["zigzag", "stripe"])
@pytest.mark.parametrize("ulysses", [1, 2])
def test_causal_work_is_balanced(layout, ulysses):
    """max / mean of per-ring-rank attention work <= 1.05 at P = 8 (U = 1: R = 8; U = 2: R = 4),
    for a long even, a prime and a short length; the contiguous layout is far off (about 1.9)."""
    for seq in (131072, 131071, 8 * 1021):
        work = rank_work(seq, 8 // ulysses, ulysses, layout, 1)
        assert max(work) / (sum(work) / len(work)) <= 1.05, (seq, work)
    contiguous = rank_work(131072, 8, 1, "contiguous", 1)
    assert max(contiguous) / (sum(contiguous) / len(contiguous)) > 1.8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_causal_plans_are_few_calls_and_skip_hidden_blocks(layout):
    """At most two kernel calls per block pair (one on the diagonal block); contiguous skips the
    blocks after its own; a causal call wherever a pair is partly hidden."""
    seq, ring = 4099, 8
    for r in range(ring):
        plans = ring_plans(seq, ring, 1, layout, 1, r)
        assert all(len(p) <= 2 for p in plans), [len(p) for p in plans]
        assert len(plans[r]) == 1 and plans[r][0].causal  # the diagonal: one causal call
        if layout == "contiguous":
            assert all(not p for p in plans[r + 1:])


def test_block_causal_counts_match_frames():
    pos = torch.arange(10)
    assert visible_counts(pos, pos, 4).tolist() == [4, 4, 4, 4, 8, 8, 8, 8, 10, 10]
    assert visible_counts(pos, pos, 1).tolist() == list(range(1, 11))


def test_shard_pieces_are_strided_runs():
    assert shard_pieces(10, 2, 1, "stripe")[1] == ((1, 5, 2),)
    assert shard_pieces(10, 2, 1, "zigzag")[0] == ((0, 3, 1), (8, 2, 1))


# ---- one rank ------------------------------------------------------------------------------------

@pytest.mark.parametrize("frame", [1, 3])
@pytest.mark.parametrize("backend", ["reference", "sdpa_cpu"])
def test_single_rank_matches_reference(frame, backend):
    x = _inputs(Shape(2, 29, 4, 2, 16), seed=1)
    mesh = single_rank_mesh()
    errors = _run(x, mesh, torch.float64, backend, frame, "contiguous", "auto")
    assert max(errors.values()) <= TOL[torch.float64], errors


def test_single_rank_causal_is_one_kernel_call(monkeypatch):
    """World 1: causal attention is the kernel's own causal call, nothing around it."""
    from usp_dit.kernels import get_backend

    backend, calls = get_backend("reference"), []
    original = backend.forward
    monkeypatch.setattr(backend, "forward", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    q = torch.randn(1, 9, 2, 8)
    usp_attention(q, q, q, mesh=single_rank_mesh(), backend="reference", causal=True)
    assert calls == [{"causal": True}]


def test_refusals():
    mesh = single_rank_mesh()
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match="layout='diagonal'"):
        usp_attention(q, q, q, mesh=mesh, causal=True, layout="diagonal")
    with pytest.raises(ValueError, match="block_causal=0"):
        usp_attention(q, q, q, mesh=mesh, block_causal=0)
    with pytest.raises(ValueError, match="not both"):
        usp_attention(q, q, q, mesh=mesh, causal=True, block_causal=2)
    with pytest.raises(NotImplementedError, match="joint tokens"):
        usp_attention(q, q, q, mesh=mesh, causal=True, joint_q=q, joint_k=q, joint_v=q)


# ---- grids ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def id(self) -> str:
        return f"b{self.batch}s{self.seq}h{self.heads}kv{self.kv_heads}"


SHAPES = [
    Shape(2, 29, 4, 2, 16),  # prime length, GQA 4:2, batch 2
    Shape(1, 37, 8, 1, 32),  # prime, MQA
    Shape(1, 5, 4, 4, 16),  # fewer tokens than 8 ranks: empty blocks and shards
]
GRIDS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2), (1, 4)], 8: [(8, 1), (4, 2), (2, 4), (1, 8)]}
FRAMES = (1, 3)  # causal; block-causal with frames that straddle every block edge
RUNS = [(torch.float64, "reference"), (torch.float32, "auto")]


@dataclass(frozen=True)
class Case:
    world: int
    ulysses: int
    ring: int
    layout: str
    frame: int
    schedule: str
    dtype: torch.dtype
    backend: str
    shape: Shape

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"w{self.world}-u{self.ulysses}r{self.ring}-{self.layout}-f{self.frame}-{self.schedule}-"
                f"{dt}-{self.shape.id}")


def cases(world: int) -> list[Case]:
    """Every grid x layout x mask x masked schedule x (dtype, backend) x shape; 8 ranks share two
    cores, so there the 8-head MQA shape (the only one U = 8 fits) and the short one (fewer
    tokens than ranks)."""
    shapes = SHAPES if world < 8 else [SHAPES[1], SHAPES[2]]
    return [
        Case(world, u, r, layout, frame, schedule, dtype, backend, shape)
        for (u, r) in GRIDS[world]
        for layout in LAYOUTS
        for frame in FRAMES
        for schedule in (("stream", "gather_merge") if r > 1 else ("auto",))
        for dtype, backend in RUNS
        for shape in shapes
        if u <= shape.heads
    ]


def _inputs(shape: Shape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, s, h, hk, d = shape.batch, shape.seq, shape.heads, shape.kv_heads, shape.head_dim
    sizes = {"q": (b, s, h, d), "k": (b, s, hk, d), "v": (b, s, hk, d), "g": (b, s, h, d)}
    return {n: torch.randn(size, generator=g, dtype=torch.float64) for n, size in sizes.items()}


def _run(x, mesh, dtype, backend, frame, layout, schedule) -> dict[str, float]:
    """Relative errors of out, LSE, dq, dk, dv on this rank against the float64 reference."""
    seq, scale = x["q"].shape[1], x["q"].shape[3] ** -0.5
    ref_in = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v")}
    ref_out, ref_lse = masked_attention_ref(*ref_in.values(), scale, frame_causal_mask(seq, frame))
    ref_grads = torch.autograd.grad((ref_out * x["g"]).sum(), list(ref_in.values()))

    def local(t):
        return shard_sequence(t, mesh, layout=layout)

    leaves = [local(x[n]).to(dtype).clone().requires_grad_() for n in ("q", "k", "v")]
    kwargs = {"causal": True} if frame == 1 else {"block_causal": frame}
    out, _, lse, _ = usp_attention(*leaves, mesh=mesh, backend=backend, return_lse=True, layout=layout,
                                   ring_schedule=schedule, seq_len=seq, **kwargs)
    grads = torch.autograd.grad((out * local(x["g"]).to(dtype)).sum(), leaves)
    errors = {"out": rel_err(out, local(ref_out)), "lse": rel_err(lse, local(ref_lse))}
    errors.update({f"d{n}": rel_err(g, local(r)) for n, g, r in zip("qkv", grads, ref_grads)})
    return errors


def _round_trip(mesh, layout: str) -> str | None:
    """shard then gather gives the tensor back bit for bit; the gradient of each row comes home."""
    x = torch.randn(2, 23, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    full = gather_sequence(shard_sequence(x, mesh, layout=layout), mesh, layout=layout)
    if not torch.equal(full, x):
        return f"{layout}: gather(shard(x)) != x"
    (g,) = torch.autograd.grad((full * torch.arange(23.0, dtype=torch.float64)[None, :, None]).sum(), x)
    # Every rank's loss reads the gathered tensor: each row's gradient is P times its weight,
    # delivered to the rank that holds the row.
    mine = shard_sequence(g, mesh, layout=layout)
    weight = shard_sequence(torch.arange(23.0, dtype=torch.float64)[None, :, None].expand(2, 23, 3), mesh, layout=layout)
    if not torch.equal(mine, weight * mesh.sequence_degree):
        return f"{layout}: gradient of the gathered rows"
    return None


def run_grid(world: int) -> dict[str, object]:
    results: dict[str, object] = {}
    meshes = {}
    for i, case in enumerate(cases(world)):
        key = (case.ulysses, case.ring)
        if key not in meshes:
            meshes[key] = init_usp(ulysses_degree=case.ulysses, ring_degree=case.ring)
            for layout in LAYOUTS:
                results[f"round-trip-w{world}-u{case.ulysses}r{case.ring}-{layout}"] = _round_trip(meshes[key], layout)
        try:
            results[case.id] = _run(_inputs(case.shape, seed=i), meshes[key], case.dtype, case.backend,
                                    case.frame, case.layout, case.schedule)
        except Exception as exc:  # recorded, asserted by the parent
            results[case.id] = f"{type(exc).__name__}: {exc}"
    ring_mesh = meshes[GRIDS[world][-1]]  # ring degree > 1 on every world
    q = shard_sequence(torch.randn(1, 11, 2, 8, generator=torch.Generator().manual_seed(0)), ring_mesh)
    try:
        usp_attention(q, q, q, mesh=ring_mesh, causal=True, ring_schedule="gather_one_call", seq_len=11)
        results["refuse-one-call"] = "no error"
    except NotImplementedError as exc:
        results["refuse-one-call"] = "gather_one_call" in str(exc)
    return results


@pytest.fixture(scope="module")
def grid_results():
    return run_spawned_worlds(run_grid, (2, 4))  # 8: tests/test_world8.py


def assert_case(per_rank: list[dict], case: Case) -> None:
    """Every rank's errors for ``case`` (``run_grid``'s results) within its dtype's tolerance."""
    tol = TOL[case.dtype]
    for rank, res in enumerate(per_rank):
        errors = res[case.id]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {k: v for k, v in errors.items() if not v <= tol}
        assert not worst, f"rank {rank}: errors above {tol}: {worst}"


def assert_round_trips_and_refusals(per_rank: list[dict]) -> None:
    """Every rank's layout round trips exact and the causal one-call schedule refused."""
    for rank, res in enumerate(per_rank):
        failures = {k: v for k, v in res.items() if k.startswith("round-trip") and v is not None}
        assert not failures, f"rank {rank}: {failures}"
        assert res["refuse-one-call"] is True, f"rank {rank}: {res['refuse-one-call']}"


ALL_CASES = cases(2) + cases(4)


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_matches_float64_masked_reference(grid_results, case: Case):
    assert_case(grid_results[case.world], case)


@pytest.mark.parametrize("world", [2, 4])
def test_layout_round_trips_and_refusals(grid_results, world):
    assert_round_trips_and_refusals(grid_results[world])
