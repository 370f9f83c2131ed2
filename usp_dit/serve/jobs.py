"""Rank 0's queue: jobs, the bounded FIFO, batching, and answering everything on shutdown or failure.

Layout: no tensors; a finished job's future holds its output array (see ``usp_dit.serve.worker``).

Threads: the HTTP server's event loop submits jobs and reads their state; the main thread (the
serving loop) takes batches and resolves futures; the heartbeat thread may fail everything. One
lock guards the queue and every job's state.

Batching: the head of the queue goes first; image jobs behind it with the same ``CallShape``
(size, steps, guidance, negative prompt) join its batch, in queue order, while the images fit
``max_batch``. Each keeps its own seed (``usp_dit.serve.families.run_batch``). A video job runs alone
(it has its own progress and cancellation).
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

from usp_dit.serve.protocol import Params


class ServeError(Exception):
    """A request the server answers with an error: HTTP ``status`` and a message."""

    def __init__(self, status: int, message: str, kind: str = "server_error", retry_after: int | None = None):
        super().__init__(message)
        self.status, self.kind, self.retry_after = status, kind, retry_after


@dataclass(eq=False)
class Job:
    """One request. ``status``: queued, in_progress, completed, failed or cancelled."""

    kind: str  # "image" or "video"
    params: Params
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    started: float | None = None
    picked: float = 0.0  # time.monotonic() when the serving loop took it (the batch time is counted from it)
    future: Future = field(default_factory=Future)
    status: str = "queued"
    progress: float = 0.0  # in [0, 1]: denoising steps done / steps
    cancel: bool = False
    error: str | None = None
    batch_size: int = 0  # the images of the batch it ran in
    replica: int | None = None  # the model replica that ran it (Note [replicas])
    content: bytes | None = None  # a finished video's MP4

    @property
    def images(self) -> int:
        return self.params.n


class Scheduler:
    """The bounded FIFO of jobs (``max_queue`` waiting at most) and the video jobs by id."""

    def __init__(self, max_queue: int, max_batch: int, max_videos_kept: int = 64):
        self.max_queue, self.max_batch, self.max_videos_kept = max_queue, max_batch, max_videos_kept
        self._lock = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self.videos: collections.OrderedDict[str, Job] = collections.OrderedDict()
        self.accepting = True
        self.refusal = ServeError(503, "the server is starting", "unavailable")

    # -- the HTTP side -------------------------------------------------------------------------

    def submit(self, job: Job, retry_after: int = 1) -> None:
        """Queue ``job``; ``ServeError`` 503 when not accepting, 429 when the queue is full."""
        with self._lock:
            if not self.accepting:
                raise self.refusal
            if len(self._queue) >= self.max_queue:
                raise ServeError(429, f"the queue is full ({self.max_queue} requests waiting); retry later",
                                 "rate_limit_exceeded", retry_after=retry_after)
            self._queue.append(job)
            if job.kind == "video":
                self._keep_video(job)
            self._lock.notify_all()

    def _keep_video(self, job: Job) -> None:
        self.videos[job.id] = job
        while len(self.videos) > self.max_videos_kept:  # forget the oldest finished ones
            old = next((j for j in self.videos.values() if j.status in ("completed", "failed", "cancelled")), None)
            if old is None:
                break
            del self.videos[old.id]

    def cancel_video(self, job_id: str) -> Job:
        """Cancel a queued video at once, a running one at its next step end; forget a finished one."""
        with self._lock:
            job = self.videos.get(job_id)
            if job is None:
                raise ServeError(404, f"no video {job_id!r}", "not_found")
            if job.status == "queued":
                self._queue.remove(job)
                self._finish(job, "cancelled", ServeError(409, "cancelled", "cancelled"))
            elif job.status == "in_progress":
                job.cancel = True
            else:
                del self.videos[job_id]
            return job

    def video(self, job_id: str) -> Job:
        with self._lock:
            job = self.videos.get(job_id)
        if job is None:
            raise ServeError(404, f"no video {job_id!r}", "not_found")
        return job

    def depth(self) -> int:
        with self._lock:
            return len(self._queue)

    # -- the serving loop ----------------------------------------------------------------------

    def next_batch(self, timeout: float, replica: int | None = None) -> list[Job] | None:
        """The next batch (moved to ``running``, marked as run by ``replica``), or None after
        ``timeout`` seconds with none queued."""
        with self._lock:
            if not self._queue and not self._lock.wait_for(lambda: bool(self._queue), timeout):
                return None
            head = self._queue.popleft()
            batch = [head]
            if head.kind == "image":
                room = self.max_batch - head.images
                for job in list(itertools.islice(self._queue, 0, None)):
                    if job.kind == "image" and job.params.shape == head.params.shape and job.images <= room:
                        self._queue.remove(job)
                        batch.append(job)
                        room -= job.images
            now, picked = time.time(), time.monotonic()
            for job in batch:
                job.status, job.started, job.batch_size = "in_progress", now, sum(j.images for j in batch)
                job.picked, job.replica = picked, replica
            self.running.extend(batch)  # with replicas, several batches run at once
            return batch

    def finish(self, batch: list[Job], status: str, result=None, error: ServeError | None = None) -> None:
        """Resolve every job of ``batch``: ``result`` maps a job to its output on success."""
        with self._lock:
            for job in batch:
                self._finish(job, status, error, None if result is None else result(job))
            self.running = [j for j in self.running if j not in batch]

    def _finish(self, job: Job, status: str, error: ServeError | None, output=None) -> None:
        if job.future.done():
            return
        job.status = status
        if status == "completed":
            job.progress = 1.0
            job.future.set_result(output)
        else:
            job.error = str(error)
            job.future.set_exception(error)

    def stop_accepting(self, refusal: ServeError) -> None:
        with self._lock:
            self.accepting = False
            self.refusal = refusal

    def start_accepting(self) -> None:
        with self._lock:
            self.accepting = True

    def idle(self) -> bool:
        with self._lock:
            return not self._queue and not self.running

    def fail_queued(self, error: ServeError) -> int:
        """Answer every queued job with ``error``; returns how many."""
        with self._lock:
            jobs = list(self._queue)
            self._queue.clear()
            for job in jobs:
                self._finish(job, "failed", error)
            return len(jobs)

    def fail_all(self, error: ServeError) -> None:
        """Answer every queued and running job with ``error`` and accept nothing more."""
        self.stop_accepting(error)
        self.fail_queued(error)
        with self._lock:
            for job in self.running:
                self._finish(job, "failed", error)
