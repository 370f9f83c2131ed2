"""The ring schedule simulated on one device: N virtual ranks in one process, no communication.

Layout: q (B, Sq, H, D); k, v (B, Sk, Hk, D); out like q; lse (B, Sq, H).

Query and K/V sequences are cut into N blocks (uneven lengths allowed, as ``split_sizes`` cuts
them); every query block attends to every K/V block through the backend and the partial results
are merged by LSE exactly as a ring rank merges them. The backward feeds each block the merged
out/LSE, as the ring backward does. Used by the GPU kernel tests (a backend is ring-safe when its
blockwise result matches its whole-sequence result) and the ring-block benchmark.
"""
from __future__ import annotations

import torch

from usp_dit.kernels.base import AttentionBackend, lse_dtype
from usp_dit.merge import LSEMerger
from usp_dit.partition import split_sizes


def _blocks(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(x.split(split_sizes(x.shape[1], n), dim=1))


def blockwise_forward(q, k, v, backend: AttentionBackend, scale: float, n: int):
    """Returns ``(out, lse)`` of ``n`` x ``n`` blocks merged by LSE."""
    outs, lses = [], []
    for q_blk in _blocks(q, n):
        merger = LSEMerger()
        for k_blk, v_blk in zip(_blocks(k, n), _blocks(v, n)):
            merger.add(*backend.forward(q_blk, k_blk, v_blk, scale))
        out, lse = merger.result(q.dtype)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def blockwise_backward(dout, q, k, v, out, lse, backend: AttentionBackend, scale: float, n: int):
    """Returns ``(dq, dk, dv)``, block gradients accumulated in float32 as the ring does."""
    acc = lse_dtype(q.dtype)
    k_blocks, v_blocks = _blocks(k, n), _blocks(v, n)
    dk = [torch.zeros(b.shape, dtype=acc, device=b.device) for b in k_blocks]
    dv = [torch.zeros(b.shape, dtype=acc, device=b.device) for b in v_blocks]
    dqs = []
    for q_blk, do_blk, o_blk, l_blk in zip(_blocks(q, n), _blocks(dout, n), _blocks(out, n), _blocks(lse, n)):
        dq = torch.zeros(q_blk.shape, dtype=acc, device=q.device)
        for j, (k_blk, v_blk) in enumerate(zip(k_blocks, v_blocks)):
            g_q, g_k, g_v = backend.backward(do_blk, q_blk, k_blk, v_blk, o_blk, l_blk, scale)
            dq += g_q
            dk[j] += g_k
            dv[j] += g_v
        dqs.append(dq)
    cat = lambda xs, like: torch.cat(xs, dim=1).to(like.dtype)  # noqa: E731
    return cat(dqs, q), cat(dk, k), cat(dv, v)
