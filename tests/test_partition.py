"""Index maths of sequence and head splits, without processes."""
from __future__ import annotations

import pytest

from usp_dit.sharding.partition import head_plan, offsets, ring_block_sizes, split_sizes


@pytest.mark.parametrize("n,parts", [(0, 1), (1, 4), (3, 4), (13, 4), (17550, 4), (4096, 8), (3969, 6)])
def test_split_sizes_cover_and_balance(n, parts):
    sizes = split_sizes(n, parts)
    assert len(sizes) == parts and sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the longer pieces come first


def test_split_sizes_rejects_bad_input():
    with pytest.raises(ValueError, match="parts"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="n must"):
        split_sizes(-1, 2)


def test_offsets_and_ring_blocks():
    assert offsets([3, 2, 2]) == [0, 3, 5]
    # 4 shards, U=2: ring block 0 = shards 0,1; ring block 1 = shards 2,3
    assert ring_block_sizes([4, 4, 3, 3], 2) == [8, 6]
    assert ring_block_sizes([4, 4, 3, 3], 1) == [4, 4, 3, 3]
    with pytest.raises(ValueError):
        ring_block_sizes([1, 1, 1], 2)


def _check_plan(h, hk, u):
    plan = head_plan(h, hk, u)
    group = h // hk
    covered = [q for lo, hi in plan.q_ranges for q in range(lo, hi)]
    assert covered == list(range(h))  # every query head exactly once, in order
    sizes = [hi - lo for lo, hi in plan.q_ranges]
    for r, ((qlo, qhi), (kvlo, kvhi)) in enumerate(zip(plan.q_ranges, plan.kv_ranges)):
        needed = {q // group for q in range(qlo, qhi)}
        assert set(range(kvlo, kvhi)) == needed  # exactly the K/V heads its queries read
        assert [kvlo + i for i in plan.kv_index[r]] == [q // group for q in range(qlo, qhi)]
        g = plan.kv_group[r]
        if g is not None:
            assert list(plan.kv_index[r]) == [i // g for i in range(qhi - qlo)]
    return plan, sizes


@pytest.mark.parametrize("h,hk,u", [(24, 24, 4), (30, 30, 4), (3, 3, 2), (8, 2, 4), (8, 1, 4), (8, 2, 2), (10, 2, 4), (48, 48, 8), (40, 8, 4)])
def test_head_plan_covers_and_maps(h, hk, u):
    plan, sizes = _check_plan(h, hk, u)
    if hk < u:
        assert max(sizes) - min(sizes) <= 1  # query heads evenly split


def test_head_plan_uneven_and_kv_partition():
    plan, sizes = _check_plan(30, 30, 4)
    assert sizes == [8, 8, 7, 7]
    assert plan.kv_is_partition
    mqa, _ = _check_plan(8, 1, 4)
    assert mqa.kv_ranges == ((0, 1),) * 4 and not mqa.kv_is_partition  # each rank gets the one K/V head
    gqa, _ = _check_plan(8, 2, 4)
    assert gqa.kv_ranges == ((0, 1), (0, 1), (1, 2), (1, 2))  # only the K/V head each rank reads
    odd, _ = _check_plan(10, 2, 4)
    assert None in odd.kv_group  # a rank whose query heads straddle two groups


def test_head_plan_errors_name_the_values():
    with pytest.raises(ValueError, match="num_heads=8.*num_kv_heads=3"):
        head_plan(8, 3, 2)
    with pytest.raises(ValueError, match="ulysses_degree=4 exceeds the number of query heads 3"):
        head_plan(3, 3, 4)


def test_fill_degrees():
    from usp_dit.distributed.config import fill_degrees

    assert fill_degrees(4) == (2, 2, 1)
    assert fill_degrees(4, ring=2, cfg=2) == (1, 2, 2)  # the ring given: Ulysses fills the rest
    assert fill_degrees(4, ulysses=4) == (4, 1, 1)
    assert fill_degrees(3) == (1, 3, 1)
    with pytest.raises(ValueError, match="world_size=4"):
        fill_degrees(4, ulysses=3)
