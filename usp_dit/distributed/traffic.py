"""Counting the bytes this rank sends and receives, per kind of collective (off unless asked).

Layout: no tensors of the caller's; a counter holds integers: ``kind -> (sent, received)`` bytes.

    with count_traffic() as t:
        usp_attention(...)                  # forward, and backward if any
    t.by_kind()   # {"ulysses_a2a": (sent, received), "ring_kv": (...), ...}, this rank only
    t.total()     # (sent, received) over every kind

``usp_dit.planner.volumes`` predicts the same numbers from shapes alone; tests/test_traffic.py
checks that prediction against this count on CPU grids, kind by kind and rank by rank.

Note [counting traffic]
    What is counted: the logical payload bytes that cross from this rank to OTHER ranks, at the
    call site of each collective of usp_dit's attention path, as the code posts it (eagerly):

    - all-to-all: the pieces for other ranks (sent) and from them (received); a rank's piece to
      itself is not traffic;
    - all-gather of a piece of n bytes over G ranks: (G - 1) n sent and (G - 1) n received, n being
      the piece as it travels: our gathers pad pieces to the longest, and padding that travels is
      traffic;
    - all-reduce of n bytes over G ranks: the ring algorithm's volume, ``all_reduce_bytes(n, G) =
      2 (G - 1) n // G`` each way (reduce-scatter then all-gather of G chunks; rounded down to a
      whole byte, the same on every rank). It is a model, not a measurement: backends pick their
      algorithm by size (NCCL ring or tree, gloo ring or bcube), and the ring's is the volume a
      bandwidth model prices;
    - broadcast of n bytes over G ranks: the source sends n to each of the G - 1 others ((G - 1) n
      sent); every other rank receives n;
    - point to point: the bytes of the tensor sent and of the tensor received.

    Kinds (the caller knows what it moves and says so; nothing is guessed from shapes):

        ulysses_a2a   the Ulysses all-to-alls of q, k, v and out, their backward, and of the LSE
                      when return_lse
        ring_kv       the ring's K/V block rotation (eager P2P, and the traced all-to-all when run
                      eagerly)
        ring_grad     the ring backward's dK/dV accumulators (float32; float64 for float64)
        ring_gather   the gather schedules' all-gathers of K/V blocks ("gather_merge",
                      "gather_one_call", the latter's in-place gather included)
        joint_gather  joint outputs and joint LSEs gathered over ring and Ulysses ranks
        joint_grad    the all-reduce of the joint output's gradient (usp._GatherBack.backward)
        seq_gather    gather_sequence / all_gather_uneven, and the all-reduce of its backward
        tensor_all_reduce  tensor parallelism's sums of a row-parallel Linear's partial outputs
                      (``usp_dit.pipelines.tensor``: DTensor's ``RowwiseParallel`` makes the
                      all-reduce; the output's bytes are counted after it, forward only)
        broadcast     usp_dit.distributed.replica's broadcasts of a replica's inputs
        handshake     usp_dit.distributed.handshake's agreement gathers (Note [call handshake]): 3 int64 per
                      rank; on the slow path (ranks disagree) the pickled payloads of
                      all_gather_object (not the sizes and padding it adds). Kept apart so that it
                      never pollutes the others; the planner's model leaves it out (a verified
                      model call skips it)

    A caller outside the attention path that names no kind (the parallel VAE's gathers, the cfg
    output gather) is counted under its function's default kind.

    Cost when off: one check per call site, ``counting()`` (about 0.1 us on CPU, against tens of
    microseconds for the collective beside it). It asks ``torch.compiler.is_compiling()`` before
    reading the counter, which Dynamo folds away when it traces, so a compiled graph never reads,
    nor guards on, the module global (reading it first, a compiled function recompiled once when
    a counter opened). Traced code is not counted: its Python runs once at trace time, not once
    per call.

    One counter per process, module-global rather than a context variable on purpose: autograd
    may run a backward on another thread, whose collectives are part of the same call. Counters
    nest: an inner ``count_traffic`` sees only its own block, and the outer one sees it too.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

KINDS = (
    "ulysses_a2a", "ring_kv", "ring_grad", "ring_gather", "joint_gather", "joint_grad", "seq_gather", "broadcast",
    "handshake", "tensor_all_reduce",
)


class TrafficCounter:
    """Bytes this rank sent and received per kind while it was active (``count_traffic``)."""

    def __init__(self, outer: TrafficCounter | None = None) -> None:
        self._bytes: dict[str, list[int]] = {}
        self._outer = outer  # the counter this one is nested in: it sees these bytes too

    def add(self, kind: str, sent: int, received: int) -> None:
        """Add one collective's bytes (this counter and every counter it is nested in)."""
        counter = self
        while counter is not None:
            both = counter._bytes.setdefault(kind, [0, 0])
            both[0] += sent
            both[1] += received
            counter = counter._outer

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """``kind -> (bytes sent, bytes received)`` by this rank, for the kinds that moved anything."""
        return {kind: (s, r) for kind, (s, r) in sorted(self._bytes.items()) if s or r}

    def total(self) -> tuple[int, int]:
        """``(bytes sent, bytes received)`` by this rank over every kind."""
        return sum(s for s, _ in self._bytes.values()), sum(r for _, r in self._bytes.values())


ACTIVE: TrafficCounter | None = None  # the innermost active counter; None: counting is off


@contextlib.contextmanager
def count_traffic() -> Iterator[TrafficCounter]:
    """Count this process's traffic inside the block (Note [counting traffic])."""
    global ACTIVE
    counter = TrafficCounter(outer=ACTIVE)
    ACTIVE = counter
    try:
        yield counter
    finally:
        ACTIVE = counter._outer


def counting() -> bool:
    """True when a counter is active and the code runs eagerly: the one check of a call site."""
    return not torch.compiler.is_compiling() and ACTIVE is not None


def record(kind: str, sent: int, received: int) -> None:
    """Add ``sent`` and ``received`` bytes of ``kind`` to the active counter; nothing when none is
    active or under torch.compile.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS`` (only while counting).
    """
    if not counting():
        return
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a traffic kind; use one of {list(KINDS)}")
    ACTIVE.add(kind, int(sent), int(received))


def record_all_gather(kind: str, piece: int, group_size: int) -> None:
    """``record`` an all-gather of a ``piece`` of bytes (as it travels, padding included) over
    ``group_size`` ranks: ``(G - 1) piece`` each way."""
    record(kind, (group_size - 1) * piece, (group_size - 1) * piece)


def record_all_reduce(kind: str, n: int, group_size: int) -> None:
    """``record`` an all-reduce of ``n`` bytes over ``group_size`` ranks (``all_reduce_bytes`` each way)."""
    both = all_reduce_bytes(n, group_size)
    record(kind, both, both)


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def all_reduce_bytes(n: int, group_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``n`` bytes over ``group_size``
    ranks: ``2 (G - 1) n // G`` (Note [counting traffic])."""
    return 2 * (group_size - 1) * n // group_size
