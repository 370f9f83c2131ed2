"""Independent float64 reference attention (plain PyTorch maths, no usp_dit code)."""
from __future__ import annotations

import torch


def attention_ref(q, k, v, scale):
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (B, Sq, H, D), lse (B, Sq, H); float64, autograd-able."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(1, 2)


def joint_attention_ref(q, k, v, jq, jk, jv, scale):
    """Attention over [sequence; joint] for both query sets; returns (out, joint_out, lse, joint_lse)."""
    n = q.shape[1]
    out, lse = attention_ref(torch.cat([q, jq], 1), torch.cat([k, jk], 1), torch.cat([v, jv], 1), scale)
    return out[:, :n], out[:, n:], lse[:, :n], lse[:, n:]


def frame_causal_mask(seq: int, frame: int) -> torch.Tensor:
    """(seq, seq) bool: query p sees key s when s // frame <= p // frame (frame 1: causal)."""
    pos = torch.arange(seq)
    return (pos[None, :] // frame) <= (pos[:, None] // frame)


def masked_attention_ref(q, k, v, scale, mask):
    """``attention_ref`` with a (Sq, Sk) bool mask (True: visible); float64, autograd-able."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = (torch.einsum("bqhd,bkhd->bhqk", q, k) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(1, 2)
