"""Failure handling: a rank that raises ends its process at once, so that no other rank waits for it.

Layout: no tensors.

Note [a failing rank]
    When one rank raises, the others are typically blocked in a collective waiting for it. Under
    torchrun the elastic agent stops every worker as soon as one exits non-zero (it polls every
    ``--monitor-interval``, 0.1 s by default); what must not happen is that the failing process
    hangs in interpreter shutdown (process-group destructors, joined threads) instead of exiting.
    ``install_failure_handler`` (installed by ``enable_usp`` when the world size is > 1) replaces
    ``sys.excepthook``: it prints the traceback with the rank and calls ``os._exit(1)`` at once.
    Without an agent (plain processes, gloo), the peers' pending collectives then fail with a
    closed connection, their own uncaught errors go through the same hook, and the whole job ends
    within seconds (tests/test_pipelines_api.py). With NCCL and no agent, the process group's
    timeout is the backstop.
"""
from __future__ import annotations

import os
import sys
import traceback


def _exit_on_uncaught(exc_type, exc, tb) -> None:
    rank = os.environ.get("RANK", "?")
    # sys.__stderr__, not sys.stderr: a launcher may have redirected sys.stderr to a buffer that
    # os._exit would never flush, losing the traceback.
    sys.stderr = sys.__stderr__
    try:
        sys.stderr.write(f"[usp_dit] rank {rank}: uncaught {exc_type.__name__}, ending this process now "
                         f"so that no other rank waits for it in a collective\n")
        traceback.print_exception(exc_type, exc, tb)
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(1)


def install_failure_handler() -> None:
    """Note [a failing rank]: an uncaught exception prints its traceback and ends the process at once.

    Idempotent. Only the main thread's uncaught exceptions go through ``sys.excepthook``.
    """
    sys.excepthook = _exit_on_uncaught
