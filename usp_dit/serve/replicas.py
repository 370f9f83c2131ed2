"""Rank 0's side of the other model replicas (Note [replicas] in ``usp_dit.serve.control``).

Layout: no tensors; a batch's outcome arrives pickled (``usp_dit.serve.worker.Outcome``: images
(batch, height, width, 3) or videos (batch, frames, height, width, 3), float32 in [0, 1]).

One ``RemoteReplica`` thread per replica r >= 1 takes batches from rank 0's queue and runs each on
replica r through its ``Link``; the leader (``usp_dit.serve.server.Leader``) records progress and
answers the requests exactly as for the batches it runs itself.
"""
from __future__ import annotations

import threading
from typing import Protocol

from usp_dit.serve.control import Link
from usp_dit.serve.jobs import Job, Scheduler
from usp_dit.serve.worker import BatchSpec, Outcome


class Dispatcher(Protocol):
    """What a ``RemoteReplica`` needs of rank 0's leader."""

    sched: Scheduler
    draining_since: float | None

    def spec_of(self, batch: list[Job]) -> BatchSpec: ...
    def started(self, replica: int, batch: list[Job]) -> None: ...
    def stepped(self, replica: int, batch: list[Job], step: int) -> None: ...
    def conclude(self, replica: int, batch: list[Job], outcome: Outcome) -> None: ...
    def fatal(self, message: str) -> None: ...


class RemoteReplica:
    """A thread of rank 0 serving the queue on replica ``link.replica``."""

    def __init__(self, leader: Dispatcher, link: Link):
        self.leader, self.link, self.replica = leader, link, link.replica
        self.thread = threading.Thread(target=self._serve, name=f"usp_dit-replica-{self.replica}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def _serve(self) -> None:
        try:
            while True:
                batch = self.leader.sched.next_batch(timeout=1.0, replica=self.replica)
                if batch is not None:
                    self._run(batch)
                elif self.leader.draining_since is not None and self.leader.sched.depth() == 0:
                    break  # draining and nothing left to take: the replica stops
            self.link.send(("stop",))
        except Exception as err:  # noqa: BLE001 -- the link failed: a rank of that replica is gone
            self.leader.fatal(f"replica {self.replica}: the control plane failed: {type(err).__name__}: {err}")

    def _run(self, batch: list[Job]) -> None:
        """One batch on the replica: progress and the cancel flag each step, then the outcome."""
        self.link.send(("run", self.leader.spec_of(batch)))
        self.leader.started(self.replica, batch)
        while True:
            kind, value = self.link.receive()
            if kind == "step":
                self.leader.stepped(self.replica, batch, value)
                self.link.send(any(job.cancel for job in batch))
            else:  # "done"
                self.leader.conclude(self.replica, batch, value)
                return
