"""Communication for USP: the Ulysses all-to-all (sequence <-> heads), uneven gathers, the ring.

Layout: activations are ``(batch, seq, heads, *rest)`` (``rest`` is ``(head_dim,)`` for Q/K/V and
outputs, empty for a log-sum-exp). Every op accepts uneven sizes: sequence shards of different
lengths and head ranges of different widths, overlapping head ranges included (several ranks reading
the same K/V head under MQA). All differentiable ops are adjoint pairs, so their backward is exact.

Note [Ulysses all-to-all]
    rank u holds x_u (B, S_u, H, ...)            rank u receives y_u (B, S_0+..+S_{U-1}, h_u, ...)
    x_u[:, :, lo_v:hi_v] ──── to rank v ────►    y_v[:, off_u:off_u+S_u]
    The backward sends each piece home and sums pieces of overlapping head ranges.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from usp_dit.distributed import traffic

# torch >= 2.12 renamed all_gather_tensor to all_gather_single (same semantics).
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)


def exchange(
    chunks: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], group: dist.ProcessGroup, kind: str = "ulysses_a2a"
) -> list[torch.Tensor]:
    """All-to-all of arbitrarily shaped pieces: ``chunks[v]`` goes to rank ``v`` of ``group``.

    Returns the pieces received from each rank, ``recv_shapes[u]`` being the shape of the piece from
    rank ``u``. Pieces travel flattened in one ``all_to_all_single`` with uneven split sizes.
    ``kind``: what is counted (``usp_dit.distributed.traffic``; the pieces of other ranks only).
    """
    in_splits = [c.numel() for c in chunks]
    # One copy per chunk straight into its slot of the send buffer (a reshape + cat would copy twice).
    send = chunks[0].new_empty(sum(in_splits))
    for piece, chunk in zip(send.split(in_splits), chunks):
        piece.view(chunk.shape).copy_(chunk)
    out_splits = [math.prod(s) for s in recv_shapes]
    if traffic.counting():
        me, size = dist.get_rank(group), send.element_size()
        traffic.record(kind, size * (sum(in_splits) - in_splits[me]), size * (sum(out_splits) - out_splits[me]))
    recv = funcol.wait_tensor(funcol.all_to_all_single(send, out_splits, in_splits, group))
    return [piece.view(shape) for piece, shape in zip(recv.split(out_splits), recv_shapes)]


@dataclass(frozen=True)
class A2APlan:
    """One Ulysses exchange: who holds which sequence shard and who takes which heads.

    ``seq_sizes[u]``: shard length on Ulysses rank ``u``; ``head_ranges[u]``: heads rank ``u`` takes;
    ``num_heads``: heads of the sequence-sharded tensor; ``rank``: this rank in ``group``.
    """

    group: dist.ProcessGroup
    rank: int
    seq_sizes: tuple[int, ...]
    head_ranges: tuple[tuple[int, int], ...]
    num_heads: int

    @property
    def heads_partition(self) -> bool:
        """True when the head ranges tile all heads exactly once (no summing needed)."""
        edges = [lo for lo, _ in self.head_ranges] + [self.head_ranges[-1][1]]
        return edges[0] == 0 and edges[-1] == self.num_heads and all(
            self.head_ranges[i][1] == edges[i + 1] for i in range(len(self.head_ranges))
        )


def seq_to_heads(x: torch.Tensor, plan: A2APlan) -> torch.Tensor:
    """``(B, S_me, H, *rest)`` sequence shard -> ``(B, sum(S), h_me, *rest)`` head slice (no autograd)."""
    b, rest = x.shape[0], tuple(x.shape[3:])
    lo_me, hi_me = plan.head_ranges[plan.rank]
    chunks = [x[:, :, lo:hi] for lo, hi in plan.head_ranges]
    shapes = [(b, s, hi_me - lo_me, *rest) for s in plan.seq_sizes]
    return torch.cat(exchange(chunks, shapes, plan.group), dim=1)  # one copy into the block


def heads_to_seq(y: torch.Tensor, plan: A2APlan) -> torch.Tensor:
    """Adjoint of ``seq_to_heads``: ``(B, sum(S), h_me, *rest)`` -> ``(B, S_me, H, *rest)``.

    Pieces of overlapping head ranges are summed (the adjoint of sending one head to several ranks).
    """
    b, rest = y.shape[0], tuple(y.shape[3:])
    s_me = plan.seq_sizes[plan.rank]
    chunks = list(y.split(list(plan.seq_sizes), dim=1))
    shapes = [(b, s_me, hi - lo, *rest) for lo, hi in plan.head_ranges]
    pieces = exchange(chunks, shapes, plan.group)
    if plan.heads_partition:
        return torch.cat(pieces, dim=2)
    out = y.new_zeros((b, s_me, plan.num_heads, *rest))
    for (lo, hi), piece in zip(plan.head_ranges, pieces):
        out[:, :, lo:hi] += piece
    return out


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: A2APlan) -> torch.Tensor:
        ctx.plan = plan
        return seq_to_heads(x, plan)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return heads_to_seq(grad.contiguous(), ctx.plan), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, plan: A2APlan) -> torch.Tensor:
        ctx.plan = plan
        return heads_to_seq(y, plan)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return seq_to_heads(grad.contiguous(), ctx.plan), None


def all_to_all_seq_to_heads(x: torch.Tensor, plan: A2APlan) -> torch.Tensor:
    """Differentiable ``seq_to_heads``; backward sends gradients home (summing shared heads)."""
    return _SeqToHeads.apply(x, plan)


def all_to_all_heads_to_seq(y: torch.Tensor, plan: A2APlan) -> torch.Tensor:
    """Differentiable ``heads_to_seq``."""
    return _HeadsToSeq.apply(y, plan)


def gather_uneven(
    x: torch.Tensor, sizes: list[int], dim: int, group: dist.ProcessGroup, kind: str = "seq_gather"
) -> torch.Tensor:
    """All-gather pieces of different lengths along ``dim`` (no autograd).

    Pieces are padded to the longest, gathered in one collective and trimmed; the result is
    contiguous. ``kind``: what is counted (``usp_dit.distributed.traffic``: the padded pieces).
    """
    longest = max(sizes)
    x0 = x.movedim(dim, 0)
    if x0.shape[0] < longest:
        pad = x0.new_zeros((longest - x0.shape[0], *x0.shape[1:]))
        x0 = torch.cat([x0, pad])
    if traffic.counting():
        traffic.record_all_gather(kind, traffic.nbytes(x0), len(sizes))
    full = funcol.wait_tensor(_all_gather(x0.contiguous(), 0, group))
    # Each piece moved back before the one copy into the result, which is so laid out like x
    # (contiguous: a gathered model output reshapes like the stock one).
    pieces = [p[:n].movedim(0, dim) for p, n in zip(full.split(longest), sizes)]
    return torch.cat(pieces, dim=dim)


class _GatherUneven(torch.autograd.Function):
    """All-gather whose backward sums the gradient over ranks and keeps this rank's piece.

    That is the adjoint of "every rank's loss reads the gathered tensor": the gradient of the sum
    of all ranks' losses.
    """

    @staticmethod
    def forward(ctx, x, sizes, dim, group, kind):
        ctx.sizes, ctx.dim, ctx.group, ctx.kind = sizes, dim, group, kind
        return gather_uneven(x, sizes, dim, group, kind)

    @staticmethod
    def backward(ctx, grad):
        if traffic.counting():
            traffic.record_all_reduce(ctx.kind, traffic.nbytes(grad), len(ctx.sizes))
        total = funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group))
        rank = dist.get_rank(ctx.group)
        start = sum(ctx.sizes[:rank])
        return total.narrow(ctx.dim, start, ctx.sizes[rank]), None, None, None, None


def start_all_gather(x: torch.Tensor, group: dist.ProcessGroup, kind: str = "ring_gather") -> torch.Tensor:
    """Post an all-gather of ``x`` (B, ...) along dim 0 and return at once; the result,
    (group size * B, ...) in rank order, is ready after ``wait_gathered``. ``kind``: what is
    counted (``usp_dit.distributed.traffic``)."""
    if traffic.counting():
        traffic.record_all_gather(kind, traffic.nbytes(x), dist.get_world_size(group))
    return _all_gather(x.contiguous(), 0, group)


# all_gather_single replaces all_gather_into_tensor in newer torch (same arguments).
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def start_all_gather_into(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup, kind: str = "ring_gather"):
    """Post an all-gather of ``x`` (n, ...) into ``out`` (group size * n, ...), a contiguous tensor
    that may be a slice of a larger buffer, and return the work handle (``out`` is ready after its
    ``wait()``). Not differentiable: for forward-only gathers into buffers the caller lays out.
    ``kind``: what is counted (``usp_dit.distributed.traffic``)."""
    if traffic.counting():
        traffic.record_all_gather(kind, traffic.nbytes(x), dist.get_world_size(group))
    return _all_gather_into(out, x.contiguous(), group=group, async_op=True)


def wait_gathered(pending: torch.Tensor) -> torch.Tensor:
    """The result of ``start_all_gather`` (waits for the transfer)."""
    return funcol.wait_tensor(pending)


def all_gather_uneven(
    x: torch.Tensor, sizes: list[int], dim: int, group: dist.ProcessGroup | None, kind: str = "seq_gather"
) -> torch.Tensor:
    """Differentiable all-gather of pieces of lengths ``sizes`` along ``dim`` (identity without a
    group); ``kind``: what its traffic is counted as (``usp_dit.distributed.traffic``), backward included."""
    if group is None:
        return x
    return _GatherUneven.apply(x, list(sizes), dim, group, kind)


# Note [draining a posted transfer]
#     A caller that raises between ``post`` and ``receive`` (a kernel refusing a block, an
#     interrupt) must not just drop the transfer: gloo's send/recv work holds the transport's
#     buffer, and a receive destroyed in flight lets the peer's bytes land in freed memory (the
#     "malloc(): unaligned tcache chunk" crashes of long-lived test ranks, jobs after the one that
#     raised), or a later call on the same tag take the stale block. So ring loops ``drain()``
#     what they posted while unwinding: wait for it (bounded: a peer that never posts its side
#     cannot hang the error), keep both buffers alive until then, and re-raise the first error.
DRAIN_TIMEOUT = timedelta(seconds=60)


class RingExchanger:
    """Passes tensors to the next rank of a ring and receives from the previous one, non-blocking.

    ``post`` sends one tensor on and returns a function that yields the tensor received, so the
    caller computes on the current block while the next one travels (double buffering: the buffer
    being sent is never the one being filled). Two ways to move it (Note [traced ring]):

    - eager: one ``batch_isend_irecv`` (point to point); empty tensors are skipped on both sides,
      which stay in step because both know every block's size;
    - under ``torch.compile``: one functional ``all_to_all_single`` whose only non-empty splits are
      "to the next rank" and "from the previous one", which Dynamo traces and inductor schedules
      (its wait sinks to the first use, so the transfer still overlaps the block's attention).

    Note [traced ring]
        Point-to-point ops cannot be traced, so a compiled ring rotates its blocks with the
        collective every rank of the ring joins at every step (the loop is the same on all ranks,
        so the collectives match even where a rank's block is empty). It moves the same bytes.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(
        self, send: torch.Tensor | None, recv: torch.Tensor | None, tag: int = 0, kind: str = "ring_kv"
    ) -> list[dist.Work]:
        """Post ``send`` to the next rank and ``recv`` from the previous (point to point); returns
        the handles. Streams that may be in flight together (K/V blocks and their gradients) use
        different tags. The caller keeps both buffers alive until ``wait``. ``kind``: what is
        counted (``usp_dit.distributed.traffic``)."""
        if traffic.counting():
            sent, received = (0 if t is None else traffic.nbytes(t) for t in (send, recv))
            traffic.record(kind, sent, received)
        ops = []
        if send is not None and send.numel():
            assert send.is_contiguous(), "ring send buffers must be contiguous"
            ops.append(dist.P2POp(dist.isend, send, self.next_peer, self.group, tag))
        if recv is not None and recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self.prev_peer, self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def wait(works: list[dist.Work]) -> None:
        """Block until the transfers of one ``start`` are done."""
        for work in works:
            work.wait()

    def post(self, send: torch.Tensor, recv_shape: tuple[int, ...], dtype: torch.dtype, tag: int = 0,
             kind: str = "ring_kv"):
        """Send ``send`` (contiguous) to the next rank; returns ``receive()``, which waits for and
        returns the ``recv_shape`` tensor of ``dtype`` from the previous rank (Note [traced ring]).
        ``kind``: what is counted (``usp_dit.distributed.traffic``)."""
        if torch.compiler.is_compiling():
            return self._post_traced(send, recv_shape, kind)
        recv = send.new_empty(recv_shape, dtype=dtype)
        works = self.start(send, recv, tag, kind)

        def receive() -> torch.Tensor:
            self.wait(works)
            del_after = send  # noqa: F841 -- the send buffer must outlive its transfer
            return recv

        def drain(timeout: timedelta = DRAIN_TIMEOUT) -> None:
            """Note [draining a posted transfer]: finish it without using it (a caller unwinding)."""
            for work in works:
                with contextlib.suppress(Exception):  # the error being unwound is the one to report
                    work.wait(timeout)
            del_after = (send, recv)  # noqa: F841 -- both buffers outlive their transfers

        receive.drain = drain
        return receive

    def _post_traced(self, send: torch.Tensor, recv_shape: tuple[int, ...], kind: str = "ring_kv"):
        """The functional rotation of Note [traced ring] (``send``'s dtype travels)."""
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        in_splits, out_splits = [0] * self.size, [0] * self.size
        in_splits[nxt] = send.numel()
        out_splits[prev] = math.prod(recv_shape)
        if traffic.counting():  # only when run eagerly (Note [counting traffic])
            traffic.record(kind, traffic.nbytes(send), out_splits[prev] * send.element_size())
        pending = funcol.all_to_all_single(send.reshape(-1), out_splits, in_splits, self.group)

        def receive() -> torch.Tensor:
            return funcol.wait_tensor(pending).view(recv_shape)

        receive.drain = lambda timeout=None: None  # a traced collective: the graph owns its buffers
        return receive
