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
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from usp_dit.planner import kernels
from usp_dit.planner import memory as memory_model
from usp_dit.planner.hardware import GPU, Link, group_link
from usp_dit.planner.models import ModelSpec
from usp_dit.planner.volumes import CallShape, gather_traffic, max_traffic

SCHEDULES = ("stream", "gather_merge", "gather_one_call")
BF16 = 2


@dataclass(frozen=True)
class Grid:
    ulysses: int
    ring: int
    cfg: int = 1

    @property
    def sequence(self) -> int:
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.sequence * self.cfg


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
    """The links of the Ulysses, ring and sequence groups (the mesh's inner axes first)."""
    return (group_link(interconnect, grid.ulysses), group_link(interconnect, grid.sequence),
            group_link(interconnect, grid.sequence))


def _merge_seconds(rows: int, heads: int, head_dim: int, blocks: int, gpu: GPU) -> float:
    return blocks * 3 * rows * heads * head_dim * 4 / gpu.memory_bandwidth


def _attention_seconds(spec: ModelSpec, grid: Grid, schedule: str, b: int, gpu: GPU, backend: str,
                       traffic: dict, ring_link: Link) -> tuple[float, float]:
    """``(kernel + merge seconds, exposed ring transfer seconds)`` of one attention layer."""
    u, r = grid.ulysses, grid.ring
    seq, joint = spec.sequence, spec.joint
    h, d = math.ceil(spec.heads / u), spec.head_dim
    block = math.ceil(seq / r)
    rows = block + math.ceil(joint / r)

    def call(keys: int, queries: int = rows) -> float:
        return kernels.call_seconds(kernels.attention_flops(b, queries, keys, h, d), d, backend=backend)

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


def weight_gather_seconds(spec: ModelSpec, replica: int, link: Link, attention_s: float, rest_s: float) -> float:
    """Exposed seconds of one call's weight all-gathers (Note [sharded weights cost]);
    ``attention_s`` / ``rest_s``: the call's attention work and the rest of the model."""
    outer, blocks = memory_model.gathered_units(spec)
    if replica == 1 or not blocks:
        return 0.0
    total_params = sum(p for _, p in blocks) or 1.0
    exposed = _gather_seconds(outer, replica, link) + _gather_seconds(blocks[0][0], replica, link)
    for (_, params), (following, _) in itertools.pairwise(blocks):
        compute = attention_s / len(blocks) + rest_s * params / total_params
        exposed += max(0.0, _gather_seconds(following, replica, link) - compute)
    return exposed


def placed(spec: ModelSpec, base: Prediction, *, shard_weights: bool, text_encoder: str,
           interconnect: str = "nvlink") -> Prediction:
    """``base`` (a prediction in any placement) in another placement of the weights and text
    encoders: its memory (Note [memory per rank]) and, sharded, the weight all-gathers' exposed
    time and bytes (Note [sharded weights cost])."""
    grid, calls = base.grid, base.calls_per_step
    replica = grid.world
    mem = memory_model.breakdown(spec, grid.ulysses, grid.ring, replica, base.schedule, base.call_batch,
                                 shard_weights=shard_weights, text_encoder=text_encoder)
    link = group_link(interconnect, replica)
    parts = {k: v for k, v in base.parts.items() if k != "weight_gather"}
    nbytes = base.comm_bytes_per_rank - (weight_gather_bytes(spec, calls, replica) if base.shard_weights else 0.0)
    parts["weight_gather"] = 0.0
    if mem.shard_weights:
        attention_ms = sum(parts[k] for k in ("attention", "ulysses_all_to_all", "ring_exposed", "joint_gathers"))
        parts["weight_gather"] = 1e3 * calls * weight_gather_seconds(
            spec, replica, link, attention_ms / calls / 1e3, parts["rest_of_model"] / calls / 1e3)
        nbytes += weight_gather_bytes(spec, calls, replica)
    encode_ms = 0.0
    if mem.text_encoder == "shard":
        encode_ms = 1e3 * _gather_seconds(memory_model.model_memory(spec).encoder_bytes, replica, link)
    return Prediction(grid, base.schedule, sum(parts.values()), nbytes, mem.total, parts, calls, base.call_batch,
                      mem, encode_ms)


def weight_gather_bytes(spec: ModelSpec, calls: int, replica: int) -> float:
    """Bytes a rank sends and receives a step in the sharded weights' all-gathers: (P - 1) / P of
    the running transformer each way, every call."""
    outer, blocks = memory_model.gathered_units(spec)
    return 2 * calls * (outer + sum(b for b, _ in blocks)) * (replica - 1) / replica


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
    if grid.ulysses > spec.heads:
        raise ValueError(f"ulysses_degree={grid.ulysses} exceeds {spec.name}'s {spec.heads} heads")
    calls, b = call_batch(spec, grid, batch, cfg)
    schedule = schedule if grid.ring > 1 else "none"
    u_link, r_link, s_link = _links(grid, interconnect)
    seq, joint = spec.sequence, spec.joint
    shape = CallShape(b, seq, spec.heads, spec.kv_heads, spec.head_dim, joint, BF16, comm_dtype)
    traffic = max_traffic(shape, grid.ulysses, grid.ring, schedule if grid.ring > 1 else "stream") if grid.sequence > 1 else {}
    attn, ring_exposed = _attention_seconds(spec, grid, schedule, b, gpu, backend, traffic, r_link)
    a2a = u_link.seconds(max(traffic.get("ulysses_a2a", (0, 0))), calls=4) if grid.ulysses > 1 else 0.0
    joint_comm = s_link.seconds(max(traffic.get("joint_gather", (0, 0))), calls=2) if joint and grid.sequence > 1 else 0.0
    cross = 0.0
    if spec.text_mode == "cross":
        cross = kernels.call_seconds(kernels.attention_flops(b, math.ceil(seq / grid.sequence), spec.text, spec.heads,
                                                             spec.head_dim), spec.head_dim, backend=backend)
    tokens_here = math.ceil(seq / grid.sequence) + joint
    other = 2 * spec.params * b * tokens_here / spec.other_rate
    out = gather_traffic(seq, b * spec.out_channels * BF16, grid.ulysses, grid.ring).get("seq_gather", (0, 0))
    gather = s_link.seconds(max(out)) if grid.sequence > 1 else 0.0
    per_call = {
        "attention": spec.layers * (attn + cross), "ulysses_all_to_all": spec.layers * a2a,
        "ring_exposed": spec.layers * ring_exposed, "joint_gathers": spec.layers * joint_comm,
        "rest_of_model": other, "output_gather": gather,
    }
    parts = {k: 1e3 * calls * v for k, v in per_call.items()}
    nbytes = calls * (spec.layers * sum(s + r for s, r in traffic.values()) + sum(out))
    base = Prediction(grid, schedule, sum(parts.values()), nbytes, 0.0, parts, calls, b)
    return placed(spec, base, shard_weights=shard_weights, text_encoder=text_encoder, interconnect=interconnect)
