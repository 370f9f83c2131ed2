"""One batch on every rank: the pipeline call wrapped in the control plane's agreement.

Layout: the batch's output, float32 in [0, 1]: (batch, height, width, 3) images or
(batch, frames, height, width, 3) videos, returned on every rank (rank 0 answers with it).

Every rank runs ``execute`` with the same ``BatchSpec`` (broadcast by rank 0) and gets the same
``Outcome`` kind: done, failed (with the first failing rank's message) or cancelled (Note [control
plane] in ``usp_dit.serve.control``).
"""
from __future__ import annotations

import faulthandler
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from usp_dit.serve import loras
from usp_dit.serve.control import Control
from usp_dit.serve.families import CallShape, run_batch

# A test-only fault: with USP_DIT_SERVE_FAULT_RANK=r (or r1,r2,...) in the environment, global rank r
# raises at the end of the first denoising step of a batch whose prompt contains FAULT_SENTINEL
# (tests/test_serve.py).
FAULT_ENV = "USP_DIT_SERVE_FAULT_RANK"
FAULT_SENTINEL = "usp-dit-fault"


@dataclass(frozen=True)
class BatchSpec:
    """What rank 0 broadcasts for one batch: the shared call shape and each element's prompt and seed."""

    shape: CallShape
    prompts: tuple[str, ...]
    seeds: tuple[int, ...]
    adapters: tuple[tuple[str, str], ...] = ()  # the LoRA registry at dispatch: (name, path) (Note [served LoRA])


@dataclass
class Outcome:
    output: np.ndarray | None = None
    error: str | None = None  # "rank r: Type: message" of the replica's lowest failing rank (r: the global rank)
    cancelled: bool = False


class Cancelled(Exception):
    """Raised on every rank at the same step end when rank 0 asked to cancel."""


class PeerFailed(Exception):
    """Raised on the ranks that did not fail when another rank's pipeline raised."""


class RankFailure(RuntimeError):
    """The control plane itself failed: a rank is gone. Fatal for the server."""


def _inject_fault(rank: int, prompts: tuple[str, ...], step: int) -> None:
    wanted = os.environ.get(FAULT_ENV)
    if wanted and str(rank) in wanted.split(",") and step == 0 and any(FAULT_SENTINEL in p for p in prompts):
        raise RuntimeError(f"injected fault on rank {rank} ({FAULT_ENV})")


def execute(pipe, family: str, tiny: bool, spec: BatchSpec, control: Control,
            cancel_requested: Callable[[], bool] = lambda: False,
            on_step: Callable[[int], None] = lambda step: None, stall_dump_s: float | None = None) -> Outcome:
    """Run ``spec`` on this rank, agreeing with the others after each step and at the end.

    ``cancel_requested`` is read on rank 0 only; ``on_step(i)`` runs at the end of step i, before
    the agreement. Raises ``RankFailure`` when the control plane fails (a peer is gone).
    ``stall_dump_s``: when this rank goes that long without a step end, every thread's Python
    stack goes to its stderr (``faulthandler``), so a hang's log says where each rank waits.
    """
    with _stall_dump(stall_dump_s) as rearm:
        return _execute(pipe, family, tiny, spec, control, cancel_requested, on_step, rearm)


class _stall_dump:
    """Arms ``faulthandler.dump_traceback_later`` for the batch; ``rearm()`` restarts its clock."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds

    def rearm(self) -> None:
        if self.seconds:
            faulthandler.dump_traceback_later(self.seconds, repeat=False, file=sys.__stderr__)

    def __enter__(self) -> Callable[[], None]:
        self.rearm()
        return self.rearm

    def __exit__(self, *exc) -> None:
        if self.seconds:
            faulthandler.cancel_dump_traceback_later()


def _execute(pipe, family: str, tiny: bool, spec: BatchSpec, control: Control,
             cancel_requested: Callable[[], bool], on_step: Callable[[int], None],
             rearm: Callable[[], None]) -> Outcome:
    closed = False

    def agree(failed: bool, cancel: bool, done: bool) -> tuple[bool, bool, bool]:
        nonlocal closed
        try:
            flags = control.agree(failed, cancel, done)
        except Exception as err:
            raise RankFailure(f"the control plane failed: {type(err).__name__}: {err}") from err
        closed = any(flags)
        return flags

    def step_end(step: int) -> None:
        rearm()
        on_step(step)
        _inject_fault(control.global_rank, spec.prompts, step)
        failed, cancel, _ = agree(False, control.rank == 0 and cancel_requested(), False)
        if failed:
            raise PeerFailed()
        if cancel:
            raise Cancelled()

    error = None
    try:
        loras.sync(pipe, spec.adapters, spec.shape.lora)  # a no-op while no adapter is registered or loaded
        output = run_batch(pipe, family, tiny, spec.shape, list(spec.prompts), list(spec.seeds), step_end)
    except RankFailure:
        raise
    except Cancelled:
        _release_memory()
        return Outcome(cancelled=True)
    except PeerFailed:
        output = None
    except Exception as err:  # the pipeline raised here: tell the others, once
        output, error = None, f"rank {control.global_rank}: {type(err).__name__}: {err}"
        del err  # its traceback holds the failed call's frames and their tensors
    if output is None:
        _release_memory()
    if not closed:
        failed, _, _ = agree(error is not None, False, True)
    else:
        failed = True  # closed by a step's agreement without a cancel: a failure
    if not failed:
        return Outcome(output=output)
    errors = [e for e in _gather(control, error) if e is not None]
    return Outcome(error=errors[0] if errors else "a rank failed")


def _gather(control: Control, value):
    try:
        return control.gather(value)
    except Exception as err:
        raise RankFailure(f"the control plane failed: {type(err).__name__}: {err}") from err


def _release_memory() -> None:
    """A failed call's tensors go now (Note: no GPU memory held after a failed request)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
