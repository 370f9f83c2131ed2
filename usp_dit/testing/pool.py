"""A warm group of gloo ranks that runs one test module's job after another (Note [warm pool]).

Layout: no tensors; jobs are module-level functions, results anything picklable.

Note [warm pool]
    A distributed test file spends most of its time starting its ranks: each process imports
    torch, Diffusers, transformers and PEFT (about 10 s of CPU on the CI machine), four of them on
    two cores. With 40 such files that is most of CI's budget. Under pytest (tests/conftest.py
    sets ``USP_DIT_TEST_POOL=1``) ``run_spawned`` therefore hands a job to a pool of ranks kept
    alive between files, one pool per world size (2 and 4), started once per session.

    What a job sees is made to match a fresh process: before each job the environment variables
    are the worker's at start, the default mesh is cleared, torch's seed is its start-up seed, the default dtype float32, autograd on and Dynamo's caches
    reset. What cannot be reset (a module's global state, the process groups init_usp caches) is
    why a job that fails in the pool is run once more in freshly spawned ranks (``run_spawned``):
    the fresh result is the one reported, and a warning says the pool run failed, so a leak
    between jobs shows in the summary instead of failing an unrelated test. A job whose pool
    broke (a rank died by a signal: the heap corruption of Note [a rank killed by a signal]) runs
    once more in a new pool, itself fresh processes that then serve the next jobs; a second
    break falls back to fresh ranks.

    Not pooled: ``check_groups`` jobs' group-leak check needs ``destroy_process_group`` at the end
    of the job, so a pooled job skips it (tests that check teardown ask for ``fresh=True``); a job
    that destroys the default group ends its worker (the pool restarts on the next job).

Note [frozen heap]
    A rank holds ~0.5 M Python objects once torch, Diffusers, transformers and PEFT are imported,
    and every generation-2 garbage collection walks all of them (~0.1-0.3 s each on the CI
    machine; a job that builds models or traces graphs triggers several). ``gc.freeze()`` after
    the imports (a fresh rank) and after each job's collection (a pool rank) moves what is alive
    then into the permanent generation, which collections skip. Objects frozen are still freed
    by reference counting; only reference cycles among them would stay (module state, which
    lives as long as the process anyway).
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import gc
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from usp_dit.distributed.gloo import serialize_gloo_groups

POOL_ENV = "USP_DIT_TEST_POOL"
POOL_WORLDS = (2, 4)
JOB_TIMEOUT_S = 1800.0  # a job past this is a hang: the pool is killed and the job fails
_START_SEED = torch.initial_seed()  # the seed a fresh process starts with


def pool_enabled(world_size: int) -> bool:
    """True when ``run_spawned`` should use a warm pool for a group of ``world_size`` ranks."""
    return os.environ.get(POOL_ENV) == "1" and world_size in POOL_WORLDS


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a group's store or a test server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The first line of a native crash's report (faulthandler, glibc's heap checks): a rank that died
# prints its stacks after it, and the last lines alone would hide what killed it.
FATAL_MARKS = ("Fatal Python error", "malloc(): ", "free(): ", "double free", "corrupted ", "Segmentation fault")


def log_tails(directory: str, world_size: int, lines: int = 30) -> str:
    """The last ``lines`` lines of each rank's stderr, ``directory/rank{r}.log``, and the first
    lines of a native crash's report where there is one (``FATAL_MARKS``)."""
    parts = []
    for rank in range(world_size):
        try:
            with open(os.path.join(directory, f"rank{rank}.log"), errors="replace") as f:
                text = f.read().splitlines()
        except OSError:
            text = ["(no log)"]
        fatal = [i for i, line in enumerate(text) if any(mark in line for mark in FATAL_MARKS)]
        if fatal and fatal[0] < len(text) - lines:
            parts.append(f"--- rank {rank} crash report (from its first line) ---\n" +
                         "\n".join(text[fatal[0]:fatal[0] + 12]))
        parts.append(f"--- rank {rank} stderr (last {lines} lines) ---\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)


class PoolBroken(RuntimeError):
    """A pool worker died, hung or could not send its result: the job's result is unknown.
    ``hung``: the job outlived its time (a new pool would only hang again)."""

    def __init__(self, message: str, hung: bool = False) -> None:
        super().__init__(message)
        self.hung = hung


def _fresh_state(environ: dict[str, str]) -> None:
    """What a fresh process would have (Note [warm pool]); ``environ``: the worker's environment
    at start (a job may have set variables)."""
    from usp_dit.distributed.mesh import set_default_mesh

    os.environ.clear()
    os.environ.update(environ)
    set_default_mesh(None)
    torch.manual_seed(_START_SEED)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch._dynamo.reset()


def _worker(rank: int, world_size: int, port: int, conn, log_path: str) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    os.environ.pop(POOL_ENV, None)  # a job that spawns ranks of its own spawns them fresh
    torch.set_num_threads(1)  # several ranks share two cores
    serialize_gloo_groups()  # Note [gloo all-gather race]: the rank deaths of Note [a rank killed by a signal]
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    environ = dict(os.environ)
    while True:
        try:
            fn = conn.recv()
        except EOFError:  # the parent went away
            break
        if fn is None:
            break
        _fresh_state(environ)
        gc.freeze()  # the modules unpickling the job imported (Note [frozen heap])
        try:
            result = fn()
        except BaseException:  # noqa: BLE001 -- reported to the parent, as run_spawned does
            result = {"__error__": traceback.format_exc()}
        alive = dist.is_initialized()
        try:
            conn.send((result, alive))
        except Exception:  # noqa: BLE001 -- an unpicklable result
            conn.send(({"__error__": traceback.format_exc()}, alive))
        del result
        gc.collect()
        gc.freeze()  # Note [frozen heap]: what outlived the job (its imports) is never scanned again
        if not alive:
            break
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown with live gloo groups (as run_spawned's ranks do)


class WarmPool:
    """``world_size`` gloo ranks waiting for jobs (Note [warm pool])."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.dir = tempfile.mkdtemp(prefix=f"usp_dit_pool{world_size}_")
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            # Not daemonic: a job may start processes of its own (close_pools ends the workers).
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, child, self.log(rank)))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def log(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.log")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[[], Any], timeout_s: float = JOB_TIMEOUT_S) -> list[Any]:
        """``fn()`` on every rank; each rank's result in rank order. Raises ``PoolBroken`` (and
        closes the pool) when a worker dies or the job outlives ``timeout_s``."""
        pickle.dumps(fn)  # an unpicklable job fails here, in the parent, not in a worker
        try:
            for conn in self.conns:
                conn.send(fn)
            deadline = time.monotonic() + timeout_s
            results, still_alive = [], True
            for rank, conn in enumerate(self.conns):
                while not conn.poll(1.0):  # a rank that died (a crash) breaks the pool now, not at the deadline
                    if not self.alive():
                        raise PoolBroken(f"rank(s) {[r for r, p in enumerate(self.procs) if not p.is_alive()]} died")
                    if time.monotonic() > deadline:
                        raise PoolBroken(f"rank {rank} did not finish within {timeout_s:.0f} s", hung=True)
                result, alive = conn.recv()
                results.append(result)
                still_alive = still_alive and alive
        except (EOFError, OSError, BrokenPipeError, PoolBroken) as exc:
            tails = self.tails()
            self.close()
            raise PoolBroken(f"warm pool of {self.world_size} ranks broke: {exc}\n{tails}",
                             hung=getattr(exc, "hung", False)) from exc
        if not still_alive:
            self.close()
        return results

    def tails(self, lines: int = 30) -> str:
        return log_tails(self.dir, self.world_size, lines)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.procs = []


_POOLS: dict[int, WarmPool] = {}


def pool_for(world_size: int) -> WarmPool:
    """The session's pool of ``world_size`` ranks, started (again) if needed."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.procs or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = WarmPool(world_size)
    return pool


@atexit.register
def close_pools() -> None:
    """Stop every pool (pytest's session end, and the parent's exit)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
