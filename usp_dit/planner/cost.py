"""One denoising step's predicted time, traffic and memory per rank on a (U, R, cfg) grid.

Layout: a ``ModelSpec`` (tokens, heads, layers, parameters; ``usp_dit.planner.models``), a grid
``(ulysses, ring, cfg)``, a ring schedule; every figure is per rank, the most loaded rank's
(shards differ by at most one token: the longest is taken).

Note [the cost model]
    A step is ``calls`` transformer calls (two per step for a "two_call" guided family on cfg
    degree 1, one otherwise) of batch ``b`` each; one call is ``layers`` attention layers plus the
    rest of the model, then the output gather. Per attention layer and rank:

        Ulysses all-to-alls     q, k, v, out: exact bytes (``volumes.attention_traffic``) over the
                                Ulysses group's link; not overlapped (the kernel waits for them)
        attention kernels       by schedule, each call priced by ``kernels.call_seconds`` at its size:
          R = 1                 one call, all S + J keys, h = ceil(H / U) heads
          "stream"              R calls of one K/V block each (+ J joint keys at step 0), R - 1 merges;
                                each step exposes max(0, transfer of the next block - its own call)
          "gather_merge"        the local block (+ J) while every block is gathered, then one call on
                                the R - 1 remote blocks, one merge pass; exposes max(0, gather - local)
          "gather_one_call"     the whole gather exposed, then one call on all S + J keys
        joint outputs           gathered over ring and Ulysses ranks (exact bytes), exposed
        cross-attention         ("cross" text) a local call of the rank's queries on T text keys

    The rest of the model runs on the rank's S / P tokens (plus the replicated text of "joint"
    families) at the family's measured ``other_rate``; the output (S x out_channels) is gathered
    once per call. Merges are memory-bound passes over the running result (3 x fp32 reads and
    writes of rows x h x D at the GPU's memory bandwidth). Memory: ``usp_dit.planner.memory``
    Note [memory per rank] (weights by placement, text encoders, activations, the VAE's share).
    Links: ``hardware`` Note [link defaults]. What is estimated rather than measured is said there
    and in ``kernels`` Note [kernel tables].

Note [sharded weights cost]
    With ``shard_weights`` every call all-gathers every FSDP2 unit of the transformer that runs
    (Note [sharded weights]): each rank receives (P - 1) / P of a unit's bytes, over the link of
    the replica's P ranks (``group_link(interconnect, P)``). Block i + 1's gather is issued while
    block i computes (the prefetch), so it shows only where it takes longer; the outer units
    (embedders, modulation, final layer) are gathered when they run, and block 0 while they do:

        weight_gather per call = g(outer) + g(block 0) + sum_i max(0, g(block i+1) - c_i)

    g(bytes) = the link's time for (P - 1) / P x bytes, one collective; c_i = block i's share of
    the call's compute: the call's attention work (kernels, all-to-alls, exposed ring, joint
    gathers) over the blocks evenly, plus the rest of the model by block i's share of the blocks'
    parameters. Per step: x the calls a step makes (the weights are resharded after each call).
    Not modelled: the gathers' contention with the Ulysses and ring traffic on the same links.
    The text encoders' placement costs nothing a step: "shard" gathers the encoder once per
    prompt encode ((P - 1) / P of its bytes; ``encode_gather_ms``), "rank0" broadcasts the
    embeddings once.

Note [tensor parallel cost]
    A grid with tensor degree T (``enable_usp(..., tensor_degree=T)``; the innermost axis, so a
    tensor group is T neighbouring GPUs and a Ulysses group's ranks lie T apart) cuts each block's
    heads and MLP columns (``models`` Note [tensor cuts]). Per call and rank:

        attention               on a tensor rank's heads, ceil(H / T), split over U as before
                                (ceil(ceil(H / T) / U) a Ulysses rank); the all-to-alls and ring
                                transfers carry those heads (exact bytes, ``volumes``)
        rest of the model       the rank's tokens (S / (U R): the tensor ranks hold the same
                                ones) x the calibrated rate, its cut share at C_T / C: the time
                                2 x parameters x tokens / other_rate x (1 - C / N + C_T / N);
                                C: the cut parameters, C_T a tensor rank's share (padding
                                included), N the parameters applied per token: all but the cut
                                blocks' uncut ones, which are their AdaLN modulation (applied
                                to the (b, d) conditioning once per sample, not per token; the
                                norms and row-parallel biases beside it are negligible)
        tensor_all_reduce       per block, ``reduces`` all-reduces of the (b, n, d) bf16 partial
                                outputs (n: the rank's tokens, the joint text included) over the T
                                ranks, the ring all-reduce's volume 2 (T - 1) / T x bytes each way
                                (``usp_dit.distributed.traffic.all_reduce_bytes``), ``collectives``
                                calls a block at the link's latency each; not overlapped (the next
                                Linear waits for the sum). DTensor makes these all-reduces inside
                                ``RowwiseParallel``; ``usp_dit.distributed.traffic`` counts them
                                (kind "tensor_all_reduce", forward), equal to this prediction on
                                the worst rank (tests/test_tensor_parallel.py).
    Sharded on top (Note [sharded tensor-parallel weights] in usp_dit.pipelines.weights): a block's
    uncut part is gathered over the whole replica ((P T - 1) / (P T) of it received), its cut
    part's tensor share over the P sequence ranks ((P - 1) / P; nothing where P = 1: it stays
    resident), with the prefetch of Note [sharded weights cost].
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from usp_dit.kernels.policy import attention_flops
from usp_dit.planner import kernels
from usp_dit.planner import memory as memory_model
from usp_dit.planner.hardware import GPU, Link, group_link
from usp_dit.planner.models import ModelSpec
from usp_dit.planner.volumes import CallShape, all_reduce_bytes, gather_traffic, max_traffic

SCHEDULES = ("stream", "gather_merge", "gather_one_call")
BF16 = 2


@dataclass(frozen=True)
class Grid:
    ulysses: int
    ring: int
    cfg: int = 1
    tensor: int = 1  # the tensor-parallel degree T, innermost (Note [tensor parallel cost])

    @property
    def sequence(self) -> int:
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.sequence * self.cfg * self.tensor


@dataclass
class Prediction:
    """Predicted figures of one step on one grid (per rank); ``parts`` in ms per step."""

    grid: Grid
    schedule: str
    step_ms: float
    comm_bytes_per_rank: float  # sent + received, one step (the weight all-gathers included)
    memory_per_rank_gib: float  # the rank's peak (``memory.total``)
    parts: dict[str, float] = field(default_factory=dict)
    calls_per_step: int = 1
    call_batch: int = 1
    memory: memory_model.MemoryBreakdown | None = None
    encode_gather_ms: float = 0.0  # "shard" text encoders: their all-gather, once per prompt encode

    @property
    def shard_weights(self) -> bool:
        return bool(self.memory and self.memory.shard_weights)

    @property
    def text_encoder(self) -> str:
        return self.memory.text_encoder if self.memory else "replicate"

    @property
    def tensor(self) -> int:
        return self.grid.tensor


def call_batch(spec: ModelSpec, grid: Grid, batch: int, cfg: bool) -> tuple[int, int]:
    """``(calls per step, batch of each call)`` on one cfg group (Note [the cost model]).

    Raises:
        ValueError: a cfg degree the guidance cannot use (nothing to split, or an odd batch).
    """
    branches = 2 if cfg and spec.guidance != "distilled" else 1
    if grid.cfg not in (1, 2):
        raise ValueError(f"cfg_degree={grid.cfg}: only 1 or 2 (the two branches of classifier-free guidance)")
    if spec.guidance == "two_call" and branches == 2:
        return (2, batch) if grid.cfg == 1 else (1, batch)
    total = batch * branches
    if total % grid.cfg:
        raise ValueError(f"cfg_degree={grid.cfg} cannot split a batch of {total} (batch {batch} x {branches} branches)")
    return 1, total // grid.cfg


def _links(grid: Grid, interconnect: str) -> tuple[Link, Link, Link]:
    """The links of the Ulysses, ring and sequence groups (the mesh's inner axes first: the tensor
    axis innermost, so a Ulysses group's ranks lie T apart)."""
    return (group_link(interconnect, grid.ulysses * grid.tensor), group_link(interconnect, grid.sequence * grid.tensor),
            group_link(interconnect, grid.sequence * grid.tensor))


def _merge_seconds(rows: int, heads: int, head_dim: int, blocks: int, gpu: GPU) -> float:
    return blocks * 3 * rows * heads * head_dim * 4 / gpu.memory_bandwidth


def _attention_seconds(spec: ModelSpec, grid: Grid, schedule: str, b: int, gpu: GPU, backend: str,
                       traffic: dict, ring_link: Link) -> tuple[float, float]:
    """``(kernel + merge seconds, exposed ring transfer seconds)`` of one attention layer."""
    u, r = grid.ulysses, grid.ring
    seq, joint = spec.sequence, spec.joint
    h, d = math.ceil(math.ceil(spec.heads / grid.tensor) / u), spec.head_dim
    block = math.ceil(seq / r)
    rows = block + math.ceil(joint / r)

    def call(keys: int, queries: int = rows) -> float:
        return kernels.call_seconds(attention_flops(b, queries, keys, h, d), d, backend=backend)

    if r == 1:
        return call(seq + joint, seq + joint), 0.0
    if schedule == "stream":
        kv_step = ring_link.seconds(max(traffic.get("ring_kv", (0, 0))) / (r - 1))
        first, rest = call(block + joint), call(block)
        exposed = max(0.0, kv_step - first) + (r - 2) * max(0.0, kv_step - rest)
        return first + (r - 1) * rest + _merge_seconds(rows, h, d, r - 1, gpu), exposed
    gather = ring_link.seconds(max(traffic.get("ring_gather", (0, 0))))
    if schedule == "gather_merge":
        local = call(block + joint)
        remote = call((r - 1) * block)
        return local + remote + _merge_seconds(rows, h, d, 1, gpu), max(0.0, gather - local)
    if schedule == "gather_one_call":
        return call(seq + joint), gather
    raise ValueError(f"ring_schedule={schedule!r}; choose one of {list(SCHEDULES)}")


def _gather_seconds(nbytes: float, replica: int, link: Link) -> float:
    """One all-gather in which each rank receives (P - 1) / P of ``nbytes``."""
    return link.seconds(nbytes * (replica - 1) / replica)


def _received_units(spec: ModelSpec, replica: int, tensor: int) -> tuple[float, list[tuple[float, float]]]:
    """What one rank receives in one call's weight all-gathers: ``(outer, [(block, block params)])``
    in run order (Note [sharded weights cost]; with tensor parallelism Note [tensor parallel cost])."""
    outer, blocks = memory_model.gathered_units(spec)
    whole = (replica - 1) / replica
    if tensor == 1:
        return outer * whole, [(b * whole, p) for b, p in blocks]
    sequence = (replica // tensor - 1) / (replica // tensor)
    memory = memory_model.model_memory(spec)
    shares = []  # per block, in the order of gathered_units: (uncut fraction, the cut tensor share's fraction)
    for g in memory.blocks:
        cut = g.cut.nbytes / g.nbytes if g.cut is not None else 0.0
        local = memory_model.cut_bytes(replace(memory, blocks=(g,), experts=1), spec.heads, tensor)[1] / g.nbytes
        shares.extend([(1 - cut, local)] * g.count)
    return outer * whole, [(b * (u * whole + c * sequence), p) for (b, p), (u, c) in zip(blocks, shares)]


def weight_gather_seconds(spec: ModelSpec, replica: int, link: Link, attention_s: float, rest_s: float,
                          tensor: int = 1) -> float:
    """Exposed seconds of one call's weight all-gathers (Note [sharded weights cost]);
    ``attention_s`` / ``rest_s``: the call's attention work and the rest of the model."""
    outer, blocks = _received_units(spec, replica, tensor)
    if replica == 1 or not blocks:
        return 0.0
    total_params = sum(p for _, p in blocks) or 1.0
    exposed = link.seconds(outer) + link.seconds(blocks[0][0])
    for (_, params), (following, _) in itertools.pairwise(blocks):
        compute = attention_s / len(blocks) + rest_s * params / total_params
        exposed += max(0.0, link.seconds(following) - compute)
    return exposed


def placed(spec: ModelSpec, base: Prediction, *, shard_weights: bool, text_encoder: str,
           interconnect: str = "nvlink") -> Prediction:
    """``base`` (a prediction in any placement) in another placement of the weights and text
    encoders: its memory (Note [memory per rank]) and, sharded, the weight all-gathers' exposed
    time and bytes (Note [sharded weights cost])."""
    grid, calls = base.grid, base.calls_per_step
    replica, tensor = grid.world, grid.tensor
    mem = memory_model.breakdown(spec, grid.ulysses, grid.ring, replica, base.schedule, base.call_batch,
                                 shard_weights=shard_weights, text_encoder=text_encoder, tensor=tensor)
    link = group_link(interconnect, replica)
    parts = {k: v for k, v in base.parts.items() if k != "weight_gather"}
    nbytes = base.comm_bytes_per_rank - (weight_gather_bytes(spec, calls, replica, tensor) if base.shard_weights
                                         else 0.0)
    parts["weight_gather"] = 0.0
    if mem.shard_weights:
        attention_ms = sum(parts.get(k, 0.0) for k in ("attention", "ulysses_all_to_all", "ring_exposed",
                                                       "joint_gathers", "tensor_all_reduce"))
        parts["weight_gather"] = 1e3 * calls * weight_gather_seconds(
            spec, replica, link, attention_ms / calls / 1e3, parts["rest_of_model"] / calls / 1e3, tensor)
        nbytes += weight_gather_bytes(spec, calls, replica, tensor)
    encode_ms = 0.0
    if mem.text_encoder == "shard":
        encode_ms = 1e3 * _gather_seconds(memory_model.model_memory(spec).encoder_bytes, replica, link)
    return Prediction(grid, base.schedule, sum(parts.values()), nbytes, mem.total, parts, calls, base.call_batch,
                      mem, encode_ms)


def weight_gather_bytes(spec: ModelSpec, calls: int, replica: int, tensor: int = 1) -> float:
    """Bytes a rank sends and receives a step in the sharded weights' all-gathers: (P - 1) / P of
    the running transformer each way, every call (tensor parallel: Note [tensor parallel cost])."""
    if tensor > 1:
        outer, blocks = _received_units(spec, replica, tensor)
        return 2 * calls * (outer + sum(b for b, _ in blocks))
    outer, blocks = memory_model.gathered_units(spec)
    return 2 * calls * (outer + sum(b for b, _ in blocks)) * (replica - 1) / replica


def cut_params(spec: ModelSpec, tensor: int) -> tuple[float, float, float]:
    """``(whole, a tensor rank's, per-token)`` parameters of one transformer: those tensor parallelism
    cuts, a tensor rank's share of them, and every parameter applied per token (the cut blocks'
    uncut parameters left out: Note [tensor parallel cost])."""
    memory = memory_model.model_memory(spec)
    whole = local = per_sample = 0.0
    for g in memory.blocks:
        if g.cut is not None:
            whole += g.cut.params
            local += g.cut.head_params * memory_model.split_share(spec.heads, tensor) \
                + g.cut.width_params * memory_model.split_share(g.mlp, tensor)
            per_sample += g.params - g.cut.params
    return whole, local, memory.transformer_params - per_sample


def tensor_all_reduce_bytes(spec: ModelSpec, grid: Grid, call_batch: int) -> tuple[int, int]:
    """``(bytes each way, collectives)`` of one call's tensor-parallel all-reduces on one rank (Note
    [tensor parallel cost]): per block, ``reduces`` partial outputs of (b, n, d) in bf16 over the T
    ranks, n the rank's tokens; the ring all-reduce's volume (``all_reduce_bytes``)."""
    if grid.tensor == 1:
        return 0, 0
    tokens = memory_model.rank_tokens(spec, grid.ulysses, grid.ring)
    nbytes = calls = 0
    for g in memory_model.model_memory(spec).blocks:
        if g.cut is not None:
            nbytes += g.count * g.cut.reduces * all_reduce_bytes(call_batch * tokens * g.hidden * BF16, grid.tensor)
            calls += g.count * g.cut.collectives
    return nbytes, calls


def predict(spec: ModelSpec, grid: Grid, schedule: str, *, batch: int = 1, cfg: bool = False,
            interconnect: str = "nvlink", gpu: GPU, backend: str = kernels.DEFAULT_BACKEND,
            shard_weights: bool = False, text_encoder: str = "replicate", comm_dtype: str = "model") -> Prediction:
    """One step of ``spec`` on ``grid`` (Note [the cost model]) with its weights and text
    encoders placed as given (Note [memory per rank], Note [sharded weights cost]); ``comm_dtype``
    "fp8" prices the Ulysses exchanges in the FP8 wire format (Note [fp8 wire]).

    Raises:
        ValueError: a grid the model cannot run (more Ulysses ranks than heads, a cfg degree the
            guidance cannot use), an unknown schedule or text encoder placement.
    """
    memory_model.check_text_encoder(text_encoder)
    t = memory_model.check_tensor(spec, grid.tensor)
    heads, kv_heads = math.ceil(spec.heads / t), math.ceil(spec.kv_heads / t)  # a tensor rank's
    if grid.ulysses > heads:
        raise ValueError(f"ulysses_degree={grid.ulysses} exceeds {spec.name}'s {heads} heads"
                         + (f" of a tensor rank (tensor_degree={t})" if t > 1 else ""))
    calls, b = call_batch(spec, grid, batch, cfg)
    schedule = schedule if grid.ring > 1 else "none"
    u_link, r_link, s_link = _links(grid, interconnect)
    seq, joint = spec.sequence, spec.joint
    shape = CallShape(b, seq, heads, kv_heads, spec.head_dim, joint, BF16, comm_dtype)
    traffic = max_traffic(shape, grid.ulysses, grid.ring, schedule if grid.ring > 1 else "stream") if grid.sequence > 1 else {}
    attn, ring_exposed = _attention_seconds(spec, grid, schedule, b, gpu, backend, traffic, r_link)
    a2a = u_link.seconds(max(traffic.get("ulysses_a2a", (0, 0))), calls=4) if grid.ulysses > 1 else 0.0
    joint_comm = s_link.seconds(max(traffic.get("joint_gather", (0, 0))), calls=2) if joint and grid.sequence > 1 else 0.0
    cross = 0.0
    if spec.text_mode == "cross":
        cross = kernels.call_seconds(attention_flops(b, math.ceil(seq / grid.sequence), spec.text, heads,
                                                     spec.head_dim), spec.head_dim, backend=backend)
    tokens_here = math.ceil(seq / grid.sequence) + joint
    other = 2 * spec.params * b * tokens_here / spec.other_rate
    if t > 1:  # the cut Linears' share of the per-token work runs on a tensor rank's share of them
        whole, local, per_token = cut_params(spec, t)
        other *= 1 - whole / per_token + local / per_token
    reduce_bytes, reduce_calls = tensor_all_reduce_bytes(spec, grid, b)
    reduce = group_link(interconnect, t).seconds(reduce_bytes, calls=reduce_calls) if t > 1 else 0.0
    out = gather_traffic(seq, b * spec.out_channels * BF16, grid.ulysses, grid.ring).get("seq_gather", (0, 0))
    gather = s_link.seconds(max(out)) if grid.sequence > 1 else 0.0
    per_call = {
        "attention": spec.layers * (attn + cross), "ulysses_all_to_all": spec.layers * a2a,
        "ring_exposed": spec.layers * ring_exposed, "joint_gathers": spec.layers * joint_comm,
        "rest_of_model": other, "output_gather": gather, "tensor_all_reduce": reduce,
    }
    parts = {k: 1e3 * calls * v for k, v in per_call.items()}
    nbytes = calls * (spec.layers * sum(s + r for s, r in traffic.values()) + sum(out) + 2 * reduce_bytes)
    base = Prediction(grid, schedule, sum(parts.values()), nbytes, 0.0, parts, calls, b)
    return placed(spec, base, shard_weights=shard_weights, text_encoder=text_encoder, interconnect=interconnect)
