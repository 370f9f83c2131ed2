"""Gloo process groups that run one collective at a time (Note [gloo all-gather race]).

No tensors here: this module only decides how gloo groups are built.

Note [gloo all-gather race]
    A gloo process group runs the collectives posted on it on two worker threads (torch's
    default), so two collectives posted before either is waited run at the same time. When one
    of them is an all-gather (``all_gather_into_tensor``, which gloo serves through its coalesced
    all-gather), the process's heap gets corrupted: "malloc(): unaligned tcache chunk detected"
    or SIGSEGV, in a gloo worker thread, at a later allocation. usp_dit posts such pairs by
    design, to overlap transfers with compute: the ring's "gather_merge" schedule posts K's and
    V's all-gathers together; an all-gather beside a Ulysses all-to-all does it too.

    Measured on the 2-core CPU machine (``python benchmarks/stress_gloo.py``: 4 ranks, two
    collectives in flight on one group, then both waited, in a loop): two all-gathers, or an
    all-gather with an all-to-all, killed a rank (or stalled the group) within 16 000 iterations
    in each of eight runs with two worker threads, and 30 000 ran clean with one; two all-to-alls
    or two all-reduces ran 30 000 / 12 000 iterations clean with two (those two, and six of the
    eight, with the script's first draft: the same loop). Cores of the test ranks that died in CI-like runs
    show the same picture: both worker threads of one group inside an all-gather, one crashing in
    ``~UnboundBuffer`` and the other finding the corrupted tcache. PyTorch has known this path
    to crash since 2021 (pytorch/pytorch#65237, "test_allgather_coalesced_async is flaky").

    So the gloo groups usp_dit builds run on one worker thread: collectives of one group run
    one after another, in the order posted; each still overlaps the caller's compute, which is
    what the posting order is for. Torch has no option for it (``new_group``'s ``pg_options``
    is ignored for gloo), so ``serialize_gloo_groups`` swaps the class torch's group factory
    constructs for a subclass that passes one thread in the options, with the devices torch
    itself would pick (``GLOO_SOCKET_IFNAME`` honoured). NCCL groups are untouched. A gloo
    default group made before (a user's own ``init_process_group``) keeps torch's two threads;
    usp_dit's mesh groups are built after the call, and where the default group runs more than
    one thread, every mesh axis gets a group of its own (``_own_groups`` in
    ``usp_dit.distributed.mesh``), even one spanning the world, which DeviceMesh would otherwise
    hand the default group.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

_SOCKET_ENV = "GLOO_SOCKET_IFNAME"  # torch's own variable: the interfaces gloo binds to


def _devices(base: type) -> list[Any]:
    """The gloo devices torch's own constructor would create (one per named interface)."""
    names = os.environ.get(_SOCKET_ENV, "")
    if len(names) > 1:  # torch's rule: a value of one character is ignored
        return [base.create_device(interface=name) for name in names.split(",")]
    return [base.create_default_device()]


def _one_thread_class(base: type) -> type:
    """A subclass of torch's ``ProcessGroupGloo`` whose groups run on one worker thread."""

    class OneThreadGloo(base):  # type: ignore[misc, valid-type]
        """``ProcessGroupGloo`` with one worker thread (Note [gloo all-gather race])."""

        usp_dit_one_thread = True

        def __init__(self, store: Any, rank: int, size: int, options: Any = None, **kwargs: Any) -> None:
            timeout = kwargs.pop("timeout", None)
            if kwargs:
                raise TypeError(f"OneThreadGloo: unexpected arguments {sorted(kwargs)}")
            if isinstance(options, base._Options):
                options._threads = 1
                base.__init__(self, store, rank, size, options)
                return
            if options is not None:  # positional timeout, as torch's own signature allows
                timeout = options
            opts = base._Options()
            if timeout is not None:
                opts._timeout = timeout
            opts._devices = _devices(base)
            opts._threads = 1
            base.__init__(self, store, rank, size, opts)

    return OneThreadGloo


def serialize_gloo_groups() -> bool:
    """Make every gloo process group created from now on in this process run its collectives on
    one worker thread (Note [gloo all-gather race]). Idempotent.

    Returns:
        True once installed; False where this torch build has no gloo (nothing to do) or its
        group factory cannot be given options (left as it is).
    """
    c10d = dist.distributed_c10d
    base = getattr(c10d, "ProcessGroupGloo", None)
    if base is None or not dist.is_gloo_available():
        return False
    if getattr(base, "usp_dit_one_thread", False):
        return True
    if not all(hasattr(base, name) for name in ("_Options", "create_default_device", "create_device")):
        return False
    c10d.ProcessGroupGloo = _one_thread_class(base)
    return True


def gloo_threads(group: dist.ProcessGroup | None = None) -> int | None:
    """The worker threads of ``group``'s gloo backend (the default group when None), or None
    where it has no gloo backend."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError):
        return None
