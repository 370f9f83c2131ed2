"""Exact bytes each rank sends and receives per collective of one ``usp_attention`` call.

Layout: no tensors and no processes; a call is a ``CallShape`` of integers, a result is
``kind -> (bytes sent, bytes received)`` for one rank, the kinds of ``usp_dit.distributed.traffic`` (Note
[counting traffic]: what counts as traffic, and the all-reduce's rounding). tests/test_traffic.py
checks every number here against the bytes the code really posts, rank by rank, on CPU grids.

Note [predicted traffic]
    Sequence rank i = r U + u (ring rank r, Ulysses rank u) holds shard s_i (``split_sizes`` of
    S over P = U R, or the layout's ``shard_sizes``); its ring block is N = s_{rU} + .. +
    s_{rU+U-1}. Heads follow ``partition.head_plan``: query widths hq_v, K/V widths hk_v (K/V
    ranges may overlap under MQA / GQA on more ranks than K/V heads). e: the input's element
    bytes; a: an LSE's or a gradient accumulator's (float32, float64 for float64 inputs).

    ulysses_a2a (U > 1), per tensor of row bytes w = B D e (LSE: B a):
        sequence -> heads (q, k, v; grad out):  sent w s_u (sum_v hq_v - hq_u), received w hq_u (N - s_u)
        heads -> sequence (out, LSE; grad q, k, v): the reverse
        K/V use their widths hk_v; with return_lse the LSE goes heads -> sequence, and in the
        backward its gradient comes in like q (it travels whatever each rank's loss read: Note
        [joint gradient] in ``usp_dit.attention.usp``).
        With ``comm_dtype="fp8"`` (forward only) q, v and out rows are B (D + 4) bytes (Note [fp8
        wire]: e4m3 values and a float32 scale per (token, head)); k keeps w. On the ring (Note
        [fp8 ring V]) V's rows travel likewise: a token's K/V is B hr (D e + D + 4) bytes.
    ring_kv (R > 1, "stream", and every backward): R - 1 block rotations; a block of L tokens is
        2 B L hr D e (K and V stacked; hr = hk_u, or hq_u where the rank's query heads straddle K/V
        groups unevenly and get one K/V copy each). Rank r sends every block but r + 1's and
        receives every block but its own.
    ring_gather ("gather_merge", "gather_one_call"): K and V each all-gathered, padded to the
        longest block L_max: 2 (R - 1) B L_max hr D e each way (the in-place gather of batch 1 with
        equal blocks moves the same bytes).
    ring_grad (backward): R accumulator passes; every block's 2 B L hr D a, sent and received.
    joint_gather (J joint tokens): the rank's joint rows gathered over the ring (padded to the
        longest of ``split_sizes(J, R)``), then over the Ulysses ranks (padded to the widest hq):
        (R - 1) B j_max hq_u D e + (U - 1) B J hq_max D e each way; the joint LSE likewise in a
        without D when return_lse.
    joint_grad (backward): one all-reduce of the joint output's gradient, B J H D e bytes over P;
        with return_lse one more of the joint LSE's, B J H a bytes.

    A causal or block-causal mask changes which keys a block attends to, never what travels, so
    ``layout`` enters only through the shard sizes. ``gather_traffic`` is the output gather of a
    model (``gather_sequence``, kind "seq_gather"), which is no part of the attention call. Not
    modelled: the call handshake (kind "handshake": 3 int64 per rank gathered over the sequence
    group, skipped inside ``verified_calls``), which is not part of the call's data.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from usp_dit.distributed.fp8_wire import check_comm_dtype, wire_row_bytes
from usp_dit.distributed.traffic import all_reduce_bytes
from usp_dit.sharding.layouts import check_layout, shard_sizes
from usp_dit.sharding.partition import HeadPlan, head_plan, ring_block_sizes, split_sizes

SCHEDULES = ("stream", "gather_merge", "gather_one_call")
DTYPE_BYTES = (1, 2, 4, 8)


@dataclass(frozen=True)
class CallShape:
    """One ``usp_attention`` call in integers: the full sequence ``seq`` (the tokens sharded over the
    sequence group), ``joint`` replicated text tokens, element bytes of the inputs."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    joint: int = 0
    dtype_bytes: int = 2
    comm_dtype: str = "model"  # what the Ulysses exchanges carry (usp_dit.distributed.fp8_wire)

    @property
    def acc_bytes(self) -> int:
        """Element bytes of an LSE or a ring gradient accumulator: float32, float64 for float64."""
        return 8 if self.dtype_bytes == 8 else 4


class _Tally:
    """``kind -> [sent, received]`` being summed."""

    def __init__(self) -> None:
        self.bytes: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def add(self, kind: str, sent: int, received: int) -> None:
        self.bytes[kind][0] += sent
        self.bytes[kind][1] += received

    def result(self) -> dict[str, tuple[int, int]]:
        """The kinds that moved anything (as ``TrafficCounter.by_kind``)."""
        return {kind: (s, r) for kind, (s, r) in sorted(self.bytes.items()) if s or r}


def _seq_to_heads(widths: list[int], sizes: list[int], u: int, row: int) -> tuple[int, int]:
    """(sent, received) of Ulysses rank ``u`` in a sequence -> heads all-to-all: its shard's rows
    of every other rank's heads go out, its heads of every other shard come in."""
    return row * sizes[u] * (sum(widths) - widths[u]), row * widths[u] * (sum(sizes) - sizes[u])


def _heads_to_seq(widths: list[int], sizes: list[int], u: int, row: int) -> tuple[int, int]:
    """(sent, received) of the adjoint exchange: the reverse of ``_seq_to_heads``."""
    sent, received = _seq_to_heads(widths, sizes, u, row)
    return received, sent


def _ulysses(t: _Tally, shape: CallShape, heads: HeadPlan, sizes: list[int], u: int, backward: bool,
             return_lse: bool) -> None:
    """The Ulysses all-to-alls of one call (``sizes``: the shards of this rank's ring block)."""
    hq = [hi - lo for lo, hi in heads.q_ranges]
    hk = [hi - lo for lo, hi in heads.kv_ranges]
    row = shape.batch * shape.head_dim * shape.dtype_bytes
    wire = shape.batch * wire_row_bytes(shape.head_dim) if shape.comm_dtype == "fp8" else row
    moves = [(_seq_to_heads, hq, wire), (_seq_to_heads, hk, row), (_seq_to_heads, hk, wire),  # q, k, v
             (_heads_to_seq, hq, wire)]  # out
    if backward:  # grad q, k, v go home; grad out comes in like q
        moves += [(_heads_to_seq, hq, row), (_heads_to_seq, hk, row), (_heads_to_seq, hk, row), (_seq_to_heads, hq, row)]
    for exchange, widths, nbytes in moves:
        t.add("ulysses_a2a", *exchange(widths, sizes, u, nbytes))
    if return_lse:
        t.add("ulysses_a2a", *_heads_to_seq(hq, sizes, u, shape.batch * shape.acc_bytes))
        if backward:  # the LSE's gradient comes in like q's
            t.add("ulysses_a2a", *_seq_to_heads(hq, sizes, u, shape.batch * shape.acc_bytes))


def _ring(t: _Tally, shape: CallShape, blocks: list[int], r: int, ring_heads: int, schedule: str,
          backward: bool) -> None:
    """The ring's K/V transfers (forward by ``schedule``; the backward streams) and gradients."""
    ring = len(blocks)
    token = 2 * shape.batch * ring_heads * shape.head_dim  # K and V of one token, in elements
    k_bytes = shape.batch * ring_heads * shape.head_dim * shape.dtype_bytes  # K of one token
    # V of one token: its FP8 wire rows with comm_dtype="fp8" (Note [fp8 ring V]), else like K
    v_bytes = shape.batch * ring_heads * wire_row_bytes(shape.head_dim) if shape.comm_dtype == "fp8" else k_bytes
    stream = ((k_bytes + v_bytes) * (sum(blocks) - blocks[(r + 1) % ring]),
              (k_bytes + v_bytes) * (sum(blocks) - blocks[r]))
    if schedule == "stream":
        t.add("ring_kv", *stream)
    else:  # "gather_merge", "gather_one_call": K and V all-gathered, padded to the longest block
        gathered = (ring - 1) * (k_bytes + v_bytes) * max(blocks)
        t.add("ring_gather", gathered, gathered)
    if backward:
        t.add("ring_kv", *stream)
        t.add("ring_grad", token * shape.acc_bytes * sum(blocks), token * shape.acc_bytes * sum(blocks))


def _joint(t: _Tally, shape: CallShape, hq: list[int], r: int, u: int, ring: int, backward: bool,
           return_lse: bool) -> None:
    """The joint rows gathered over ring, then Ulysses ranks (and the LSE's); the gradient's all-reduce."""
    longest = max(split_sizes(shape.joint, ring))
    for elem in (shape.head_dim * shape.dtype_bytes,) + ((shape.acc_bytes,) if return_lse else ()):
        over_ring = (ring - 1) * shape.batch * longest * hq[u] * elem
        over_ulysses = (len(hq) - 1) * shape.batch * shape.joint * max(hq) * elem
        t.add("joint_gather", over_ring + over_ulysses, over_ring + over_ulysses)
    if backward:  # over the sequence group: P = ring x ulysses ranks
        joint_out = shape.batch * shape.joint * shape.heads * shape.head_dim * shape.dtype_bytes
        joint_lse = shape.batch * shape.joint * shape.heads * shape.acc_bytes
        for nbytes in (joint_out,) + ((joint_lse,) if return_lse else ()):
            both = all_reduce_bytes(nbytes, ring * len(hq))
            t.add("joint_grad", both, both)


def _check(shape: CallShape, ulysses: int, ring: int, schedule: str, rank: int | None, layout: str) -> None:
    """ValueError naming the argument for a call ``usp_attention`` would not make."""
    for name in ("batch", "seq", "heads", "kv_heads", "head_dim", "joint"):
        value = getattr(shape, name)
        if not isinstance(value, int) or value < (0 if name in ("seq", "joint") else 1):
            raise ValueError(f"shape.{name}={value!r} must be an int >= {0 if name in ('seq', 'joint') else 1}")
    if shape.dtype_bytes not in DTYPE_BYTES:
        raise ValueError(f"shape.dtype_bytes={shape.dtype_bytes!r}; use one of {list(DTYPE_BYTES)}")
    check_comm_dtype(shape.comm_dtype)
    for name, degree in (("ulysses", ulysses), ("ring", ring)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"{name}={degree!r} must be an int >= 1")
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r}; use one of {list(SCHEDULES)} (resolve 'auto' with "
            f"usp_dit.attention.ring.choose_schedule first: the bytes depend on the schedule that runs)"
        )
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < ulysses * ring):
        raise ValueError(f"rank={rank!r} must be a sequence rank in [0, {ulysses * ring})")
    check_layout(layout)


def attention_traffic(
    shape: CallShape, ulysses: int, ring: int, schedule: str, *, rank: int, backward: bool = False,
    return_lse: bool = False, layout: str = "contiguous",
) -> dict[str, tuple[int, int]]:
    """Bytes (sent, received) per kind by sequence rank ``rank`` (= ring_rank * ulysses +
    ulysses_rank) in one ``usp_attention`` call on a (``ulysses``, ``ring``) grid (Note [predicted
    traffic]); with ``backward`` the forward plus the backward. Kinds that move nothing are left
    out; a grid of one rank moves nothing.

    ``schedule``: the ring forward's schedule that runs ("stream", "gather_merge",
    "gather_one_call"; resolve "auto" with ``usp_dit.attention.ring.choose_schedule``); ignored when
    ``ring`` is 1. ``layout``: the sequence layout (only the shard sizes depend on it).

    Raises:
        ValueError: a shape, degree, schedule, rank or layout that no call has (more Ulysses ranks
            than heads included), naming the argument.
    """
    _check(shape, ulysses, ring, schedule, rank, layout)
    if backward and shape.comm_dtype == "fp8":
        raise ValueError("backward=True with shape.comm_dtype='fp8': the FP8 exchange is forward only "
                         "(usp_attention refuses it with gradients)")
    t = _Tally()
    if ulysses * ring == 1:
        return t.result()
    heads = head_plan(shape.heads, shape.kv_heads, ulysses)
    shards = shard_sizes(shape.seq, ring, ulysses, layout)  # contiguous: split_sizes(seq, P)
    r, u = divmod(rank, ulysses)
    hq = [hi - lo for lo, hi in heads.q_ranges]
    if ulysses > 1:
        _ulysses(t, shape, heads, shards[r * ulysses:(r + 1) * ulysses], u, backward, return_lse)
    if ring > 1:
        lo, hi = heads.kv_ranges[u]
        ring_heads = hi - lo if heads.kv_group[u] is not None else hq[u]  # else one K/V copy per query head
        _ring(t, shape, ring_block_sizes(shards, ulysses), r, ring_heads, schedule, backward)
    if shape.joint:
        _joint(t, shape, hq, r, u, ring, backward, return_lse)  # hq: one width per Ulysses rank
    return t.result()


def max_traffic(
    shape: CallShape, ulysses: int, ring: int, schedule: str, *, backward: bool = False, return_lse: bool = False,
    layout: str = "contiguous",
) -> dict[str, tuple[int, int]]:
    """Per kind, the most any rank sends and the most any rank receives (each taken over all
    sequence ranks: the two may come from different ranks) in one call; ``attention_traffic``'s
    arguments."""
    worst: dict[str, tuple[int, int]] = {}
    for rank in range(ulysses * ring):
        traffic = attention_traffic(shape, ulysses, ring, schedule, rank=rank, backward=backward,
                                    return_lse=return_lse, layout=layout)
        for kind, (s, r) in traffic.items():
            ws, wr = worst.get(kind, (0, 0))
            worst[kind] = (max(ws, s), max(wr, r))
    return dict(sorted(worst.items()))


def gather_traffic(
    seq: int, row_bytes: int, ulysses: int, ring: int, *, backward: bool = False, layout: str = "contiguous"
) -> dict[str, tuple[int, int]]:
    """Bytes (sent, received) of every rank in one ``gather_sequence`` of ``seq`` rows of
    ``row_bytes`` each (a model's output gather: batch x channels x element bytes per token) over
    the sequence group: every piece travels padded to the longest shard, (P - 1) of them each way;
    with ``backward``, plus the all-reduce of the whole gathered gradient. The same on every rank.

    Raises:
        ValueError: a negative ``seq`` or ``row_bytes``, a degree below 1 or an unknown layout.
    """
    if seq < 0 or row_bytes < 0:
        raise ValueError(f"seq={seq} and row_bytes={row_bytes} must be >= 0")
    for name, degree in (("ulysses", ulysses), ("ring", ring)):
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"{name}={degree!r} must be an int >= 1")
    check_layout(layout)
    p = ulysses * ring
    both = (p - 1) * max(shard_sizes(seq, ring, ulysses, layout)) * row_bytes
    if backward:
        both += all_reduce_bytes(seq * row_bytes, p)
    return {"seq_gather": (both, both)} if both else {}


def total_bytes(traffic: dict[str, tuple[int, int]], kinds: tuple[str, ...] | None = None) -> int:
    """Bytes sent plus bytes received over ``kinds`` (every kind by default) of a traffic dict."""
    return sum(s + r for kind, (s, r) in traffic.items() if kinds is None or kind in kinds)
