"""Helpers for distributed tests on CPU: run a grid of cases in one spawned gloo process group.

Process start-up is the slow part of a distributed test, so a test module spawns its ranks once
(``run_spawned``) and each rank runs every case of the module's grid, recording results; the
parent collects them and pytest asserts case by case.
"""
from __future__ import annotations

import datetime
import functools
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[[], Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)  # several ranks share two cores: oversubscription makes runs crawl
    # A bounded timeout turns a rank stuck in a collective (its peer failed) into an error, not a hang.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        result = fn()
    except BaseException:  # report the failure to the parent instead of hanging the others
        result = {"__error__": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run_spawned(fn: Callable[[], Any], world_size: int) -> list[Any]:
    """Run ``fn()`` on ``world_size`` gloo ranks; returns each rank's return value, in rank order.

    ``fn`` must be importable (a module-level function). A rank that raised returns
    ``{"__error__": traceback}``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world_size, _free_port(), out_dir, fn), nprocs=world_size, join=True)
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def run_spawned_worlds(fn: Callable[[int], Any], worlds: tuple[int, ...]) -> dict[int, list[Any]]:
    """``fn(world)`` on ``world`` gloo ranks for each world size (one spawned group each); returns
    ``{world: per-rank results}`` and fails with every crashed rank's traceback.

    ``fn`` must be importable (a module-level function); it receives its group's world size.
    """
    results = {world: run_spawned(functools.partial(fn, world), world) for world in worlds}
    for per_rank in results.values():
        assert_no_crash(per_rank)
    return results


def assert_no_crash(results: list[Any]) -> None:
    """Fail with every crashed rank's traceback (a peer's 'connection closed' hides the real cause)."""
    crashed = [(rank, r["__error__"]) for rank, r in enumerate(results) if isinstance(r, dict) and "__error__" in r]
    if crashed:
        text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in crashed)
        raise AssertionError(f"{len(crashed)} rank(s) crashed:\n{text}")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 for empty tensors), in float64.

    Normalising by the largest reference entry (not element by element) keeps entries near zero
    from turning rounding noise into huge ratios.
    """
    if expected.numel() == 0:
        return 0.0
    diff = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    return diff / scale if scale else diff
