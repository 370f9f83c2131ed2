"""The spawned-group harness's own checks: its gloo-thread counter (in this process), its report of
a rank killed by a signal, the one re-run such a death gets and the none a Python error gets
(2-rank groups), and the warm pool's: a job whose rank dies there runs again in a new pool.
A rank "dies" by ``os.abort()``, what a C++ abort in a gloo thread (or glibc's heap check) does."""
from __future__ import annotations

import datetime
import functools
import os
import sys
import time

import pytest
import torch.distributed as dist

import usp_dit.testing
from usp_dit.testing import _gloo_threads, run_spawned
from usp_dit.testing.pool import POOL_ENV, PoolBroken, pool_for


def test_gloo_thread_count_sees_a_live_group_and_none_after_destroy():
    """run_spawned fails a rank whose gloo threads outlive the job; the counter must see them, or
    that check would pass vacuously (e.g. if torch renamed its threads)."""
    assert not dist.is_initialized()
    before = _gloo_threads()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        # Each gloo thread names itself once it first runs: on a loaded machine (the CI run, other
        # jobs on its two cores) a just-started one can still read 'python3'. Give them a moment.
        alive, deadline = _gloo_threads(), time.monotonic() + 10
        while not alive and time.monotonic() < deadline:
            time.sleep(0.01)
            alive = _gloo_threads()
    finally:
        dist.destroy_process_group()
    assert before == 0
    assert alive >= 1
    assert _gloo_threads() == 0


def _abort_on_rank_one() -> int:
    if dist.get_rank() == 1:
        print("rank one's last words", file=sys.stderr, flush=True)
        os.abort()  # what a C++ std::terminate in a gloo thread does: no Python traceback
    return 0


def test_a_rank_killed_by_a_signal_is_reported_with_its_stderr():
    """A rank that dies by a signal leaves no traceback; run_spawned shows its stderr instead,
    after running the group once more (Note [a rank killed by a signal])."""
    with pytest.warns(RuntimeWarning, match="killed by a signal; running the group once more"):
        with pytest.raises(RuntimeError) as info:
            run_spawned(_abort_on_rank_one, 2, check_groups=False, fresh=True)
    text = str(info.value)
    assert "SIGABRT" in text and "--- rank 1 stderr" in text and "rank one's last words" in text


def _abort_first_time(marker: str) -> int:
    """Rank 1 aborts unless ``marker`` exists (it creates it first): only the first run dies."""
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    return dist.get_rank()


def _raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("a Python error")
    return 0


def test_a_group_killed_once_by_a_signal_is_run_again(tmp_path):
    with pytest.warns(RuntimeWarning, match="SIGABRT"):
        assert run_spawned(functools.partial(_abort_first_time, str(tmp_path / "died")), 2, check_groups=False, fresh=True) == [0, 1]


def test_a_rank_that_raises_is_not_run_again(recwarn):
    results = run_spawned(_raise_on_rank_one, 2, check_groups=False, fresh=True)
    assert "ValueError: a Python error" in results[1]["__error__"]
    assert not [w for w in recwarn if "running the group once more" in str(w.message)]


def _pid_once_alive(marker: str) -> int:
    """``_abort_first_time``, returning this rank's process id."""
    _abort_first_time(marker)
    return os.getpid()


def test_a_job_whose_pool_rank_dies_runs_again_in_a_new_pool_that_serves_on(tmp_path, monkeypatch):
    """Note [warm pool]: the job's result comes from a new pool (other processes than the broken
    one's), with the break in a warning, and the next job runs in that new pool without a start-up."""
    monkeypatch.setenv(POOL_ENV, "1")
    before = [p.pid for p in pool_for(2).procs]
    with pytest.warns(RuntimeWarning, match="the warm pool broke; running the job once more in a new pool"):
        pids = run_spawned(functools.partial(_pid_once_alive, str(tmp_path / "died")), 2)
    assert (tmp_path / "died").exists()
    assert not set(pids) & set(before), (pids, before)
    assert run_spawned(functools.partial(_pid_once_alive, str(tmp_path / "died")), 2) == pids


class _BrokenPool:
    """A pool whose every job breaks it the way ``WarmPool.run`` reports it (no processes)."""

    def __init__(self, hung: bool) -> None:
        self.hung, self.jobs = hung, 0

    def run(self, fn):
        self.jobs += 1
        raise PoolBroken("warm pool of 2 ranks broke: test", hung=self.hung)


@pytest.mark.parametrize("hung, jobs", [(False, 2), (True, 1)], ids=["died", "hung"])
def test_a_broken_pool_is_tried_once_more_unless_the_job_hung(monkeypatch, hung, jobs):
    """A death gets one new pool, then fresh ranks (None); a job that outlived its time goes to
    fresh ranks at once: a new pool would only hang again (and CI would wait twice as long)."""
    pool = _BrokenPool(hung)
    monkeypatch.setattr(usp_dit.testing, "pool_for", lambda world_size: pool)
    with pytest.warns(RuntimeWarning) as seen:
        assert usp_dit.testing._run_pooled(lambda: 0, 2) is None
    assert pool.jobs == jobs
    assert "running the job in fresh ranks" in str(seen[-1].message)
