"""torchrun job plumbing for the examples: command-line errors, Ctrl-C, start-up, the one-rank check.

Note [a user error under torchrun]
    Every rank parses the same command line, so every rank finds the same bad value. Checked
    before the process group starts and before any weights load, a bad value raises
    ``UsageError``; ``cli_main`` turns it into one line on rank 0 (``error: --height 1000 must be
    a positive multiple of 16 ...``) and exit code 2 on every rank, with no traceback.

    The ranks leave together. torchrun stops every worker (SIGTERM) as soon as it sees the first
    one exit, so a rank 1 that exits before rank 0 has printed would cut rank 0's line off (rank 0
    may still be importing). Under torchrun the ranks therefore meet at the store its agent hosts
    (``MASTER_ADDR:MASTER_PORT``, the one ``init_process_group`` would use) after rank 0 has
    printed, and exit 2 at once: torchrun then reports exit code 2 for the workers. Its own exit
    code is 1, and it prints its own summary of the failed workers (with its ChildFailedError
    traceback): that part belongs to the launcher. The meeting has a deadline, so a rank that did
    not fail (a folder present on one node only) cannot hold the others.

    Ctrl-C ends a rank with exit code 130 (128 + SIGINT, the shell's convention), quietly.
    Under torchrun a terminal's Ctrl-C reaches torchrun alone (each worker runs in a session of
    its own); torchrun sends SIGINT on to every worker, which ends so, then exits 1 with its own
    SignalException traceback: the launcher's, like its ChildFailedError above. A job that a shell
    without job control starts in the background (``cmd &`` in a script) inherits SIGINT ignored,
    so there Ctrl-C raises no KeyboardInterrupt; the examples leave it so (the POSIX convention for
    background jobs).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from usp_dit.distributed.config import fill_degrees
from usp_dit.distributed.gloo import serialize_gloo_groups
from usp_dit.distributed.logs import configure_logging, env_rank, get_logger
from usp_dit.kernels import get_backend, list_backends

EXIT_USAGE = 2  # argparse's and the shells' code for a bad command line
EXIT_INTERRUPTED = 130  # 128 + SIGINT
# A Hugging Face hub id ("org/name"): what --model may be besides a local folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

_R = TypeVar("_R")


# ---------------------------------------------------------------------------------------------
# Note [a user error under torchrun]


class UsageError(ValueError):
    """A bad command-line value; the message names the argument, the value and what is allowed."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors raise ``UsageError`` instead of printing the usage on every rank."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def env_world_size() -> int:
    """The job's world size from torchrun's ``WORLD_SIZE`` (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _exit(code: int) -> NoReturn:
    """End this process with ``code`` and no traceback."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        # A started process group's teardown may wait for peers that are gone: leave at once.
        os._exit(code)
    raise SystemExit(code)


def _leave_together(timeout_s: float = 30.0) -> None:
    """Note [a user error under torchrun]: wait until every rank has come here (at most ``timeout_s``)."""
    world = env_world_size()
    if world == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return  # not torchrun's workers: no agent stops the others early
    try:
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        store = dist.PrefixStore("usp_dit/usage_error", client)
        if store.add("arrived", 1) == world:  # the last to arrive lets everyone go
            store.set("go", "1")
        store.wait(["go"])
    except (RuntimeError, OSError, KeyError, ValueError):
        pass  # no store to meet at, or a rank never came: leave anyway, the error is already out


def report_usage_error(err: UsageError) -> NoReturn:
    """Rank 0 prints ``error: <message>`` on one line; every rank exits with code 2, together."""
    if env_rank() == 0:
        message = " ".join(str(err).split())  # one line, whatever the message held
        print(f"error: {message}", file=sys.stderr, flush=True)
    _leave_together()
    _exit(EXIT_USAGE)


def cli_main(main: Callable[..., _R]) -> Callable[..., _R]:
    """Decorate an example's ``main``: logging on rank 0 only, one-line user errors, quiet Ctrl-C.

    Put torch's ``@record`` above it (``@record`` then ``@cli_main``): a user error or Ctrl-C
    leaves as ``SystemExit``, which ``record`` passes through without writing an error file, while
    any other exception still reaches ``record`` with its traceback.
    """

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> _R:
        configure_logging()
        try:
            return main(*args, **kwargs)
        except UsageError as err:
            report_usage_error(err)
        except KeyboardInterrupt:
            _exit(EXIT_INTERRUPTED)

    return wrapper


def note_single_rank() -> None:
    """Without torchrun, say on one line that the job runs on one rank and how to run it on more."""
    if "WORLD_SIZE" in os.environ:
        return
    script = os.path.basename(sys.argv[0]) or "script.py"
    get_logger().info(f"running on one rank (not started by torchrun); to split the work over N ranks: "
                      f"torchrun --standalone --nproc-per-node N {script} ...")


# ---------------------------------------------------------------------------------------------
# Checks of command-line values, made before anything heavy loads; each raises UsageError.


def check_multiple(flag: str, value: int, multiple: int, why: str) -> None:
    """``value`` must be a positive multiple of ``multiple`` (``why`` says which model needs it)."""
    if value < 1 or value % multiple:
        raise UsageError(f"{flag} {value} must be a positive multiple of {multiple} ({why})")


def check_frames(flag: str, value: int, step: int, why: str, rest: int = 1, least: int = 0) -> None:
    """``value`` must be ``step * k + rest`` for some k >= 0; the message's examples are the first two
    such counts above ``least``."""
    if value < rest or (value - rest) % step:
        first = rest + step * max(1, -(-(least - rest) // step))
        raise UsageError(f"{flag} {value} must be {step}k + {rest}, e.g. {first} or {first + step} ({why})")


def check_at_most(flag: str, value: float, maximum: float, why: str = "") -> None:
    """``value <= maximum``."""
    if value > maximum:
        raise UsageError(f"{flag} {value} must be at most {maximum}" + (f" ({why})" if why else ""))


def check_at_least(flag: str, value: float, minimum: float, why: str = "") -> None:
    """``value >= minimum``."""
    if value < minimum:
        raise UsageError(f"{flag} {value} must be at least {minimum}" + (f" ({why})" if why else ""))


def check_model_path(flag: str, value: str | None, hub_ok: bool = True) -> None:
    """``value`` (None: the tiny built-in model) is an existing path or, if ``hub_ok``, a hub id."""
    if value is None or Path(value).expanduser().exists():
        return
    if hub_ok and _HUB_ID.match(value):
        return
    allowed = "a local folder or a Hugging Face hub id such as org/name" if hub_ok else "a local folder"
    raise UsageError(f"{flag} {value}: no such file or folder (give {allowed})")


def check_folder(flag: str, value: str | None) -> None:
    """``value`` (None: not given) is an existing folder."""
    if value is not None and not Path(value).expanduser().is_dir():
        raise UsageError(f"{flag} {value}: no such folder")


def check_output(flag: str, value: str, suffixes: Sequence[str]) -> None:
    """``value`` ends in one of ``suffixes`` and its folder exists."""
    path = Path(value)
    if path.suffix.lower() not in suffixes:
        raise UsageError(f"{flag} {value} must end in one of {', '.join(suffixes)}")
    if not path.parent.expanduser().is_dir():
        raise UsageError(f"{flag} {value}: folder {str(path.parent)!r} does not exist")


def check_installed(flag: str, value: str, modules: Sequence[str], install: str) -> None:
    """The Python ``modules`` that ``value`` needs can be imported (found, not imported: cheap)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"{flag} {value} needs {' and '.join(missing)}, not installed here: {install}")


def check_backend(flag: str, name: str) -> None:
    """``name`` is "auto" or a registered attention kernel whose package is installed."""
    if name == "auto":
        return
    if name not in list_backends():
        raise UsageError(f"{flag} {name!r} is not a kernel; choose 'auto' or one of {', '.join(list_backends())}")
    try:
        get_backend(name).require()
    except RuntimeError as err:  # the adapter's message, with its install line
        raise UsageError(f"{flag} {name}: {err}") from None


def check_degrees(world: int, ulysses: int | None, ring: int | None, cfg: int = 1) -> tuple[int, int, int]:
    """(ulysses, ring, cfg) filling ``world`` ranks (``usp_dit.distributed.config.fill_degrees``), or UsageError."""
    try:
        return fill_degrees(world, ulysses, ring, cfg)
    except ValueError as err:
        given = [f"--{n} {v}" for n, v in (("ulysses", ulysses), ("ring", ring), ("cfg", cfg)) if v not in (None, 1)]
        raise UsageError(f"{' '.join(given) or 'the degrees'} on {world} rank(s): {err}") from None


def planned_degrees(args, world: int, model: str | None, guided: bool, num_frames: int | None = None) -> tuple[int, int, int]:
    """``--degrees auto``: (ulysses, ring, cfg) from ``usp_dit.plan`` for ``model`` (a planner
    model name, ``None`` when it knows none for this family) at ``args.height`` x ``args.width``;
    sets ``args.ring_schedule`` to the plan's. UsageError when degrees were also given by hand or
    the planner does not know the family."""
    given = [f"--{n} {v}" for n, v in (("ulysses", args.ulysses), ("ring", args.ring), ("cfg", args.cfg)) if v not in (None, 1)]
    if given:
        raise UsageError(f"--degrees auto with {' '.join(given)}: the planner chooses the degrees; give one or the other")
    if model is None:
        raise UsageError("--degrees auto: the planner has no cost model for this family yet; give --ulysses/--ring")
    from usp_dit.planner.plan import plan

    chosen = plan(model, world_size=world, height=args.height, width=args.width, num_frames=num_frames, cfg=guided)
    args.ring_schedule = chosen.ring_schedule
    return chosen.degrees


# ---------------------------------------------------------------------------------------------
# Start-up and the one-rank check


def init_distributed(timeout_minutes: float = 10) -> tuple[int, int, torch.device]:
    """Start the process group (NCCL on GPUs, else gloo) if the job has several ranks.

    Returns ``(rank, world_size, device)``. On CPU the machine's cores are shared out among the
    local ranks, so that one rank's threads do not starve the others.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "gloo":
            serialize_gloo_groups()  # Note [gloo all-gather race]
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, device


# max |diff| / max |one rank| of final images or frames, by the transformer's dtype. float32: the
# sharded transformer differs from one rank's by float32 rounding (~1e-6); denoising steps and an
# untrained VAE (large gain) bring it to ~3e-6 (Flux 1008x1008, 4 steps) .. ~3e-5 (tiny video), so
# 1e-4 leaves room for longer runs. Half precision: rounding of 1e-3 per op, compounded over steps.
MATCH_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def compare_with_one_rank(pipe, run_alone: Callable[[], np.ndarray], result: np.ndarray, rank: int) -> None:
    """Disable USP; rank 0 runs ``run_alone()`` and prints its match with ``result``; the others wait."""
    pipe.disable_usp()
    if rank == 0:
        start = time.perf_counter()
        ref = run_alone()
        diff = float(np.abs(result.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-12))
        tol = MATCH_TOLERANCE[pipe.transformer.dtype]
        verdict = "MATCH" if diff <= tol else "MISMATCH"
        print(f"one rank: {time.perf_counter() - start:.1f} s; max|diff|/max|one rank| = {diff:.2e} "
              f"(tolerance {tol:.0e}): {verdict}", flush=True)
    if dist.is_initialized():
        dist.barrier()
