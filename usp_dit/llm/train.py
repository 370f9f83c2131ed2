"""Training a causal LM on a sharded sequence: the batch, the loss and the gradient reduction.

Layout: input_ids and labels (batch, seq), the same on every rank of a replica, become
(batch, seq_local) in the sequence layout; position_ids (batch, seq_local) int64, the GLOBAL
positions of this rank's tokens; logits (batch, seq_local, vocab).

Note [a causal LM on a sharded sequence]
    One process computes  L = sum_i CE(logits_i, label_i) / N  over the N tokens i with a label,
    label_i = token i+1. Sharded, rank r holds the tokens T_r of its layout, and

        L = sum_r L_r / N,    L_r = sum over i in T_r of CE(logits_i, label_i).

    * Labels are shifted over the WHOLE sequence before sharding: the label of token i is token
      i+1 wherever that token lives. Shifting inside a shard (what a transformers model does when
      given ``labels``) would drop each shard's last label and, in the zigzag layout, pair the end
      of one chunk with the start of the next. The last token gets ``ignore_index``.
    * ``lm_loss`` returns L on every rank (the sums and counts are all-reduced), but its backward is
      that of L_r / N: the all-reduce passes the gradient through unchanged. Each rank's backward
      then computes the part of dL/dθ that flows through its own tokens; the attention's backward
      brings in what the other ranks' queries owe its keys and values (the core's convention:
      autograd differentiates the sum of every rank's loss, which here is L itself).
    * So parameter gradients are SUMMED over the sequence group, sum_r d(L_r / N)/dθ = dL/dθ, the
      one-process gradient, then averaged over the data-parallel ranks: ``sync_lm_grads``.
    Why not the DiT path's mean (``usp_dit.training.sync_grads``): there every rank computes the
    same loss on the gathered output, autograd's sum over ranks counts it P times and the mean
    undoes that. Here no rank gathers the logits (vocab-sized: an LLM's largest activation), each
    rank's graph holds only its own tokens' loss, and the sum is the gradient with no factor to undo.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from usp_dit.distributed.mesh import USPMesh, resolve_mesh
from usp_dit.distributed.replica import comm_device
from usp_dit.sharding.shard import shard_sequence
from usp_dit.training.reduce import _buckets, _check_plain, _fill_missing_grads, data_parallel_group

IGNORE_INDEX = -100  # transformers' and PyTorch's cross_entropy default


class LMBatch(NamedTuple):
    """This rank's shard of a causal-LM batch (``shard_lm_batch``)."""

    input_ids: torch.Tensor  # (batch, seq_local)
    position_ids: torch.Tensor  # (batch, seq_local) int64, global positions
    labels: torch.Tensor  # (batch, seq_local), shifted over the whole sequence before sharding
    seq_len: int  # the full sequence length


def _check_no_cfg(mesh: USPMesh) -> None:
    if mesh.cfg_degree > 1:
        raise ValueError(f"cfg_degree={mesh.cfg_degree}: a causal LM has no classifier-free guidance branches; "
                         f"build the mesh with cfg_degree=1 (ranks left over form the data-parallel axis)")


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(batch, seq) -> (batch, seq): ``out[:, i] = labels[:, i + 1]``, ``out[:, -1] = ignore_index``
    (what transformers' causal-LM loss does inside the model)."""
    out = labels.new_full(labels.shape, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def shard_lm_batch(
    input_ids: torch.Tensor,
    mesh: USPMesh | None = None,
    layout: str = "zigzag",
    labels: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> LMBatch:
    """This rank's shard of a causal-LM batch (Note [a causal LM on a sharded sequence]).

    Args:
        input_ids: (batch, seq) token ids, the same on every rank of the replica.
        mesh: the grid (``None``: the default mesh).
        layout: "zigzag", "stripe" or "contiguous"; the layout given to ``register_transformers``.
        labels: (batch, seq) unshifted labels as a transformers model takes them (``None``:
            ``input_ids``; ``ignore_index`` where a token must not count, e.g. right padding).
        ignore_index: the label that counts no loss (given to the last position).

    Returns:
        ``LMBatch(input_ids, position_ids, labels, seq_len)``: input_ids and labels
        (batch, seq_local) sharded with ``shard_sequence(..., layout=layout)``, labels shifted over
        the whole sequence first; position_ids (batch, seq_local), the global positions of this
        rank's tokens (pass them to the model: RoPE must see them).

    Raises:
        ValueError: input_ids not 2-D integers, fewer tokens than ranks in the sequence group (a
            rank would hold none: every layout gives each rank a token once seq >= ranks), labels
            of another shape, a bad layout, or a mesh with cfg_degree > 1.
    """
    mesh = resolve_mesh(mesh)
    _check_no_cfg(mesh)
    if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must be (batch, seq) integer token ids, "
                         f"got {tuple(input_ids.shape)} {input_ids.dtype}")
    if labels is None:
        labels = input_ids
    elif labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
    batch, seq_len = input_ids.shape
    if seq_len < mesh.sequence_degree:
        raise ValueError(f"input_ids has seq_len={seq_len} tokens for {mesh.sequence_degree} ranks of the sequence "
                         f"group: a rank would hold no token, and transformers models do not take an empty sequence")
    full_positions = torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)

    def local(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, mesh, dim=1, layout=layout).contiguous()

    return LMBatch(local(input_ids), local(full_positions), local(shift_labels(labels, ignore_index)), seq_len)


class _SumPassGradient(torch.autograd.Function):
    """Forward: the sum of ``x`` over ``group``; backward: the gradient unchanged (Note [a causal LM
    on a sharded sequence]: each rank differentiates its own share of the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        total = x.detach().to(device, copy=True).contiguous()
        dist.all_reduce(total, group=group)
        return total.to(x.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def lm_loss(
    logits_local: torch.Tensor,
    labels_local: torch.Tensor,
    mesh: USPMesh | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The one-process causal-LM loss of the whole sequence, on every rank of the sequence group.

    ``sum of this rank's token losses``, summed over the sequence group, ``/`` the number of labels
    that are not ``ignore_index`` in the whole sequence: the mean cross-entropy a single process
    computes (transformers' causal-LM loss). Its backward gives each rank the part of the gradient
    that flows through its own tokens; ``sync_lm_grads`` then sums the parameter gradients over the
    sequence group (Note [a causal LM on a sharded sequence]). Every rank of the group must call it.

    Args:
        logits_local: (batch, seq_local, vocab) the model's logits for this rank's tokens; half
            precision is upcast to float32, float32 and float64 are kept.
        labels_local: (batch, seq_local) from ``shard_lm_batch`` (already shifted).
        mesh: the grid (``None``: the default mesh).
        ignore_index: the label that counts no loss.

    Returns:
        A scalar, the same on every rank of the sequence group (NaN when no token has a label,
        like ``F.cross_entropy``'s mean).

    Raises:
        ValueError: logits and labels of mismatched shapes.
    """
    if logits_local.dim() != 3 or logits_local.shape[:2] != labels_local.shape:
        raise ValueError(f"logits_local {tuple(logits_local.shape)} must be (batch, seq_local, vocab) with "
                         f"labels_local {tuple(labels_local.shape)} as (batch, seq_local)")
    mesh = resolve_mesh(mesh)
    if logits_local.dtype not in (torch.float32, torch.float64):
        logits_local = logits_local.float()  # softmax of half-precision logits loses the small probabilities
    vocab = logits_local.shape[-1]
    local_sum = F.cross_entropy(logits_local.reshape(-1, vocab), labels_local.reshape(-1),
                                ignore_index=ignore_index, reduction="sum")
    count = (labels_local != ignore_index).sum()
    group = mesh.seq_group
    if group is not None:
        device = comm_device(mesh, logits_local)
        local_sum = _SumPassGradient.apply(local_sum, group, device)
        count = count.to(device)
        dist.all_reduce(count, group=group)
    return local_sum / count.to(local_sum.device, local_sum.dtype)


def sync_lm_grads(model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter], mesh: USPMesh | None = None) -> None:
    """After ``lm_loss(...).backward()``: every gradient summed over the sequence group, then
    averaged over the data-parallel ranks, in place.

    The sum is the one-process gradient of the replica's batch (Note [a causal LM on a sharded
    sequence]: each rank holds the part flowing through its own tokens); the mean over dp is
    ordinary data parallelism. Use it instead of DDP / FSDP, not with them. Parameters that do not
    require grad are skipped; a gradient that is ``None`` on some ranks only (no token of the rank
    reached the parameter, e.g. an embedding row) takes part as zeros.

    Raises:
        ValueError: a gradient is a DTensor (FSDP2 already reduced it), or cfg_degree > 1.
    """
    mesh = resolve_mesh(mesh)
    _check_no_cfg(mesh)
    params = list(model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params)
    params = [p for p in params if p.requires_grad]
    _check_plain(params)
    seq, dp = mesh.seq_group, data_parallel_group(mesh)
    groups = [g for g in (seq, dp) if g is not None]
    if not groups:
        return
    for bucket in _buckets(_fill_missing_grads(params, groups, mesh)):
        grads = [p.grad for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(comm_device(mesh, grads[0]))
        if seq is not None:
            dist.all_reduce(flat, group=seq)  # sum: the one-process gradient of this replica
        if dp is not None:
            dist.all_reduce(flat, group=dp)
            flat /= mesh.dp_degree  # mean: data parallelism
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
