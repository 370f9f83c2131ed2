"""The control plane: how rank 0 tells every rank what to run, how the ranks agree on a request's
fate, and how a dead or frozen rank is noticed.

Layout: no model tensors; small CPU int64 tensors and pickled descriptors over gloo.

Note [control plane]
    Three CPU (gloo) process groups besides the data plane (the pipeline's own collectives):

    * control, with a timeout of 30 days: rank 0 broadcasts each message (``run`` a batch,
      ``heartbeat`` when idle, ``stop``) with ``broadcast_object_list``; the other ranks wait for it
      there, so an idle rank waits in a collective that cannot time out instead of in a data-plane
      collective whose watchdog would kill it after minutes (cache-dit #531). The ranks also agree
      on a request's fate over it (``agree``, below).
    * heartbeat, with a deadline (``--heartbeat-timeout``, 5 s): a thread on every rank all-reduces
      a counter once a second. A rank that died or froze makes the others' all-reduce fail within
      the deadline; each rank then takes its failure path (rank 0 answers every request with an
      error and exits 1; the others exit 1), and torchrun stops whatever is left.

    Agreement, per request: at the end of every denoising step each rank all-reduces (MAX) the flags
    [failed, cancel, done] over the control group: rank 0 contributes the cancel flag, a rank whose
    pipeline raised contributes failed = done = 1 once, at its failure, and the ranks that finish
    contribute done = 1 at the end. A rank stops taking part after the first agreement in which any
    flag is set, so every rank makes the same number of all-reduces and sees the same outcome:

        step 0      step 1            (rank 1 raises between step 1's end and its agreement)
        [0,0,0] ... rank 0: [0,0,0]   -> MAX [1,0,1]: rank 0 leaves its pipeline (a peer failed)
                    rank 1: [1,0,1]   -> rank 1 was already out: both report the failure

    A rank that raises while its peers wait in a data-plane collective (inside the transformer)
    leaves them waiting there: that is a hang, caught by rank 0's progress deadline (``--hang-timeout``).
"""
from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = datetime.timedelta(days=30)  # an idle server waits here: no timeout in practice


class Control:
    """The control and heartbeat groups of one job (every rank builds it, in the same order)."""

    def __init__(self, heartbeat_timeout_s: float = 5.0):
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = self.heartbeat_group = None
        if self.world > 1:
            self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
            self.heartbeat_group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=heartbeat_timeout_s))

    def barrier(self) -> None:
        """Every rank is here (no deadline): before the heartbeats start, so that a rank still loading
        its weights does not miss the first beats' deadline."""
        if self.world > 1:
            dist.barrier(group=self.group)

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0's ``message`` on every rank (a small picklable object)."""
        if self.world == 1:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree(self, failed: bool, cancel: bool, done: bool) -> tuple[bool, bool, bool]:
        """The MAX over ranks of the three flags (Note [control plane])."""
        flags = torch.tensor([int(failed), int(cancel), int(done)], dtype=torch.int64)
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1]), bool(flags[2])

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (small, picklable), in rank order, on every rank."""
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out


class Heartbeat:
    """Note [control plane]: a daemon thread all-reducing a counter over the heartbeat group.

    ``on_failure(message)`` runs once, in the thread, when the all-reduce fails (a peer died or
    froze past the group's deadline) and ``stopping`` was not set; ``check()`` runs each beat (rank
    0's progress deadline) and may return a failure message too.
    """

    def __init__(self, control: Control, on_failure: Callable[[str], None],
                 check: Callable[[], str | None] = lambda: None, period_s: float = 1.0):
        self.control, self.on_failure, self.check, self.period_s = control, on_failure, check, period_s
        self.stopping = threading.Event()
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name="usp_dit-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            problem = self.check()
            if problem is None and self.control.world > 1:
                try:
                    dist.all_reduce(torch.ones(1), group=self.control.heartbeat_group)
                    self.beats += 1
                except Exception as err:  # a closed connection or the deadline: a peer is gone
                    problem = f"a rank stopped answering the heartbeat ({type(err).__name__}: {err})"
            if problem is not None:
                if not self.stopping.is_set():
                    self.on_failure(problem)
                return
            time.sleep(self.period_s)
