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

Note [replicas]
    ``--replicas K`` splits the world into K model replicas of N / K ranks (the USP mesh's
    data-parallel axis), each running its own batches on its own grid; the queue stays on rank 0.
    Rank 0 leads replica 0 from its main thread, as with one replica; for each other replica r a
    thread of rank 0 (``usp_dit.serve.replicas.RemoteReplica``) takes batches from the same queue and
    talks to replica r's first rank over a two-rank ``Link``:

        rank 0 (thread r)                     replica r's first rank      its other ranks
        ("run", batch)         ------------>  broadcast in the replica -> run the batch
        <- ("step", i) / cancel flag ->       after each denoising step (progress, cancellation)
        <------------  ("done", outcome)      (the images travel back pickled)
        ("stop",)              ------------>  broadcast, then every rank of the job leaves together

    So every replica serves images and videos alike, with progress, cancellation and the same
    fault agreement inside it; a pipeline failure in replica r fails that batch alone. The
    heartbeat still spans every rank: a dead or frozen rank anywhere fails the job. Rank 0 sees
    replica r's step ends, so the progress deadline covers every replica.
"""
from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from usp_dit.distributed.gloo import serialize_gloo_groups

CONTROL_TIMEOUT = datetime.timedelta(days=30)  # an idle server waits here: no timeout in practice


class Control:
    """The control groups of one job (every rank builds them, in the same order).

    With ``replicas`` K > 1 (Note [replicas]) the world's ranks form K model replicas of
    ``world / K`` ranks each, replica r being ranks [r m, (r + 1) m) (the data-parallel axis is
    the outermost of the USP mesh). ``rank`` and ``world`` are then this rank's place in its replica
    and the replica's size; ``broadcast``, ``agree`` and ``gather`` stay within the replica, while
    ``barrier`` and the heartbeat span every rank.
    """

    def __init__(self, heartbeat_timeout_s: float = 5.0, replicas: int = 1):
        self.total = dist.get_world_size() if dist.is_initialized() else 1
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        if replicas < 1 or self.total % replicas:
            raise ValueError(f"replicas={replicas}: must be a positive divisor of the world size {self.total}")
        self.replicas, size = replicas, self.total // replicas
        self.replica, self.rank, self.world = divmod(self.global_rank, size) + (size,)
        self.group = self.everyone = self.heartbeat_group = None
        self.links: dict[int, Link] = {}  # rank 0: replica r -> its link; replica r's first rank: {r: link}
        if self.total == 1:
            return
        serialize_gloo_groups()  # these gloo groups and the links' (Note [gloo all-gather race])
        self.everyone = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.heartbeat_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=heartbeat_timeout_s))
        for r in range(replicas):  # every rank creates every group, in the same order
            ranks = list(range(r * size, (r + 1) * size))
            group = self.everyone if replicas == 1 else dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)
            if r == self.replica:
                self.group = group
        for r in range(1, replicas):
            link = Link(r, [0, r * size])
            if self.global_rank in (0, r * size):
                self.links[r] = link

    @property
    def leads_replica(self) -> bool:
        """The first rank of its replica (rank 0 of the world leads replica 0)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Every rank of the job is here (no deadline): before the heartbeats start, so that a rank
        still loading its weights does not miss the first beats' deadline."""
        if self.total > 1:
            dist.barrier(group=self.everyone)

    def broadcast(self, message: Any = None) -> Any:
        """The replica's first rank's ``message`` on every rank of the replica (a small picklable object)."""
        if self.world == 1:
            return message
        box = [message]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def agree(self, failed: bool, cancel: bool, done: bool) -> tuple[bool, bool, bool]:
        """The MAX over the replica's ranks of the three flags (Note [control plane])."""
        flags = torch.tensor([int(failed), int(cancel), int(done)], dtype=torch.int64)
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1]), bool(flags[2])

    def gather(self, value: Any) -> list[Any]:
        """Every replica rank's ``value`` (small, picklable), in rank order, on every rank of the replica."""
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out


class Link:
    """Note [replicas]: rank 0 and the first rank of replica r, over a group of their own (no
    deadline). Each message is a broadcast from one side; the two sides take turns as the
    protocol says, so every send meets its receive."""

    def __init__(self, replica: int, ranks: list[int]):
        self.replica = replica
        self.group = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)
        self.side = 0 if dist.get_rank() == ranks[0] else 1

    def send(self, message: Any) -> None:
        dist.broadcast_object_list([message], group=self.group, group_src=self.side)

    def receive(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, group=self.group, group_src=1 - self.side)
        return box[0]


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
            if problem is None and self.control.total > 1:
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
