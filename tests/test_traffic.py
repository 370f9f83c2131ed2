"""Exact traffic: ``usp_dit.planner.volumes`` predicts, ``usp_dit.distributed.traffic`` counts, and they agree.

Unit tests of the prediction by hand (no processes), then ONE spawned group of 4 CPU ranks that
runs ``usp_attention`` under ``count_traffic`` on every grid of 2 and 4 ranks ((2,1) and (1,2) as
data-parallel halves of 4; (4,1), (2,2), (1,4)), every ring schedule forced, forward and forward +
backward, with tiny shapes shaped like the models: Flux (24 heads, joint text), CogVideoX (48
heads, joint text), Wan (40 heads, no joint), GQA / MQA whose head splits are uneven, batch 2,
prime token counts, even blocks (the in-place gather), causal layouts, float32 (and a bfloat16 and
a float64 shape for the LSE's and accumulators' dtypes); then a few 8-rank cases (a ring under
straddling GQA heads). Every kind on every rank
must equal the prediction to the byte (tolerance zero: both sides are integer counts). The call
handshake is counted apart ("handshake") and checked on its own.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from usp_dit import gather_sequence, init_usp, shard_sequence, usp_attention
from usp_dit.distributed import traffic
from usp_dit.distributed.handshake import verified_calls
from usp_dit.distributed.replica import broadcast_from_first_rank
from usp_dit.planner.volumes import CallShape, attention_traffic, gather_traffic, max_traffic, total_bytes
from usp_dit.testing import full_suite, run_spawned_worlds

WORLD = 4
HANDSHAKE_ROW = 3 * 8  # Note [call handshake]: 3 int64 per rank


# ---- the prediction, by hand ------------------------------------------------------------------

def test_symmetric_case_by_hand():
    """B=1, S=64, 8 heads (MHA), D=16, bf16 on (U, R) = (2, 2): every shard 16 tokens, blocks 32.

    Ulysses: per tensor a rank sends its 16 rows of the other rank's 4 heads, 16 * 4 * 16 * 2 =
    2048 bytes, and receives as much; q, k, v, out forward: 4 * 2048. Ring "stream": one block of
    32 tokens x 4 heads of K and V, 2 * 32 * 4 * 16 * 2 = 8192 bytes each way. Backward doubles
    the Ulysses and K/V traffic and passes 2 fp32 accumulators of 32 x 4 x 16: 2 * 8192 * 2.
    """
    shape = CallShape(1, 64, 8, 8, 16, 0, 2)
    for rank in range(4):
        assert attention_traffic(shape, 2, 2, "stream", rank=rank) == {
            "ulysses_a2a": (8192, 8192), "ring_kv": (8192, 8192)}
        assert attention_traffic(shape, 2, 2, "gather_merge", rank=rank) == {
            "ulysses_a2a": (8192, 8192), "ring_gather": (8192, 8192)}
        assert attention_traffic(shape, 2, 2, "stream", rank=rank, backward=True) == {
            "ulysses_a2a": (16384, 16384), "ring_kv": (16384, 16384), "ring_grad": (32768, 32768)}


def test_joint_by_hand():
    """Joint 7 tokens, 24 heads, D 8, fp32 on (2, 2): ring rank r holds split_sizes(7, 2) = [4, 3]
    joint rows, gathered padded to 4 over 2 ring ranks (4 x 12 heads x 8 x 4 bytes), then 7 rows x
    12 padded heads over 2 Ulysses ranks; the backward all-reduces 7 x 24 x 8 x 4 bytes over 4."""
    shape = CallShape(1, 40, 24, 24, 8, 7, 4)
    ring_part, ulysses_part = 4 * 12 * 8 * 4, 7 * 12 * 8 * 4
    joint_out = 7 * 24 * 8 * 4
    for rank in range(4):
        got = attention_traffic(shape, 2, 2, "stream", rank=rank, backward=True)
        assert got["joint_gather"] == (ring_part + ulysses_part,) * 2
        assert got["joint_grad"] == (2 * 3 * joint_out // 4,) * 2


def test_uneven_splits_sum_right():
    """Every byte sent is received by someone: over all ranks, sent == received per kind, for
    uneven shards (prime lengths), uneven head splits (GQA 10:2 on 4, MQA) and joint tokens."""
    shapes = [CallShape(2, 61, 24, 24, 16, 7, 4), CallShape(2, 23, 10, 2, 8, 5, 2), CallShape(1, 29, 6, 1, 8, 3, 8)]
    for shape in shapes:
        for u, r in ((4, 1), (2, 2), (1, 4), (3, 1), (2, 3)):
            for schedule in ("stream", "gather_merge", "gather_one_call"):
                per_rank = [attention_traffic(shape, u, r, schedule, rank=i, backward=True, return_lse=True)
                            for i in range(u * r)]
                for kind in {k for t in per_rank for k in t}:
                    sent = sum(t.get(kind, (0, 0))[0] for t in per_rank)
                    received = sum(t.get(kind, (0, 0))[1] for t in per_rank)
                    if kind != "joint_grad":  # an all-reduce's model volume is per rank, not pairwise
                        assert sent == received, (shape, u, r, schedule, kind)


def test_max_and_total():
    shape = CallShape(2, 61, 24, 24, 16, 7, 4)
    per_rank = [attention_traffic(shape, 2, 2, "stream", rank=i, backward=True) for i in range(4)]
    worst = max_traffic(shape, 2, 2, "stream", backward=True)
    for kind, (s, r) in worst.items():
        assert s == max(t[kind][0] for t in per_rank) and r == max(t[kind][1] for t in per_rank)
    assert total_bytes(per_rank[0]) == sum(s + r for s, r in per_rank[0].values())
    assert total_bytes(per_rank[0], ("ring_kv",)) == sum(per_rank[0]["ring_kv"])
    assert max_traffic(shape, 1, 1, "stream") == {}


@pytest.mark.parametrize("kwargs, name", [
    (dict(schedule="auto"), "schedule"), (dict(rank=4), "rank"), (dict(ulysses=0), "ulysses"),
    (dict(layout="spiral"), "layout"), (dict(shape=CallShape(1, 8, 4, 4, 8, 0, 3)), "dtype_bytes"),
    (dict(ulysses=8, ring=1), "ulysses_degree"),
])
def test_refusals_name_the_argument(kwargs, name):
    args = dict(shape=CallShape(1, 8, 4, 4, 8), ulysses=2, ring=2, schedule="stream", rank=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        attention_traffic(args.pop("shape"), args.pop("ulysses"), args.pop("ring"), args.pop("schedule"), **args)


# ---- the counter, in one process --------------------------------------------------------------

def test_record_without_a_counter_does_nothing():
    assert traffic.ACTIVE is None and not traffic.counting()
    traffic.record("ring_kv", 10, 20)  # nothing active: ignored
    with traffic.count_traffic() as outer:
        traffic.record("ring_kv", 10, 20)
        with traffic.count_traffic() as inner:
            traffic.record_all_gather("seq_gather", 5, 4)
            traffic.record_all_reduce("joint_grad", 10, 4)
        traffic.record("broadcast", 0, 0)  # moves nothing: not listed
        with pytest.raises(ValueError, match="kind='ring'"):
            traffic.record("ring", 1, 1)
    assert traffic.ACTIVE is None
    assert inner.by_kind() == {"seq_gather": (15, 15), "joint_grad": (15, 15)}
    assert outer.by_kind() == {"joint_grad": (15, 15), "ring_kv": (10, 20), "seq_gather": (15, 15)}
    assert outer.total() == (40, 50)


def test_traced_code_is_not_counted_and_not_recompiled():
    """Under torch.compile the check folds away: nothing is counted inside the graph, and entering
    count_traffic does not recompile (the graph never reads the counter)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def step(x):
        if traffic.counting():
            traffic.record("ring_kv", x.numel(), x.numel())
        return x + 1

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="eager")
    compiled(torch.ones(3))
    with traffic.count_traffic() as t:
        compiled(torch.ones(3))
        step(torch.ones(3))  # eager: counted
    assert t.by_kind() == {"ring_kv": (3, 3)}
    assert counters["stats"]["unique_graphs"] == 1


# ---- counted == predicted on a 4-rank group ----------------------------------------------------

@dataclass(frozen=True)
class Model:
    name: str
    shape: CallShape
    return_lse: bool


MODELS = [
    Model("flux", CallShape(1, 61, 24, 24, 16, 7, 4), True),  # 61 image + 7 text tokens
    Model("cogvideox", CallShape(1, 53, 48, 48, 8, 11, 4), False),  # head_dim 64 scaled to 8
    Model("wan", CallShape(1, 59, 40, 40, 8, 0, 4), False),
    Model("gqa", CallShape(2, 23, 10, 2, 8, 5, 4), True),  # 10:2 on 4 ranks: straddling groups
    Model("mqa", CallShape(2, 29, 6, 1, 8, 0, 4), False),  # 6 heads on 4 ranks: 2, 2, 1, 1
    Model("even", CallShape(1, 32, 8, 8, 8, 4, 4), False),  # equal blocks: the in-place gather
    # The LSE and the ring's gradient accumulators: float32 under bfloat16, float64 under float64.
    Model("bf16", CallShape(2, 37, 12, 4, 8, 5, 2), True),
    Model("f64", CallShape(1, 31, 6, 3, 8, 3, 8), True),
]
DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
GRIDS = [(2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]
SCHEDULES = ("stream", "gather_merge", "gather_one_call")


@dataclass(frozen=True)
class Case:
    model: Model
    ulysses: int
    ring: int
    schedule: str
    backward: bool
    layout: str = "contiguous"
    causal: bool = False
    world: int = WORLD

    @property
    def id(self) -> str:
        mask = "-causal" if self.causal else ""
        return (f"w{self.world}-{self.model.name}-u{self.ulysses}r{self.ring}-{self.schedule}-"
                f"{'fwdbwd' if self.backward else 'fwd'}-{self.layout}{mask}")


def _cases() -> list[Case]:
    dense = [
        Case(model, u, r, schedule, backward)
        for model in MODELS for (u, r) in GRIDS
        for schedule in (SCHEDULES if r > 1 else ("stream",)) for backward in (False, True)
    ]
    wan = MODELS[2]
    causal = [  # a mask changes what is computed, not what travels; only the shard sizes move
        Case(wan, u, r, schedule, True, layout, causal=True)
        for (u, r) in ((2, 2), (1, 4)) for schedule in ("stream", "gather_merge") for layout in ("zigzag", "stripe")
    ]
    layouts = [Case(MODELS[0], 2, 2, "gather_one_call", True, "zigzag"),
               Case(MODELS[3], 1, 4, "stream", True, "stripe")]
    return dense + causal + layouts


# Eight ranks add what four cannot hold: a ring under a Ulysses split whose query heads straddle
# K/V groups (GQA 10:2 on U = 4: one K/V copy per query head travels the ring), and longer rings.
EIGHT = [Case(MODELS[3], 4, 2, schedule, True, world=8) for schedule in SCHEDULES] + [
    Case(MODELS[0], 2, 4, "stream", True, world=8), Case(MODELS[1], 1, 8, "gather_merge", True, world=8),
    Case(MODELS[2], 8, 1, "stream", True, world=8), Case(MODELS[5], 4, 2, "gather_one_call", False, world=8),
]
CASES = _cases() + EIGHT
PARAMS = _cases() + [pytest.param(c, marks=pytest.mark.slow, id=c.id) for c in EIGHT]


def _inputs(case: Case, mesh, seed: int) -> dict[str, torch.Tensor]:
    s = case.model.shape
    g = torch.Generator().manual_seed(seed)
    full = {
        "q": (s.batch, s.seq, s.heads, s.head_dim), "k": (s.batch, s.seq, s.kv_heads, s.head_dim),
        "v": (s.batch, s.seq, s.kv_heads, s.head_dim), "g": (s.batch, s.seq, s.heads, s.head_dim),
    }
    if s.joint:
        full.update(joint_q=(s.batch, s.joint, s.heads, s.head_dim), joint_k=(s.batch, s.joint, s.kv_heads, s.head_dim),
                    joint_v=(s.batch, s.joint, s.kv_heads, s.head_dim), g_joint=(s.batch, s.joint, s.heads, s.head_dim))
    x = {name: torch.randn(shape, generator=g).to(DTYPES[s.dtype_bytes]) for name, shape in full.items()}
    for name in ("q", "k", "v", "g"):
        x[name] = shard_sequence(x[name], mesh, layout=case.layout).contiguous()
    for name in ("q", "k", "v", "joint_q", "joint_k", "joint_v"):
        if name in x:
            x[name].requires_grad_(case.backward)
    return x


def _counted_call(case: Case, mesh, seed: int) -> dict[str, tuple[int, int]]:
    """This rank's traffic by kind for one call (forward, and backward when the case has one)."""
    x = _inputs(case, mesh, seed)
    joint = {n: x[n] for n in ("joint_q", "joint_k", "joint_v") if n in x}
    with traffic.count_traffic() as t:
        res = usp_attention(x["q"], x["k"], x["v"], mesh=mesh, backend="reference", return_lse=case.model.return_lse,
                            ring_schedule=case.schedule, causal=case.causal, layout=case.layout, **joint)
        if case.backward:
            loss = (res.out * x["g"]).sum()
            if res.joint_out is not None:
                loss = loss + (res.joint_out * x["g_joint"]).sum()
            loss.backward()
    return t.by_kind()


def _other_checks(mesh) -> dict:
    """Handshake skipped inside verified_calls; gather_sequence; a replica broadcast; and a spy
    that must see nothing when no counter is active."""
    out = {}
    s = MODELS[0].shape
    q = shard_sequence(torch.randn(s.batch, s.seq, s.heads, s.head_dim), mesh)
    with traffic.count_traffic() as t, verified_calls(mesh):
        usp_attention(q, q, q, mesh=mesh, backend="reference", seq_len=s.seq)
    out["verified"] = t.by_kind()
    x = shard_sequence(torch.randn(2, 61, 3, dtype=torch.float64), mesh).clone().requires_grad_()
    with traffic.count_traffic() as t:
        gather_sequence(x, mesh).sum().backward()
    out["gather_sequence"] = t.by_kind()
    with traffic.count_traffic() as t:
        broadcast_from_first_rank(torch.ones(5, 7), mesh)
    out["broadcast"] = t.by_kind()
    seen = []
    saved = traffic.record, traffic.nbytes
    traffic.record = lambda *a, **k: seen.append(a)
    traffic.nbytes = lambda *a: seen.append(a) or 0
    try:
        case = Case(MODELS[0], mesh.ulysses_degree, mesh.ring_degree, "stream", True)
        x = _inputs(case, mesh, 0)
        res = usp_attention(x["q"], x["k"], x["v"], joint_q=x["joint_q"], joint_k=x["joint_k"], joint_v=x["joint_v"],
                            mesh=mesh, backend="reference", return_lse=True)
        ((res.out * x["g"]).sum() + res.joint_out.sum()).backward()
        gather_sequence(x["q"], mesh).sum().backward()
    finally:
        traffic.record, traffic.nbytes = saved
    out["calls when off"] = len(seen)
    return out


def run_traffic(world: int) -> dict:
    """Every case on this rank: ``{case id: (seq_rank, counted by kind) or the error text}``."""
    results, meshes = {}, {}
    torch.manual_seed(0)
    for i, case in enumerate(c for c in CASES if c.world == world):
        key = (case.ulysses, case.ring)
        if key not in meshes:
            meshes[key] = init_usp(ulysses_degree=case.ulysses, ring_degree=case.ring)
        mesh = meshes[key]
        try:
            results[case.id] = (mesh.seq_rank, _counted_call(case, mesh, seed=i))
        except Exception as exc:  # recorded, asserted by the parent
            results[case.id] = f"{type(exc).__name__}: {exc}"
    if world == WORLD:
        results["other"] = _other_checks(init_usp(ulysses_degree=2, ring_degree=2))
    return results


@pytest.fixture(scope="module")
def counted_worlds():
    # The 8-rank world only under --full (docs/TESTING.md): the 4-rank world counts every schedule
    # and layout; 8 ranks add deeper rings of the same formulas at ~40 s of CI.
    return run_spawned_worlds(run_traffic, (WORLD, 8) if full_suite() else (WORLD,))


@pytest.fixture(scope="module")
def counted(counted_worlds):
    return counted_worlds[WORLD]


@pytest.mark.parametrize("case", PARAMS, ids=lambda c: c.id)
def test_counted_equals_predicted(counted_worlds, case: Case):
    p = case.ulysses * case.ring
    for rank, res in enumerate(counted_worlds[case.world]):
        got = res[case.id]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        seq_rank, by_kind = got
        assert by_kind.pop("handshake") == ((p - 1) * HANDSHAKE_ROW,) * 2, f"rank {rank}"
        predicted = attention_traffic(case.model.shape, case.ulysses, case.ring, case.schedule, rank=seq_rank,
                                      backward=case.backward, return_lse=case.model.return_lse, layout=case.layout)
        assert by_kind == predicted, f"rank {rank} (sequence rank {seq_rank})"


def test_verified_calls_have_no_handshake(counted):
    shape = replace(MODELS[0].shape, joint=0)
    for rank, res in enumerate(counted):
        got = res["other"]["verified"]
        assert "handshake" not in got
        assert got == attention_traffic(shape, 2, 2, _auto(shape), rank=rank), f"rank {rank}"


def _auto(shape: CallShape) -> str:
    """The schedule "auto" runs for ``shape`` on (2, 2) (what the verified call asked for)."""
    from usp_dit.attention.ring import choose_schedule
    from usp_dit.sharding.partition import ring_block_sizes, split_sizes

    blocks = tuple(ring_block_sizes(split_sizes(shape.seq, 4), 2))
    return choose_schedule("auto", blocks, shape.heads // 2, shape.kv_heads // 2).name


def test_gather_sequence_and_broadcast(counted):
    """gather_sequence of (2, 61, 3) float64 on 4 ranks: pieces padded to 16 rows, 3 of them each
    way (2 x 16 x 3 x 8 bytes each); its backward all-reduces the whole (2, 61, 3) over 4.
    A broadcast of 5 x 7 float32 over the sequence group: the first rank sends 3 copies."""
    piece, whole = 2 * 16 * 3 * 8, 2 * 61 * 3 * 8
    for rank, res in enumerate(counted):
        other = res["other"]
        assert other["gather_sequence"]["seq_gather"] == (3 * piece + 2 * 3 * whole // 4,) * 2
        predicted = gather_traffic(61, 2 * 3 * 8, 2, 2, backward=True)
        assert predicted == {"seq_gather": other["gather_sequence"]["seq_gather"]}
        assert other["gather_sequence"]["handshake"] == (3 * HANDSHAKE_ROW,) * 2
        assert other["broadcast"] == {"broadcast": (3 * 140, 0) if rank == 0 else (0, 140)}


def test_nothing_is_recorded_when_off(counted):
    """With no counter active the call sites neither record nor size a tensor (a spy on
    ``traffic.record`` and ``traffic.nbytes`` saw nothing during a joint call, its backward and a
    gather_sequence)."""
    assert [res["other"]["calls when off"] for res in counted] == [0] * WORLD
