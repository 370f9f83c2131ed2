"""``usp_attention``: non-causal attention over a sequence sharded on a Ulysses x Ring grid.

Layout: (batch, seq, heads, head_dim) for every input and output; LSE (batch, seq, heads).

    local q/k/v (B, S_shard, H, D)
      └─ Ulysses all-to-all: scatter heads, gather the ring block    (B, S_block, h, D)
           └─ ring over R ranks (+ joint text K/V at step 0)         (B, S_block [+ joint part], h, D)
      └─ Ulysses all-to-all back                                      (B, S_shard, H, D)

Joint (text) queries are split over the ring ranks and ride along with the local queries, so their
work is shared; their outputs are gathered over ring and Ulysses ranks so that every rank returns
the same ``joint_out``.
"""
from __future__ import annotations

import torch

from usp_dit.comm import all_gather_sizes, all_gather_uneven
from usp_dit.kernels import KernelAttention, select_backend
from usp_dit.kernels.base import AttentionBackend, backends_with_lse, lse_dtype
from usp_dit.mesh import USPMesh, resolve_mesh
from usp_dit.partition import offsets, ring_block_sizes, split_sizes
from usp_dit.ring import RingAttention, RingSpec, choose_schedule
from usp_dit.ulysses import gather_heads, scatter_heads, ulysses_layout


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


def _shard_sizes(mesh: USPMesh, local_len: int, seq_len: int | None, device: torch.device) -> list[int]:
    """Shard length of every rank of the sequence group, in sequence-rank order."""
    p = mesh.sequence_degree
    if seq_len is None:
        return all_gather_sizes(local_len, mesh.seq_group, device)
    sizes = split_sizes(seq_len, p)
    if sizes[mesh.seq_rank] != local_len:
        raise ValueError(
            f"seq_len={seq_len} over {p} ranks gives rank {mesh.seq_rank} a shard of {sizes[mesh.seq_rank]} "
            f"tokens, but q holds {local_len}: shard with usp_dit.shard_sequence or omit seq_len"
        )
    return sizes


def _local_attention(q, k, v, kernel: AttentionBackend, scale: float):
    """One kernel call; skips autograd bookkeeping when no gradient is needed (no P = 1 tax)."""
    if torch.compiler.is_compiling():  # traced as an opaque custom op with a fake implementation
        return torch.ops.usp_dit.attention(q, k, v, scale, kernel.name)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return KernelAttention.apply(q, k, v, kernel, scale)
    return kernel.forward(q, k, v, scale)


def _single_rank(q, k, v, joint, kernel, scale):
    """P == 1: joint tokens simply join the sequence."""
    if joint is None:
        return _local_attention(q, k, v, kernel, scale), None
    jq, jk, jv = joint
    n = q.shape[1]
    out, lse = _local_attention(
        torch.cat([q, jq], 1), torch.cat([k, jk], 1), torch.cat([v, jv], 1), kernel, scale
    )
    return (out[:, :n], _rows(lse, 0, n)), (out[:, n:], _rows(lse, n, None))


def _rows(lse: torch.Tensor | None, start: int, stop: int | None) -> torch.Tensor | None:
    """lse[:, start:stop], passing through ``None`` (a backend that returns no LSE)."""
    return None if lse is None else lse[:, start:stop]


def _call_flops(q, k, joint, mesh: USPMesh, needs_grad: bool = False) -> float:
    """Estimated flops of this rank's main kernel call (4 * B * Sq * Sk * heads * D), for "auto"
    to weigh against a kernel's per-call CPU cost. Assumes even shards; only speed depends on it.
    In training a ring's backward (about 2.5x its forward) streams one K/V block per call, whatever
    the forward schedule, so those calls are the ones that count."""
    b, s_local, h, d = q.shape
    u, r = mesh.ulysses_degree, mesh.ring_degree
    s = s_local * mesh.sequence_degree
    heads, kv_heads = max(1, h // u), max(1, k.shape[2] // u)
    joint_len = joint[1].shape[1] if joint is not None else 0
    if r == 1:
        k_len = s + joint_len
    elif needs_grad:
        k_len = max(1, s // r)
    else:
        block = max(1, s // r)
        schedule = choose_schedule(mesh.ring_schedule, (block,) * r, heads, kv_heads)
        # gather: the remote blocks are one call; allgather: the whole sequence is
        k_len = {"gather": block * (r - 1), "allgather": s + joint_len}.get(schedule, block)
    return 4.0 * b * (s / r) * k_len * heads * d


@torch.compiler.disable  # P2P ring transfers are not traceable: compiled models run this part eagerly
def _sharded(q, k, v, joint, kernel, scale, mesh: USPMesh, seq_len):
    """P > 1: Ulysses all-to-all, ring (or one local call), all-to-all back, joint gathers."""
    u_deg, r_deg, r = mesh.ulysses_degree, mesh.ring_degree, mesh.ring_rank
    shards = _shard_sizes(mesh, q.shape[1], seq_len, q.device)
    layout = ulysses_layout(mesh, q.shape[2], k.shape[2], shards[r * u_deg:(r + 1) * u_deg])
    q_blk = scatter_heads(q, layout.q_plan)
    k_blk = layout.local_kv(scatter_heads(k, layout.kv_plan))
    v_blk = layout.local_kv(scatter_heads(v, layout.kv_plan))
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
    if r_deg > 1:
        sizes = tuple(ring_block_sizes(shards, u_deg))
        schedule = choose_schedule(mesh.ring_schedule, sizes, q_blk.shape[2], k_blk.shape[2])
        spec = RingSpec(mesh.ring_exchanger, sizes, schedule)
        out_ext, lse_ext = RingAttention.apply(q_blk, k_blk, v_blk, jk, jv, spec, kernel, scale)
    elif jk is not None:
        out_ext, lse_ext = _local_attention(q_blk, torch.cat([k_blk, jk], 1), torch.cat([v_blk, jv], 1), kernel, scale)
    else:
        out_ext, lse_ext = _local_attention(q_blk, k_blk, v_blk, kernel, scale)
    out = gather_heads(out_ext[:, :n_blk], layout.q_plan)
    lse = None if lse_ext is None else gather_heads(lse_ext[:, :n_blk], layout.q_plan)
    if joint is None:
        return (out, lse), None
    head_sizes = [hi - lo for lo, hi in layout.heads.q_ranges]
    joint_res = []
    for t in (out_ext[:, n_blk:], _rows(lse_ext, n_blk, None)):
        if t is None:
            joint_res.append(None)
            continue
        t = all_gather_uneven(t, joint_sizes, 1, mesh.ring_group)
        joint_res.append(all_gather_uneven(t, head_sizes, 2, mesh.ulysses_group))
    return (out, lse), tuple(joint_res)


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
):
    """Non-causal attention of this rank's sequence shard against the whole sequence.

    Args:
        q: (batch, seq_local, heads, head_dim), this rank's shard of the sequence, laid out as
            ``shard_sequence`` places it (uneven lengths allowed).
        k, v: (batch, seq_local, kv_heads, head_dim); ``heads % kv_heads == 0`` (GQA / MQA).
        mesh: the grid from ``init_usp``; ``None`` uses the last one built (single rank if none).
        joint_q, joint_k, joint_v: (batch, seq_joint, heads | kv_heads, head_dim) text tokens
            replicated on every rank; every query attends to them exactly once and ``joint_out``
            is their own attention over the whole sequence plus themselves.
        scale: softmax scale, default ``head_dim ** -0.5``.
        backend: "auto" or a name from ``usp_dit.kernels.list_backends()``.
        return_lse: also return the log-sum-exp (batch, seq, heads), float32 (float64 for float64).
        seq_len: the full sequence length, if known; saves one small all-gather of shard lengths.

    Returns:
        ``out_local`` (like q); with joint tokens ``(out_local, joint_out)``; with ``return_lse``
        ``(out_local, lse_local)`` or ``(out_local, joint_out, lse_local, joint_lse)``.

    Gradient convention: autograd differentiates the sum of every rank's loss. For sharded inputs
    (q, k, v) each rank gets the gradient of its own shard. For the replicated joint inputs each
    rank gets a partial gradient; their sum over the sequence group is the full gradient (what a
    sum or mean all-reduce of parameter gradients expects). Every rank of the group must run the
    backward. The LSE is not differentiable: a gradient reaching it raises NotImplementedError.

    Raises:
        ValueError: inconsistent shapes/dtypes, a mesh that was not initialised, bad seq_len.
        NotImplementedError: the backend cannot run this case (device, dtype, head_dim, backward).
        RuntimeError: the backend's package is missing (the message has the install line).
    """
    mesh = resolve_mesh(mesh)
    joint = _joint_tuple(joint_q, joint_k, joint_v)
    _check_inputs(q, k, v, joint)
    if joint is not None and joint[0].shape[1] == 0:
        joint = None
        joint_empty = (joint_q, joint_q.new_zeros(joint_q.shape[:3], dtype=lse_dtype(q.dtype)))
    else:
        joint_empty = None
    head_dim = q.shape[3]
    scale = head_dim ** -0.5 if scale is None else float(scale)
    tensors = (q, k, v) + (joint or ())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    # Only "auto" weighs the call size; a named backend skips the estimate (every call pays it).
    flops = _call_flops(q, k, joint, mesh, needs_grad) if backend == "auto" and not torch.compiler.is_compiling() else None
    kernel = select_backend(backend, q.device.type, q.dtype, head_dim, needs_grad, flops)
    _check_lse(kernel, return_lse, mesh)
    if mesh.sequence_degree == 1:
        main, joint_res = _single_rank(q, k, v, joint, kernel, scale)
    else:
        main, joint_res = _sharded(q, k, v, joint, kernel, scale, mesh, seq_len)
    joint_res = joint_res or joint_empty
    if joint_res is None:
        return main if return_lse else main[0]
    if return_lse:
        return main[0], joint_res[0], main[1], joint_res[1]
    return main[0], joint_res[0]
