"""``torchrun --nproc-per-node N -m usp_dit.serve ...``: a warm pipeline on a USP grid behind an
OpenAI-compatible HTTP API (docs/SERVING.md).

Layout: no tensors of its own; see ``usp_dit.serve.worker`` for a batch's output.

Every rank loads the pipeline and enables USP once. Rank 0 also runs the HTTP server (uvicorn, in a
thread) and the queue; its main thread is the serving loop: it takes a batch, broadcasts it over
the control plane and runs it like every other rank (Note [control plane] in
``usp_dit.serve.control``). The other ranks' main threads wait for rank 0's next message.

Note [shutting down]
    SIGTERM (or Ctrl-C) on rank 0: new requests get 503, the running batch finishes, the queue is
    run until ``--drain-timeout`` (then what is left gets 503), every rank is told to stop, and the
    job exits 0. The other ranks ignore SIGTERM: they stop when rank 0 says so, so torchrun passing
    its own SIGTERM on to every worker drains the same way (torchrun kills what is left 30 s later
    and reports the signal itself). A failure (a peer gone, a hang past ``--hang-timeout``): /health
    answers 503 "failed" at once, every queued and running request gets an error, and every rank
    exits 1 within a second, so that a supervisor restarts the job.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from usp_dit.cli import launch  # noqa: E402
from usp_dit.serve.control import Control, Heartbeat  # noqa: E402
from usp_dit.serve.families import FAMILIES, CallShape, load_pipeline, pixels_per_token  # noqa: E402
from usp_dit.serve.jobs import Job, Scheduler, ServeError  # noqa: E402
from usp_dit.serve.protocol import Limits  # noqa: E402
from usp_dit.serve.replicas import RemoteReplica  # noqa: E402
from usp_dit.serve.worker import BatchSpec, Outcome, RankFailure, execute  # noqa: E402

EXIT_FAILED = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; a bad value raises ``launch.UsageError`` (one line, exit 2)."""
    p = launch.ArgumentParser(prog="python -m usp_dit.serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="flux", metavar="FAMILY",
                   help="the model family: " + ", ".join(f"{name} ({FAMILIES[name].pipeline}, "
                   f"{'videos' if FAMILIES[name].videos else 'images'})" for name in sorted(FAMILIES))
                   + " (default: flux)")
    p.add_argument("--model", default=None, help="checkpoint folder or hub id (default: a tiny random pipeline)")
    p.add_argument("--model-id", default=None, help="the name /v1/models lists (default: --model or usp-dit-<family>-tiny)")
    p.add_argument("--ulysses", type=int, default=None)
    p.add_argument("--ring", type=int, default=None)
    p.add_argument("--cfg", type=int, default=1)
    p.add_argument("--shard-weights", action="store_true", help="FSDP2-shard the transformer's weights over the grid")
    p.add_argument("--backend", default="auto")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the log and --port-file name it)")
    p.add_argument("--port-file", default=None,
                   help="write the port listened on to this file once listening (for scripts using --port 0)")
    p.add_argument("--max-batch", type=int, default=4, help="images per batch (and per request's n) at most")
    p.add_argument("--queue-size", type=int, default=64, help="requests waiting at most; then 429")
    p.add_argument("--warmup", default="", help="sizes to run once before /health is ready: 1024x1024,768x1344")
    p.add_argument("--replicas", type=int, default=1,
                   help="model replicas (data parallel): N / K ranks each, one queue (Note [replicas])")
    p.add_argument("--steps", type=int, default=None, help="default denoising steps (default: 4 tiny, 28 real)")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--max-side", type=int, default=None, help="pixels (default: the tiny model's table, else 2048)")
    p.add_argument("--max-frames", type=int, default=129)
    p.add_argument("--max-prompt-chars", type=int, default=None, help="default: 64 tiny (its text length), else 2000")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds before a silent rank is dead")
    p.add_argument("--hang-timeout", type=float, default=300.0,
                   help="seconds a batch may go without a step (every rank logs its stacks at half of it)")
    p.add_argument("--drain-timeout", type=float, default=25.0, help="seconds to run the queue after SIGTERM")
    args = p.parse_args(argv)
    check_args(args, launch.env_world_size())
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Fill defaults; ``launch.UsageError`` for a value that would fail later."""
    launch.check_at_least("--replicas", args.replicas, 1)
    if not 0 <= args.port <= 65535:
        raise launch.UsageError(f"--port {args.port}: a TCP port is 0 (any free one) to 65535")
    if world % args.replicas:
        raise launch.UsageError(f"--replicas {args.replicas} on {world} rank(s): the replicas must split the ranks "
                                f"evenly (a divisor of {world})")
    launch.check_model_path("--model", args.model)
    launch.check_backend("--backend", args.backend)
    for flag, value in (("--max-batch", args.max_batch), ("--queue-size", args.queue_size),
                        ("--max-steps", args.max_steps), ("--max-frames", args.max_frames)):
        launch.check_at_least(flag, value, 1)
    args.degrees = launch.check_degrees(world // args.replicas, args.ulysses, args.ring, args.cfg)
    tiny = args.model is None
    spec = FAMILIES[args.family]
    args.steps = args.steps or (4 if tiny else 28)
    args.max_side = args.max_side or (spec.tiny_max_side if tiny else 2048)
    args.max_prompt_chars = args.max_prompt_chars or (64 if tiny else 2000)
    args.model_id = args.model_id or args.model or f"usp-dit-{args.family}-tiny"
    args.warmup_sizes = []
    unit = pixels_per_token(args.family, tiny)
    for item in filter(None, args.warmup.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(x.isdigit() for x in parts):
            raise launch.UsageError(f"--warmup {item!r} must be WIDTHxHEIGHT, e.g. 1024x1024")
        for value in map(int, parts):
            launch.check_multiple("--warmup", value, unit, f"{args.family}: pixels per token")
        args.warmup_sizes.append((int(parts[0]), int(parts[1])))


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(family=args.family, tiny=args.model is None, max_batch=args.max_batch, max_side=args.max_side,
                  max_prompt_chars=args.max_prompt_chars, max_steps=args.max_steps, max_frames=args.max_frames,
                  default_steps=args.steps, model_id=args.model_id)


def warm_up(pipe, args: argparse.Namespace, control: Control) -> None:
    """Every rank runs each ``--warmup`` size once (one image, one step), in the same order."""
    for width, height in args.warmup_sizes:
        spec = BatchSpec(CallShape(width, height, 1, 1, None, None), ("warm-up",), (0,))
        outcome = execute(pipe, args.family, args.model is None, spec, control)
        if outcome.error is not None:
            raise RuntimeError(f"warm-up at {width}x{height} failed: {outcome.error}")


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: one the kernel picks), bound here rather than by
    uvicorn so that a taken port fails with its reason and ``--port 0`` can report the port it got
    (a port picked free beforehand by a script can be taken by anything before the server binds it:
    on a busy machine, by another job's gloo connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise RuntimeError(f"cannot listen on {host}:{port} (--host, --port): {e.strerror or e}") from None


def _log(message: str) -> None:
    print(f"[usp_dit.serve rank {os.environ.get('RANK', '0')}] {message}", file=sys.__stderr__, flush=True)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.__stderr__.flush()
    os._exit(code)  # no process-group teardown: it may wait for peers that are gone


@dataclass
class Progress:
    """One replica's running batch, for the progress deadline (``Leader.hang_check``)."""

    batch: list[Job] | None = None
    since: float = 0.0  # time.monotonic() of the batch's start or its last step end


class Leader:
    """Rank 0: the HTTP server, the queue, the serving loop of replica 0 and the threads that
    serve the other replicas (Note [replicas])."""

    def __init__(self, pipe, args: argparse.Namespace, control: Control):
        from usp_dit.serve.app import ServerState
        from usp_dit.serve.encode import video_supported
        from usp_dit.serve.loras import Registry

        self.pipe, self.args, self.control = pipe, args, control
        refused = ("LoRA adapters need unsharded weights (FSDP2 units cannot take new layers): serve without "
                   "--shard-weights") if args.shard_weights else None
        self.state = ServerState(limits_of(args), Scheduler(args.queue_size, args.max_batch), loras=Registry(refused))
        self.sched, self.metrics = self.state.scheduler, self.state.metrics
        if not FAMILIES[args.family].videos:
            self.state.video_error = f"this server's model ({args.family}) generates images, not videos"
        else:
            self.state.video_error = video_supported()
        self.draining_since: float | None = None
        self.progress = [Progress() for _ in range(control.replicas)]
        self.remotes = [RemoteReplica(self, control.links[r]) for r in range(1, control.replicas)]
        self._fatal = threading.Lock()
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="usp_dit-encode")

    # -- start, stop, fail ---------------------------------------------------------------------

    def start_http(self) -> None:
        import uvicorn

        from usp_dit.serve.app import build_app

        sock = _listen(self.args.host, self.args.port)
        config = uvicorn.Config(build_app(self.state), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        self.http = uvicorn.Server(config)
        self.http_thread = threading.Thread(target=self.http.run, kwargs={"sockets": [sock]}, name="usp_dit-http",
                                            daemon=True)
        self.http_thread.start()
        while not self.http.started:
            if not self.http_thread.is_alive():
                raise RuntimeError(f"the HTTP server could not start on {self.args.host}:{self.args.port}")
            time.sleep(0.05)
        port = sock.getsockname()[1]
        if self.args.port_file:
            # Written whole, then renamed: a reader polling the file never sees half a number.
            partial = f"{self.args.port_file}.partial"
            with open(partial, "w") as f:
                f.write(f"{port}\n")
            os.replace(partial, self.args.port_file)
        _log(f"listening on http://{self.args.host}:{port}")

    def drain(self, signum: int = signal.SIGTERM, frame=None) -> None:
        """Note [shutting down]: from the signal handler (main thread, between bytecodes)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            self.state.health = "draining" if self.state.health != "failed" else "failed"
            self.sched.stop_accepting(ServeError(503, "the server is shutting down", "unavailable"))
            _log(f"signal {signum}: draining (running and queued requests finish, new ones get 503)")

    def fatal(self, message: str) -> None:
        """A rank is gone or hung: answer everything with an error and exit 1 (any thread)."""
        if not self._fatal.acquire(blocking=False):
            threading.Event().wait()  # another thread is ending the process
        self.state.health = "failed"
        self.metrics.failures.labels("rank").inc()
        self.metrics.ready.set(0)
        _log(f"failed: {message}; answering every request with an error and exiting")
        self.sched.fail_queued(ServeError(503, f"the server failed before this request ran: {message}", "unavailable"))
        self.sched.fail_all(ServeError(500, f"the server failed while running this request: {message}"))
        time.sleep(1.0)  # the event loop sends the answers
        _exit(EXIT_FAILED)

    def hang_check(self) -> str | None:
        now = time.monotonic()
        for replica, progress in enumerate(self.progress):
            if progress.batch is None:
                continue
            # ``since`` is the batch's start or its last step end: an idle spell before it is no hang.
            idle_for = now - progress.since
            if idle_for > self.args.hang_timeout:
                where = f" on replica {replica}" if self.control.replicas > 1 else ""
                return f"no denoising step{where} for {idle_for:.0f} s (--hang-timeout {self.args.hang_timeout:g})"
        return None

    # -- the serving loop ----------------------------------------------------------------------

    def serve(self) -> None:
        self.state.health = "ready"
        self.metrics.ready.set(1)
        if self.draining_since is None:
            self.sched.start_accepting()
        for remote in self.remotes:
            remote.start()
        while True:
            if self.draining_since is not None and time.monotonic() - self.draining_since > self.args.drain_timeout:
                self.sched.fail_queued(ServeError(503, "the server stopped before this request ran", "unavailable"))
            batch = self.sched.next_batch(timeout=1.0, replica=0)
            if batch is None:
                if self.draining_since is not None and self.sched.idle():
                    break
                self._send(("heartbeat",))
                continue
            self.run(batch)
        for remote in self.remotes:  # each has told its replica to stop
            remote.join()
        self._send(("stop",))
        self._encoder.shutdown(wait=True)
        time.sleep(0.2)  # the last answers leave
        self.http.should_exit = True
        self.http_thread.join(timeout=5)

    def _send(self, message) -> None:
        try:
            self.control.broadcast(message)
        except Exception as err:
            self.fatal(f"the control plane failed: {type(err).__name__}: {err}")

    # -- one batch, on replica 0 here or on another replica through its thread --------------------

    def spec_of(self, batch: list[Job]) -> BatchSpec:
        """Image i of a request runs with seed + i (each keeps its own noise in a batch)."""
        prompts = tuple(j.params.prompt for j in batch for _ in range(j.images))
        seeds = tuple(j.params.seed + i for j in batch for i in range(j.images))
        return BatchSpec(batch[0].params.shape, prompts, seeds, self.state.loras.snapshot())

    def started(self, replica: int, batch: list[Job]) -> None:
        self.progress[replica] = Progress(batch, time.monotonic())
        self.metrics.running.set(len(self.sched.running))
        self.metrics.batch_size.observe(sum(j.images for j in batch))

    def stepped(self, replica: int, batch: list[Job], step: int) -> None:
        progress, now = self.progress[replica], time.monotonic()
        self.metrics.step_time.observe(now - progress.since)
        progress.since = now
        for job in batch:
            job.progress = (step + 1) / job.params.shape.steps

    def run(self, batch: list[Job]) -> None:
        """``batch`` on replica 0 (this rank's)."""
        spec = self.spec_of(batch)
        self._send(("run", spec))
        self.started(0, batch)
        try:
            outcome = execute(self.pipe, self.args.family, self.args.model is None, spec, self.control,
                              lambda: any(j.cancel for j in batch), lambda step: self.stepped(0, batch, step),
                              stall_dump_s=self.args.hang_timeout / 2)
        except RankFailure as err:
            self.fatal(str(err))
        self.conclude(0, batch, outcome)

    def conclude(self, replica: int, batch: list[Job], outcome: Outcome) -> None:
        """Answer ``batch``'s requests with ``outcome`` (any thread)."""
        took = time.monotonic() - batch[0].picked
        self.progress[replica] = Progress()
        self.metrics.batch_time.observe(took)
        self.state.mean_batch_s = 0.8 * self.state.mean_batch_s + 0.2 * took
        if outcome.cancelled:
            self.sched.finish(batch, "cancelled", error=ServeError(409, "cancelled", "cancelled"))
        elif outcome.error is not None:
            self.metrics.failures.labels("pipeline").inc()
            where = f" on replica {replica}" if self.control.replicas > 1 else ""
            _log(f"a batch of {len(batch)} request(s) failed{where}: {outcome.error}")
            self.sched.finish(batch, "failed", error=ServeError(500, f"the pipeline failed: {outcome.error}"))
        elif batch[0].kind == "video":
            self._encoder.submit(self._finish_video, batch[0], outcome.output[0])
        else:
            self._finish_images(batch, outcome.output)
        self.metrics.running.set(len(self.sched.running))

    def _finish_images(self, batch: list[Job], output: np.ndarray) -> None:
        if output.ndim == 5:  # a video family: one-frame videos
            output = output[:, 0]
        starts = np.cumsum([0] + [j.images for j in batch])
        where = {id(j): (int(starts[i]), int(starts[i + 1])) for i, j in enumerate(batch)}
        self.sched.finish(batch, "completed", result=lambda job: output[slice(*where[id(job)])])

    def _finish_video(self, job: Job, frames: np.ndarray) -> None:
        from usp_dit.serve.encode import mp4_bytes

        try:
            job.content = mp4_bytes(frames, job.params.fps)
        except Exception as err:  # the encoder's failure is this request's, not the server's
            self.sched.finish([job], "failed", error=ServeError(500, f"MP4 encoding failed: {err}"))
            return
        self.metrics.latency.labels("video").observe(time.time() - job.created)
        self.sched.finish([job], "completed", result=lambda _: None)


def serve_leader(pipe, args: argparse.Namespace, control: Control) -> None:
    leader = Leader(pipe, args, control)
    leader.start_http()
    control.barrier()
    heartbeat = Heartbeat(control, leader.fatal, leader.hang_check)
    heartbeat.start()
    signal.signal(signal.SIGTERM, leader.drain)
    signal.signal(signal.SIGINT, leader.drain)
    warm_up(pipe, args, control)
    replicas = f", {control.replicas} replicas" if control.replicas > 1 else ""
    _log(f"ready: {args.model_id} ({args.family}) on {control.total} rank(s), grid {args.degrees}{replicas}")
    leader.serve()
    heartbeat.stopping.set()
    _stop_together(control)
    _exit(0)


def serve_peer(pipe, args: argparse.Namespace, control: Control) -> None:
    """A rank other than 0: run what its replica's first rank broadcasts until it says stop. The
    first rank of replica r >= 1 gets its messages from rank 0 over the replica's link, reports
    each step end there and sends the outcome back (Note [replicas])."""
    link = control.links.get(control.replica) if control.leads_replica else None
    control.barrier()
    heartbeat = Heartbeat(control, lambda message: (_log(f"failed: {message}; exiting"), _exit(EXIT_FAILED)))
    heartbeat.start()
    for signum in (signal.SIGTERM, signal.SIGINT):  # Note [shutting down]: rank 0 decides
        signal.signal(signum, lambda s, f: None)
    warm_up(pipe, args, control)
    while True:
        message = control.broadcast(None if link is None else link.receive())
        if message[0] == "stop":
            break
        if message[0] == "run":
            hooks = {} if link is None else {"on_step": lambda step: link.send(("step", step)),
                                             "cancel_requested": link.receive}
            try:
                outcome = execute(pipe, args.family, args.model is None, message[1], control,
                                  stall_dump_s=args.hang_timeout / 2, **hooks)
            except RankFailure as err:
                _log(f"failed: {err}; exiting")
                _exit(EXIT_FAILED)
            if link is not None:
                link.send(("done", outcome))
    heartbeat.stopping.set()
    _stop_together(control)
    _exit(0)


def _stop_together(control: Control) -> None:
    """Every rank has stopped its heartbeat before any leaves (else a peer's beat would fail)."""
    control.barrier()


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    record(launch.cli_main(_main))(argv)


def _main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # before the process group and the weights: a bad value ends here
    from usp_dit.pipelines import install_failure_handler

    rank, _, device = launch.init_distributed()
    install_failure_handler()  # an uncaught exception on any rank ends that process at once
    control = Control(args.heartbeat_timeout, args.replicas)
    pipe = load_pipeline(args.family, args.model, device)
    pipe.set_progress_bar_config(disable=True)
    if args.degrees != (1, 1, 1):  # replicas of one rank each run the pipeline as it is
        ulysses, ring, cfg = args.degrees
        pipe.enable_usp(ulysses_degree=ulysses, ring_degree=ring, cfg_degree=cfg, backend=args.backend,
                        shard_weights=args.shard_weights)
    torch.set_grad_enabled(False)
    if rank == 0:
        serve_leader(pipe, args, control)
    else:
        serve_peer(pipe, args, control)
