"""Diffusers' flex attention backend as a GPU computes it, for CPU tests of NABLA block-sparse models.

Layout: Q/K/V (batch, seq, heads, head_dim), as ``dispatch_attention_fn`` takes them.

Note [flex on CPU ignores a BlockMask's blocks]
    Kandinsky 5's ``nablaT_v2`` and Kandinsky 6 SR's ``nabla_block_mask`` build their BlockMask
    with ``BlockMask.from_kv_blocks(zeros, kv_inds, kv_nb, kv_inds, mask_mod=None)``: every kept
    block is a *full* block, and the pattern lives in the block indices alone (the mask_mod is
    the no-op). Eager ``flex_attention`` (its math fallback, on CPU and GPU alike) evaluates the
    mask_mod over every (query, key) pair and never reads the indices, so it attends densely; the
    compiled GPU kernel visits only the listed blocks. On CPU, inductor's flex template fails to
    lower these calls (torch 2.13: "too many values to unpack" in ``cpp_flex_attention_template``
    on the rotated Q's 5-d view). So CPU tests attend with the BlockMask's blocks expanded to a
    dense SDPA mask (``flex_honouring_blocks``): what the compiled GPU kernel computes, eager or
    traced (``torch.compile(backend="aot_eager")`` traces it: ``BlockMask.to_dense`` traces).
    Not for a BlockMask whose mask_mod masks inside a block (Wan-Animate-2's ``create_mask``):
    there eager flex is already exact, and the block expansion would not be.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry


def flex_honouring_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                          scale: float | None = None, **kwargs) -> torch.Tensor:
    """Diffusers' flex backend with a full-block BlockMask honoured (Note [flex on CPU ignores a
    BlockMask's blocks]): its blocks expanded to a dense bool mask for SDPA. (B, S, H, D) in and out."""
    mask = None
    if attn_mask is not None:
        size_q, size_kv = attn_mask.BLOCK_SIZE
        mask = attn_mask.to_dense().bool().repeat_interleave(size_q, -2).repeat_interleave(size_kv, -1)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def honoured_flex() -> contextlib.ExitStack:
    """The flex backend swapped for ``flex_honouring_blocks``, and Diffusers' process-wide active
    backend (``set_attention_backend`` sets it for every later model, not just one) put back on
    exit: warm test ranks are reused by later test files, whose models must not inherit flex."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.dict(_AttentionBackendRegistry._backends,
                                        {AttentionBackendName.FLEX: flex_honouring_blocks}))
    stack.enter_context(mock.patch.object(_AttentionBackendRegistry, "_active_backend",
                                          _AttentionBackendRegistry._active_backend))
    return stack
