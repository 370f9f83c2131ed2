"""``usp_attention``: attention over a sequence sharded on a Ulysses x Ring grid, dense, causal or
block-causal (Note [staircase masks] in ``usp_dit.attention.masks``), in any sequence layout (Note [sequence
layouts] in ``usp_dit.sharding.layouts``).

Layout: (batch, seq, heads, head_dim) for every input and output; LSE (batch, seq, heads).

    local q/k/v (B, S_shard, H, D)
      └─ Ulysses all-to-all: scatter heads, gather the ring block    (B, S_block, h, D)
           └─ ring over R ranks (+ joint text K/V at step 0)         (B, S_block [+ joint part], h, D)
      └─ Ulysses all-to-all back                                      (B, S_shard, H, D)

Note [compiled calls]
    Under ``torch.compile`` the whole sharded call traces into the graph, forward and backward:
    the Ulysses all-to-alls and the gathers are functional collectives, every ring schedule moves
    its blocks with functional collectives (the "stream" ring rotates them with an all-to-all of
    one non-empty split each way, ``usp_dit.distributed.comm`` Note [traced ring]), and kernels are the custom
    op ``usp_dit::attention``. What cannot be traced is left out of the graph, not computed
    differently:
    - the per-call handshake (Note [call handshake]) and the model wrapper's agreement on a call:
      a compiled call trusts that the ranks agree (its guards already pin shapes and dtypes per
      rank). Run a first step eagerly to check a new setup (``torch.compiler.set_stance("force_eager")``);
    - so a compiled call needs ``seq_len`` to know every rank's shard (the adapters pass it): a
      call without it raises ValueError;
    - a traced backward gets an LSE gradient whether or not the loss read the LSE (zeros where it
      did not), and cannot look at it without a sync: a compiled call with ``return_lse=True``
      and gradients passes it to every kernel's backward, the one-call augmented backward of
      Note [LSE gradient] in ``usp_dit.kernels.lse_grad`` (exact either way; with
      ``return_lse=False`` the plain backward runs, as eagerly);
    - a two-call CFG pipeline's pairing (``usp_dit.pipelines.cfg_pair``) runs eagerly only; a
      compiled call with cfg_degree 2 takes the batch split.
    Shard sizes are symbolic under dynamic shapes (``partition.split_sizes`` has no branch on the
    length), so a new resolution recompiles once (static, then dynamic), not per resolution.

Joint (text) queries are split over the ring ranks and ride along with the local queries, so their
work is shared; their outputs are gathered over ring and Ulysses ranks so that every rank returns
the same ``joint_out``.
"""
from __future__ import annotations

import contextlib
import operator
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol

from usp_dit.attention.masked import masked_attend
from usp_dit.attention.masked_joint import JointMaskedAttention, joint_backend
from usp_dit.attention.masks import check_frame, ring_plans
from usp_dit.attention.ring import RingAttention, RingSpec, choose_schedule, masked_schedule
from usp_dit.attention.ulysses import gather_heads, scatter_heads, scatter_heads_encoded, ulysses_layout
from usp_dit.distributed import fp8_wire, traffic
from usp_dit.distributed.comm import gather_uneven, heads_to_seq, seq_to_heads
from usp_dit.distributed.config import canonical_schedule
from usp_dit.distributed.fp8_wire import check_comm_dtype
from usp_dit.distributed.handshake import agree, calls_verified
from usp_dit.distributed.mesh import USPMesh, resolve_mesh
from usp_dit.kernels import attend, attend_out, select_backend
from usp_dit.kernels.autograd import kernel_forward, needs_grad
from usp_dit.kernels.policy import attention_flops, auto_uses_torch_dispatch
from usp_dit.kernels.protocol import AttentionBackend, lse_dtype
from usp_dit.kernels.registry import backends_with_lse
from usp_dit.sharding.layouts import check_layout
from usp_dit.sharding.partition import offsets, ring_block_sizes, split_sizes
from usp_dit.sharding.shard import layout_sizes


def _check_inputs(q, k, v, joint) -> None:
    """ValueError naming the argument for inconsistent shapes or dtypes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, local seq and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if joint is None:
        return
    jq, jk, jv = joint
    b, _, h, d = q.shape
    hk = k.shape[2]
    for name, t, heads in (("joint_q", jq, h), ("joint_k", jk, hk), ("joint_v", jv, hk)):
        if t.dim() != 4 or t.shape[0] != b or t.shape[2] != heads or t.shape[3] != d or t.dtype != q.dtype:
            raise ValueError(
                f"{name} must be ({b}, seq_joint, {heads}, {d}) of dtype {q.dtype}, got {tuple(t.shape)} {t.dtype}"
            )
    if not (jq.shape[1] == jk.shape[1] == jv.shape[1]):
        raise ValueError(f"joint_q/k/v must share seq_joint, got {jq.shape[1]}, {jk.shape[1]}, {jv.shape[1]}")


def _check_joint_mask(joint_mask, joint) -> torch.Tensor | None:
    """``joint_mask`` as (B, T) bool (nonzero = a key); ValueError naming it when it does not fit."""
    if joint_mask is None:
        return None
    if joint is None:
        raise ValueError("joint_mask was given without joint_q/k/v: it masks joint tokens")
    jq = joint[0]
    if not torch.is_tensor(joint_mask) or tuple(joint_mask.shape) != tuple(jq.shape[:2]):
        got = tuple(joint_mask.shape) if torch.is_tensor(joint_mask) else type(joint_mask).__name__
        raise ValueError(f"joint_mask must be (batch, seq_joint) = {tuple(jq.shape[:2])}, got {got}")
    if joint_mask.device != jq.device:
        raise ValueError(f"joint_mask must be on {jq.device} like joint_q, got {joint_mask.device}")
    return joint_mask if joint_mask.dtype == torch.bool else joint_mask != 0


def _joint_tuple(joint_q, joint_k, joint_v):
    given = [t is not None for t in (joint_q, joint_k, joint_v)]
    if any(given) and not all(given):
        raise ValueError("joint_q, joint_k and joint_v must be given together (or none of them)")
    return (joint_q, joint_k, joint_v) if all(given) else None


def _check_lse(kernel: AttentionBackend, return_lse: bool, mesh: USPMesh) -> None:
    """NotImplementedError when the case needs a log-sum-exp that the backend does not return."""
    if kernel.caps.returns_lse or not (return_lse or mesh.ring_degree > 1):
        return
    need = "return_lse=True" if return_lse else f"ring_degree={mesh.ring_degree} (ring merges use it)"
    raise NotImplementedError(
        f"backend={kernel.name!r} returns no log-sum-exp, which {need} needs; "
        f"use it with ring_degree=1, or a backend that returns one: {backends_with_lse()}"
    )


def _call_fields(q, k, call: _Call, mesh: USPMesh, seq_len) -> dict:
    """What every rank of the sequence group must agree on for one call (Note [call handshake]).
    "input check" comes first: a rank that refused its inputs sends only that field."""
    b, _, h, d = q.shape
    return {
        "input check": "ok",
        "dtype": q.dtype, "batch": b, "heads": h, "kv_heads": k.shape[2], "head_dim": d,
        "joint tokens": None if call.joint is None else call.joint[0].shape[1],
        "seq_len": seq_len, "ring_schedule": call.schedule, "comm_dtype": call.comm,
        "degrees (ulysses, ring)": (mesh.ulysses_degree, mesh.ring_degree),
        "backend returns LSE": call.kernel.caps.returns_lse, "needs grad": call.needs_grad,
        "return_lse": call.want_lse, "layout": call.layout, "mask frame (1: causal)": call.frame,
    }


def _shard_sizes(q, k, call: _Call, mesh: USPMesh, seq_len: int | None) -> list[int]:
    """Shard length of every rank of the sequence group, in sequence-rank order, after the ranks
    agreed on the call (Note [call handshake] in ``usp_dit.distributed.handshake``: the handshake is the
    all-gather of shard lengths, so checking costs no extra collective). Inside
    ``verified_calls(mesh)`` a call given ``seq_len`` skips it (Note [verified calls]).

    Raises:
        ValueError: on every rank alike, when ranks disagree on a field or a shard length does not
            match ``seq_len``.
    """
    local_len = q.shape[1]
    if seq_len is None and torch.compiler.is_compiling():
        raise ValueError(
            "seq_len=None: under torch.compile usp_attention on a grid needs seq_len (the full "
            "sequence length) to know every rank's shard, since the handshake that gathers them "
            "cannot be traced (Note [compiled calls]); the model adapters pass it"
        )
    if seq_len is not None and calls_verified(mesh):
        sizes = layout_sizes(seq_len, mesh, call.layout)
        if sizes[mesh.seq_rank] != local_len:
            raise ValueError(_seq_len_message(seq_len, sizes, [(mesh.seq_rank, local_len)], call.layout))
        return sizes
    fields = _call_fields(q, k, call, mesh, seq_len)
    sizes = agree(fields, mesh.seq_group, q.device, varying=local_len, what="a usp_attention call")
    # Dense attention in the contiguous layout takes any split; a mask or another layout needs
    # the layout's own (it says where every token sits).
    if seq_len is not None or call.layout != "contiguous" or call.frame is not None:
        total = sum(sizes) if seq_len is None else seq_len
        expected = layout_sizes(total, mesh, call.layout)
        wrong = [(i, n) for i, (n, e) in enumerate(zip(sizes, expected)) if n != e]
        if wrong:
            raise ValueError(_seq_len_message(total, expected, wrong, call.layout))
    return sizes


def _seq_len_message(seq_len: int, expected: list[int], wrong: list[tuple[int, int]], layout: str = "contiguous") -> str:
    held = ", ".join(f"rank {i} holds {n} (expected {expected[i]})" for i, n in wrong)
    return (
        f"seq_len={seq_len} over {len(expected)} ranks in layout={layout!r} gives shards of {expected} tokens, but {held}: "
        f"shard with usp_dit.shard_sequence (the same layout) or omit seq_len"
    )


class AttentionOutput(NamedTuple):
    """What ``usp_attention`` returns; fields that do not apply are ``None``.

    ``out``: (batch, seq_local, heads, head_dim), this rank's queries. ``joint_out``: (batch,
    seq_joint, heads, head_dim), the joint tokens' output, the same on every rank (``None``
    without joint tokens). ``lse`` / ``joint_lse``: (batch, seq, heads) log-sum-exps, float32
    (float64 for float64 inputs), with ``return_lse=True`` only. The order unpacks like 0.1's
    four-tuple: ``out, joint_out, lse, joint_lse = usp_attention(...)``.
    """

    out: torch.Tensor
    joint_out: torch.Tensor | None
    lse: torch.Tensor | None
    joint_lse: torch.Tensor | None


class _Call(NamedTuple):
    """One validated call: joint inputs (``None`` when absent or empty), the empty joint result,
    the kernel, the softmax scale and whether autograd records it."""

    joint: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    joint_empty: tuple[torch.Tensor, torch.Tensor] | None
    kernel: AttentionBackend
    scale: float
    needs_grad: bool
    schedule: str  # the ring schedule asked for ("auto" or a name of usp_dit.distributed.config.RING_SCHEDULES)
    want_lse: bool  # return_lse: the LSE is gathered back (one more small all-to-all) only then
    layout: str = "contiguous"  # where tokens sit (Note [sequence layouts] in usp_dit.sharding.layouts)
    frame: int | None = None  # the mask's frame length (1: causal), None: dense
    joint_mask: torch.Tensor | None = None  # (B, T) bool, the joint tokens that are keys (None: all)
    comm: str = "model"  # what the Ulysses exchanges carry: "model" or "fp8" (Note [fp8 wire])


def _prepare(
    q, k, v, joint_qkv, mesh: USPMesh, scale, backend: str, return_lse: bool, schedule: str | None,
    mask: tuple[bool, int | None, str] = (False, None, "contiguous"), joint_mask: torch.Tensor | None = None,
    comm_dtype: str | None = None,
) -> _Call:
    """Validate the inputs and pick the kernel (this rank alone; no communication). ``mask``:
    ``(causal, block_causal, layout)`` as given to ``usp_attention``."""
    joint = _joint_tuple(*joint_qkv)
    _check_inputs(q, k, v, joint)
    joint_mask = _check_joint_mask(joint_mask, joint)
    frame, layout = check_frame(mask[0], mask[1]), check_layout(mask[2])
    if frame is not None and joint is not None:
        raise NotImplementedError(
            "causal or block_causal with joint tokens (joint_q/k/v): a mask has no place for "
            "replicated text tokens; concatenate them into the sequence instead"
        )
    joint_empty = None
    if joint is not None and joint[0].shape[1] == 0:
        jq = joint[0]
        joint, joint_empty = None, (jq, jq.new_zeros(jq.shape[:3], dtype=lse_dtype(q.dtype)))
        joint_mask = None  # no joint token to mask
    head_dim = q.shape[3]
    scale = head_dim ** -0.5 if scale is None else float(scale)
    tensors = (q, k, v) + (joint or ())
    grad = needs_grad(*tensors)
    # Only "auto" weighs the call size; a named backend skips the estimate (every call pays it).
    schedule = mesh.ring_schedule if schedule is None else canonical_schedule(schedule)
    flops = None
    if backend == "auto" and not torch.compiler.is_compiling():
        flops = _call_flops(q, k, joint, mesh, grad, schedule)
    kernel = select_backend(backend, q.device.type, q.dtype, head_dim, grad, flops, causal=frame is not None)
    _check_lse(kernel, return_lse, mesh)
    if frame is not None and mesh.ring_degree > 1:
        masked_schedule(schedule)  # refuse a schedule that cannot run a mask before any transfer
    comm = _check_comm(comm_dtype, mesh, grad)
    return _Call(joint, joint_empty, kernel, scale, grad, schedule, return_lse, layout, frame, joint_mask, comm)


def _check_comm(comm_dtype: str | None, mesh: USPMesh, needs_grad: bool) -> str:
    """The call's wire dtype (the mesh's when ``None``); an FP8 exchange that would carry a
    gradient is refused (Note [fp8 wire]: forward only)."""
    comm = mesh.comm_dtype if comm_dtype is None else check_comm_dtype(comm_dtype)
    if comm == "fp8" and needs_grad and (mesh.ulysses_degree > 1 or mesh.ring_degree > 1):
        raise NotImplementedError(
            "comm_dtype='fp8' with gradients: the FP8 exchanges (Ulysses, and V round the ring) are forward "
            "only (their rounding has no exact adjoint); train with comm_dtype='model', or call under torch.no_grad()"
        )
    return comm


def _share_failure(exc: Exception, q, mesh: USPMesh, seq_len: int | None) -> None:
    """A call this rank refused still joins its handshake, so that the other ranks raise too
    instead of waiting for it in a collective (Note [call handshake]); returns for the caller to
    re-raise ``exc`` here. Nothing to share at one rank or where the handshake is skipped."""
    if mesh.seq_group is None or (seq_len is not None and calls_verified(mesh)):
        return
    device = q.device if torch.is_tensor(q) else torch.device("cpu")
    with contextlib.suppress(ValueError):  # the disagreement is expected: raise this rank's own error
        agree({"input check": f"{type(exc).__name__}: {exc}"}, mesh.seq_group, device, varying=-1,
              what="a usp_attention call")


def _single_rank(q, k, v, joint, kernel, scale, frame: int | None = None, joint_mask=None, want_lse: bool = True):
    """P == 1: joint tokens simply join the sequence (masked ones: Note [masked joint tokens]); a
    mask runs its plan (for causal attention one call in the kernel's causal mode). Without
    ``want_lse`` a dense call skips the LSE's work where the kernel can (``attend_out``): it has no
    merge to feed, and the LSE is ``None`` then."""
    if frame is not None:
        plan = ring_plans(_concrete(q.shape[1]), 1, 1, "contiguous", frame, 0)[0]
        return masked_attend(q, k, v, plan, kernel, scale, want_lse), None
    dense = (lambda *args: attend(*args, lse_grad=True)) if want_lse else (lambda *args: (attend_out(*args), None))
    if joint is None:
        return dense(q, k, v, kernel, scale), None
    jq, jk, jv = joint
    n = q.shape[1]
    if joint_mask is not None:
        out, lse = JointMaskedAttention.apply(torch.cat([q, jq], 1), k, v, jk, jv, joint_mask, kernel, scale, want_lse)
    else:
        out, lse = dense(torch.cat([q, jq], 1), torch.cat([k, jk], 1), torch.cat([v, jv], 1), kernel, scale)
    return (out[:, :n], _rows(lse, 0, n)), (out[:, n:], _rows(lse, n, None))


def _concrete(n) -> int:
    """``n`` as a plain int. Under torch.compile's dynamic shapes a length is symbolic; a mask's
    plan (host index maths, a graph constant) needs its value, so the graph specialises on it
    (a guard: a new length compiles a new graph, as with static shapes). ``operator.index`` is
    what specialises under Dynamo (``int()`` of a symbolic length stays symbolic)."""
    return operator.index(n)


def _rows(lse: torch.Tensor | None, start: int, stop: int | None) -> torch.Tensor | None:
    """lse[:, start:stop], passing through ``None`` (a backend that returns no LSE)."""
    return None if lse is None else lse[:, start:stop]


def _call_flops(q, k, joint, mesh: USPMesh, needs_grad: bool = False, schedule: str | None = None) -> float:
    """Estimated flops of this rank's main kernel call (4 * B * Sq * Sk * heads * D), for "auto"
    to weigh against a kernel's per-call CPU cost. Assumes even shards; only speed depends on it.
    In training a ring's backward (about 2.5x its forward) streams one K/V block per call, whatever
    the forward schedule, so those calls are the ones that count."""
    b, s_local, h, d = q.shape
    u, r = mesh.ulysses_degree, mesh.ring_degree
    schedule = schedule or mesh.ring_schedule
    s = s_local * mesh.sequence_degree
    heads, kv_heads = max(1, h // u), max(1, k.shape[2] // u)
    joint_len = joint[1].shape[1] if joint is not None else 0
    if r == 1:
        k_len = s + joint_len
    elif needs_grad:
        k_len = max(1, s // r)
    else:
        block = max(1, s // r)
        k_len = choose_schedule(schedule, (block,) * r, heads, kv_heads).keys_per_call(block, r, joint_len)
    return attention_flops(b, s / r, k_len, heads, d)


def _sharded(q, k, v, call: _Call, mesh: USPMesh, seq_len):
    """P > 1 (Note [compiled calls]): traced into the graph under torch.compile; eagerly, run with
    Dynamo disabled as before compile support (without that wrapper an eager call's functional
    collectives kept their process group referenced after the job; seen on gloo, torch 2.13)."""
    if torch.compiler.is_compiling():
        return _sharded_call(q, k, v, call, mesh, seq_len)
    return _sharded_eager(q, k, v, call, mesh, seq_len)


def _sharded_call(q, k, v, call: _Call, mesh: USPMesh, seq_len):
    """P > 1: Ulysses all-to-all, ring (or one local call), all-to-all back, joint gathers."""
    u_deg, r_deg, r = mesh.ulysses_degree, mesh.ring_degree, mesh.ring_rank
    joint, kernel, scale = call.joint, call.kernel, call.scale
    shards = _shard_sizes(q, k, call, mesh, seq_len)
    layout = ulysses_layout(mesh, q.shape[2], k.shape[2], shards[r * u_deg:(r + 1) * u_deg])
    fp8 = call.comm == "fp8"  # Q, V and the output travel in e4m3, K in its dtype (Note [fp8 wire])
    q_blk = scatter_heads(q, layout.q_plan, fp8)
    k_blk = layout.local_kv(scatter_heads(k, layout.kv_plan))
    v_wire = None
    if fp8 and r_deg > 1:  # V's wire rows go round the ring as they are (Note [fp8 ring V])
        v_wire = layout.local_kv(scatter_heads_encoded(v, layout.kv_plan))
        v_blk = fp8_wire.decode(v_wire, v.dtype)
    else:
        v_blk = layout.local_kv(scatter_heads(v, layout.kv_plan, fp8))
    n_blk = q_blk.shape[1]
    jk = jv = None
    joint_sizes = [0] * r_deg
    if joint is not None:
        (qlo, qhi), (kvlo, kvhi) = layout.q_range, layout.kv_range
        jq, jk, jv = joint
        joint_sizes = split_sizes(jq.shape[1], r_deg)
        start = offsets(joint_sizes)[r]
        q_blk = torch.cat([q_blk, jq[:, start:start + joint_sizes[r], qlo:qhi]], dim=1)
        jk, jv = layout.local_kv(jk[:, :, kvlo:kvhi]), layout.local_kv(jv[:, :, kvlo:kvhi])
    if call.frame is not None:  # no joint tokens (refused in _prepare)
        out_ext, lse_ext = _masked_blocks(q_blk, k_blk, v_blk, call, mesh, shards, v_wire)
    elif r_deg > 1:
        sizes = tuple(ring_block_sizes(shards, u_deg))
        schedule = choose_schedule(call.schedule, sizes, q_blk.shape[2], k_blk.shape[2])
        spec = RingSpec(mesh.ring_exchanger, sizes, schedule)
        out_ext, lse_ext = RingAttention.apply(q_blk, k_blk, v_blk, jk, jv, call.joint_mask, spec, kernel, scale,
                                               call.want_lse, v_wire)
    elif jk is not None and call.joint_mask is not None:  # Note [masked joint tokens]
        out_ext, lse_ext = JointMaskedAttention.apply(q_blk, k_blk, v_blk, jk, jv, call.joint_mask, kernel, scale,
                                                      call.want_lse)
    elif jk is not None:
        out_ext, lse_ext = attend(q_blk, torch.cat([k_blk, jk], 1), torch.cat([v_blk, jv], 1), kernel, scale,
                                  lse_grad=call.want_lse)
    else:
        out_ext, lse_ext = attend(q_blk, k_blk, v_blk, kernel, scale, lse_grad=call.want_lse)
    return _gather_back(out_ext, lse_ext if call.want_lse else None, n_blk, layout, joint_sizes, mesh, fp8,
                        joint is not None)


def _gather_back(out_ext, lse_ext, n_blk: int, layout, joint_sizes: list[int], mesh: USPMesh, fp8: bool,
                 has_joint: bool):
    """``((out, lse), (joint_out, joint_lse) or None)`` from this rank's ring block results:
    ``out_ext`` (B, n_blk + j_r, h_u, D), ``lse_ext`` (B, n_blk + j_r, h_u) or ``None`` (not
    returned). Everything that moves goes through ONE autograd node (Note [joint gradient])."""
    if not has_joint and (lse_ext is None or layout.q_plan is None):  # nothing replicated, no LSE exchange
        lse = None if lse_ext is None else lse_ext[:, :n_blk]
        return (gather_heads(out_ext[:, :n_blk], layout.q_plan, fp8), lse), None
    pieces = None
    if has_joint:
        pieces = JointPieces(joint_sizes, tuple(hi - lo for lo, hi in layout.heads.q_ranges), mesh.ring_rank,
                             layout.rank)
    out, joint_out, lse, joint_lse = _GatherBack.apply(out_ext, lse_ext, n_blk, layout.q_plan, pieces, mesh, fp8)
    return (out, lse), ((joint_out, joint_lse) if has_joint else None)


_sharded_eager = torch.compiler.disable(_sharded_call)


def _masked_blocks(q_blk, k_blk, v_blk, call: _Call, mesh: USPMesh, shards: list[int], v_wire=None):
    """``(out, lse)`` of this rank's ring block under the call's mask: the ring with one plan per
    block pair, or (ring degree 1) the plan of the whole sequence (Note [staircase masks]);
    ``v_wire``: V's FP8 wire rows to pass round the ring (Note [fp8 ring V])."""
    u_deg, r_deg, r = mesh.ulysses_degree, mesh.ring_degree, mesh.ring_rank
    plans = ring_plans(_concrete(sum(shards)), r_deg, u_deg, call.layout, call.frame, r)
    if r_deg == 1:
        return masked_attend(q_blk, k_blk, v_blk, plans[0], call.kernel, call.scale, call.want_lse)
    sizes = tuple(ring_block_sizes(shards, u_deg))
    schedule = choose_schedule(call.schedule, sizes, q_blk.shape[2], k_blk.shape[2], masked=True)
    spec = RingSpec(mesh.ring_exchanger, sizes, schedule, plans)
    return RingAttention.apply(q_blk, k_blk, v_blk, None, None, None, spec, call.kernel, call.scale, call.want_lse,
                               v_wire)


class JointPieces(NamedTuple):
    """Where this rank's joint query rows sit in the gathered joint output: the joint tokens are
    split over the ring ranks (``token_sizes``) and their heads over the Ulysses ranks."""

    token_sizes: list[int]
    head_sizes: tuple[int, ...]
    ring_rank: int
    ulysses_rank: int

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece (B, j_r, h_u, ...) of a full joint tensor (B, J, H, ...)."""
        t0, h0 = sum(self.token_sizes[:self.ring_rank]), sum(self.head_sizes[:self.ulysses_rank])
        return full[:, t0:t0 + self.token_sizes[self.ring_rank], h0:h0 + self.head_sizes[self.ulysses_rank]]


def _rows_home(rows: torch.Tensor, q_plan, fp8: bool = False) -> torch.Tensor:
    """This rank's query rows (B, n_blk, h_u, *rest) -> its shard (B, S_shard, H, *rest), a new tensor."""
    if q_plan is None:
        return rows.clone(memory_format=torch.contiguous_format)
    # fp8: forward only (refused with gradients), so _GatherBack's backward never sees it
    return gather_heads(rows, q_plan, fp8) if fp8 else heads_to_seq(rows, q_plan)


def _joint_gathered(rows: torch.Tensor, pieces: JointPieces, mesh: USPMesh) -> torch.Tensor:
    """This rank's joint rows (B, j_r, h_u, *rest) -> every joint row (B, J, H, *rest)."""
    if mesh.ring_group is not None:
        rows = gather_uneven(rows, list(pieces.token_sizes), 1, mesh.ring_group, kind="joint_gather")
    if mesh.ulysses_group is not None:
        rows = gather_uneven(rows, list(pieces.head_sizes), 2, mesh.ulysses_group, kind="joint_gather")
    return rows


def _joint_grad_piece(grad: torch.Tensor, pieces: JointPieces, group) -> torch.Tensor:
    """The sum over ``group`` of every rank's gradient of a replicated joint tensor (B, J, H, *rest),
    this rank's piece of it (Note [joint gradient])."""
    if traffic.counting():
        traffic.record_all_reduce("joint_grad", traffic.nbytes(grad), group.size())
    return pieces.of(funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", group)))


class _GatherBack(torch.autograd.Function):
    """Note [joint gradient]: the outputs of one call back to their owners, as ONE autograd node.

    Forward: ``out_ext`` (B, n_blk + j_r, h_u, D) -> ``out`` (B, S_shard, H, D) by the Ulysses
    all-to-all, and (with ``pieces``) ``joint_out`` (B, J, H, D), the joint rows gathered over ring
    and Ulysses ranks; ``lse_ext`` (B, n_blk + j_r, h_u), when given, likewise to ``lse`` and
    ``joint_lse``. Outputs that do not apply are ``None``.

    ``joint_out`` is replicated, so each rank's backward holds a partial gradient of all of it and
    the owner of each piece needs their sum: one all-reduce over the sequence group. Were that
    all-reduce the backward of a separate gather node, it would run only on ranks whose loss
    reads ``joint_out``, and a loss reading it on some ranks only would leave the others waiting
    forever. Here it runs whenever any output gets a gradient (a missing one counts as zeros),
    so every rank that runs the backward at all runs the same collectives in the same order. The
    LSE's exchanges belong to the same node for the same reason: where the call returns the LSE,
    its gradient travels home (zeros where a rank's loss did not read it) whatever each rank's
    loss reads, so the kernels' backward then takes a (possibly zero) LSE gradient.
    """

    @staticmethod
    def forward(ctx, out_ext, lse_ext, n_blk: int, q_plan, pieces: JointPieces | None, mesh: USPMesh,
                fp8: bool = False):
        ctx.q_plan, ctx.pieces, ctx.group = q_plan, pieces, mesh.seq_group
        out = _rows_home(out_ext[:, :n_blk], q_plan, fp8)
        lse = None if lse_ext is None else _rows_home(lse_ext[:, :n_blk], q_plan)
        joint_out = joint_lse = None
        if pieces is not None:
            joint_out = _joint_gathered(out_ext[:, n_blk:], pieces, mesh)
            joint_lse = None if lse_ext is None else _joint_gathered(lse_ext[:, n_blk:], pieces, mesh)
        return out, joint_out, lse, joint_lse

    @staticmethod
    def backward(ctx, grad_out, grad_joint, grad_lse, grad_joint_lse):
        def home(grad, grad_joint):  # the adjoint of one output pair: rows back to the ring block
            rows = grad if ctx.q_plan is None else seq_to_heads(grad.contiguous(), ctx.q_plan)
            if ctx.pieces is None:
                return rows
            return torch.cat([rows, _joint_grad_piece(grad_joint, ctx.pieces, ctx.group)], dim=1)

        grad_lse_ext = None if grad_lse is None else home(grad_lse, grad_joint_lse)
        return home(grad_out, grad_joint), grad_lse_ext, None, None, None, None, None


def one_rank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                       backend: str = "auto") -> torch.Tensor:
    """``usp_attention(q, k, v, ...).out`` for a caller that knows it runs on one rank of the
    sequence, with no joint tokens, mask or LSE: the out-only kernel call and the backend choice,
    without the sharded path's checks and bookkeeping (the stock processors routed at world size 1
    call attention 20-60 times a forward, and a host-bound small model pays every microsecond).

    q (B, S, H, D), k/v (B, S_k, H_k, D) -> out (B, S, H, D). Under torch.compile it is
    ``usp_attention`` itself (the traced graph has no per-call Python to save).
    """
    if torch.compiler.is_compiling():
        return usp_attention(q, k, v, scale=scale, backend=backend, mesh=resolve_mesh(None)).out
    head_dim = q.shape[3]
    flops = None
    if backend == "auto":  # it weighs the call size (as _call_flops does for one rank: every key in one call)
        flops = attention_flops(q.shape[0], q.shape[1], k.shape[1], q.shape[2], head_dim)
        if auto_uses_torch_dispatch(flops):  # stock's own call (Note [small calls on one rank go to ...])
            out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                                   scale=scale, enable_gqa=k.shape[2] != q.shape[2])
            return out.transpose(1, 2)
    kernel = select_backend(backend, q.device.type, q.dtype, head_dim, needs_grad(q, k, v), flops)
    return attend_out(q, k, v, kernel, head_dim ** -0.5 if scale is None else float(scale))


def one_rank_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, *,
                              scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Attention under a key padding mask on one rank of the sequence, in one kernel call that
    takes the mask (Note [one rank under a key mask]).

    q (B, S, H, D), k/v (B, S_k, H_k, D), key_mask (B, S_k) bool (True = attend) -> out (B, S, H, D).
    Inference only: the caller checks that no gradient is needed and that it is not tracing.

    Note [one rank under a key mask]
        A routed call on one rank with a bool key-padding mask (padded prompts) needs none of the
        sharded path's work: no per-element split (a ``nonzero`` and a host sync per element) and
        no check of which keys the mask hides (another sync), because the whole mask goes to the
        kernel as stock's does. With ``backend="auto"`` the call is stock's own: PyTorch's SDPA
        with the bool mask (on an H100 it picks cuDNN's masked kernel; our mem-efficient kernel
        with the mask as a bias ran PRX at 1.57x stock); a named backend runs the mask on its
        kernel, or PyTorch's mem-efficient / CPU one where it has no mask (``joint_backend``).
    """
    scale = q.shape[3] ** -0.5 if scale is None else float(scale)
    if backend == "auto":
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask[:, None, None, :],
            scale=scale, enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)
    kernel = joint_backend(select_backend(backend, q.device.type, q.dtype, q.shape[3], False), q)
    return kernel_forward(kernel, q, k, v, scale, key_mask=key_mask)[0]


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: USPMesh | None = None,
    joint_q: torch.Tensor | None = None,
    joint_k: torch.Tensor | None = None,
    joint_v: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    seq_len: int | None = None,
    ring_schedule: str | None = None,
    causal: bool = False,
    block_causal: int | None = None,
    layout: str = "contiguous",
    joint_mask: torch.Tensor | None = None,
    comm_dtype: str | None = None,
) -> AttentionOutput:
    """Attention of this rank's sequence shard against the whole sequence: dense, causal or
    block-causal.

    Args:
        q: (batch, seq_local, heads, head_dim), this rank's shard of the sequence, laid out as
            ``shard_sequence(x, mesh, layout=layout)`` places it (uneven lengths allowed).
        k, v: (batch, seq_local, kv_heads, head_dim); ``heads % kv_heads == 0`` (GQA / MQA).
        mesh: the grid from ``init_usp``; ``None`` uses the last one built (single rank if none).
        joint_q, joint_k, joint_v: (batch, seq_joint, heads | kv_heads, head_dim) text tokens
            replicated on every rank; every query attends to them exactly once and ``joint_out``
            is their own attention over the whole sequence plus themselves.
        joint_mask: (batch, seq_joint), True (or nonzero) where a joint token is a key, e.g. a
            prompt's padding mask: a masked joint token is a key of no query, with static shapes
            (one graph under torch.compile; Note [masked joint tokens] in ``usp_dit.attention.masked_joint``).
            Its own row of ``joint_out`` is still computed, over the keys that are: drop it.
        scale: softmax scale, default ``head_dim ** -0.5``.
        backend: "auto" or a name from ``usp_dit.kernels.list_backends()``.
        return_lse: also return the log-sum-exps (``lse``, ``joint_lse``; they cost one more small
            all-to-all on a grid); refuses a backend that computes none.
        ring_schedule: how this call's ring forward moves K/V blocks: "stream", "gather_merge",
            "gather_one_call" or "auto" (Note [ring schedule] in ``usp_dit.attention.ring``); ``None`` takes
            the mesh's default (``init_usp(ring_schedule=...)``). Chosen per call: changing it
            builds no process group.
        seq_len: the full sequence length, if known; checked against every rank's shard. Before
            the first size-dependent transfer the ranks agree on the call (dtype, shapes, joint
            tokens, seq_len, ring schedule, gradient: Note [call handshake] in
            ``usp_dit.distributed.handshake``) in the all-gather that brings the shard lengths; a model wrapper
            inside ``verified_calls(mesh)`` that passes ``seq_len`` skips it.
        causal: query at position p attends to keys at positions <= p (positions in the full
            sequence, whatever the layout). The ring skips the blocks the mask hides and runs the
            kernel's causal mode on the diagonal; no joint tokens.
        block_causal: a frame length F instead of ``causal``: a token attends to every token of
            its own frame (positions F*f .. F*f + F - 1) and of earlier frames.
        layout: "contiguous", "zigzag" or "stripe" (Note [sequence layouts] in
            ``usp_dit.sharding.layouts``): where the tokens of each rank sit; "zigzag" and "stripe" give
            every ring rank the same causal work. Shard and gather with the same layout.
        comm_dtype: what the Ulysses all-to-alls carry: "model" (the inputs' dtype: exact) or
            "fp8" (Q, V and the output in e4m3 with one scale per (token, head), and V's rows
            round the ring likewise (Note [fp8 ring V]): lossy, about half the bytes of bf16,
            forward only; Note [fp8 wire] in ``usp_dit.distributed.fp8_wire``
            states its error). ``None`` takes the mesh's (``init_usp(comm_dtype=...)``). Nothing
            changes where ``ulysses_degree`` is 1.

    Returns:
        An ``AttentionOutput``: ``.out`` (like q), ``.joint_out`` (with joint tokens), ``.lse`` and
        ``.joint_lse`` (with ``return_lse``); ``None`` where a field does not apply.

    Gradient convention: autograd differentiates the sum of every rank's loss. For sharded inputs
    (q, k, v) each rank gets the gradient of its own shard. For the replicated joint inputs each
    rank gets a partial gradient; their sum over the sequence group is the full gradient (what a
    sum or mean all-reduce of parameter gradients expects). Every rank of the group must run the
    backward. ``lse`` and ``joint_lse`` are differentiable too, exactly (Note [LSE gradient] in
    ``usp_dit.kernels.lse_grad``): a loss may read them, e.g. to merge this call's result with
    attention over other keys; eagerly at one rank an unread LSE costs the backward nothing, on a
    grid its (zero) gradient still travels home, so that every rank runs the same collectives.

    Raises:
        ValueError: inconsistent shapes/dtypes, a mesh that was not initialised, bad seq_len, or
            ranks that disagree on the call (raised on every rank of the group, naming each
            differing field and every rank's value; a rank that refused its own inputs raises its
            own error and the others name it).
        NotImplementedError: the backend cannot run this case (device, dtype, head_dim, backward).
        RuntimeError: the backend's package is missing (the message has the install line).
    """
    mesh = resolve_mesh(mesh)
    try:
        call = _prepare(q, k, v, (joint_q, joint_k, joint_v), mesh, scale, backend, return_lse, ring_schedule,
                        (causal, block_causal, layout), joint_mask, comm_dtype)
    except (ValueError, NotImplementedError, RuntimeError) as exc:
        _share_failure(exc, q, mesh, seq_len)
        raise
    joint, joint_empty, kernel, scale = call.joint, call.joint_empty, call.kernel, call.scale
    if mesh.sequence_degree == 1:
        main, joint_res = _single_rank(q, k, v, joint, kernel, scale, call.frame, call.joint_mask, return_lse)
    else:
        main, joint_res = _sharded(q, k, v, call, mesh, seq_len)
    joint_out, joint_lse = joint_res or joint_empty or (None, None)
    if not return_lse:
        return AttentionOutput(main[0], joint_out, None, None)
    return AttentionOutput(main[0], joint_out, main[1], joint_lse)
