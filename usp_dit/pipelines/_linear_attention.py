"""Linear (kernelised) attention over a token sequence sharded on the ranks: exact by an all-reduce
of per-head summaries, not by a ring.

Layout: a summary is any tensor whose value is a sum over the sequence of per-token terms, e.g.
Sana's ``[V; 1] @ K`` of shape (batch, heads, head_dim + 1, head_dim), float32; each rank holds the
sum over its own tokens, ``summed_over_sequence`` returns the sum over every rank's tokens.

Note [linear attention on a grid]
    Softmax attention needs every key for every query (a ring or an all-to-all). Linear attention
    (Sana: ReLU feature maps, Diffusers' ``SanaLinearAttnProcessor2_0``) factors instead:

        out[:, s] = (sum_t V1[:, t] K[t, :]) Q[:, s] / last row of the same,   V1 = [V; 1]
                     └──────── summary (B, H, D + 1, D): a sum over tokens ──┘

    A sum over tokens splits over ranks: each rank sums its own tokens, one all-reduce (sum) over
    the sequence group gives every rank the whole summary, and each rank applies it to its own
    queries. Exact up to the order of float32 additions; the traffic is B * H * (D + 1) * D floats a
    layer, whatever the sequence length; the Ulysses / ring split of the group does not matter
    (one all-reduce over all of it).

        rank r: K_r, V_r, Q_r ─► V1_r @ K_r ─► all-reduce(sum) ─► summary @ Q_r ─► out_r

    Backward: every rank's output reads the summed summary, so the gradient of one rank's partial
    sum is the sum over ranks of the gradients of the summary: an all-reduce of the gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from usp_dit.distributed.mesh import USPMesh


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) with the adjoint backward: the gradient is all-reduced too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def _sum_call(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _SumOverGroup.apply(x, group)


# Eagerly outside Dynamo (as usp_dit.attention.usp's sharded calls); traced into the graph under torch.compile.
_sum_eager = torch.compiler.disable(_sum_call)


def summed_over_sequence(partial: torch.Tensor, mesh: USPMesh) -> torch.Tensor:
    """Note [linear attention on a grid]: this rank's partial sum over its tokens -> the sum over
    every token of the sequence group, the same on every rank (differentiable).

    Args:
        partial: any shape, the sum over this rank's tokens of per-token terms.
    Returns:
        The same shape and dtype: the sum of every rank's ``partial`` (``partial`` itself on one rank).
    """
    group = mesh.seq_group
    if group is None:
        return partial
    call = _sum_call if torch.compiler.is_compiling() else _sum_eager
    return call(partial, group)
