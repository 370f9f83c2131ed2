"""Recognising a dense frame-causal attention mask, so that it runs as ``block_causal`` on the grid.

Layout: the mask is (batch | 1, 1 | heads, S, S) bool, True = attend, over the whole (unsharded)
sequence of S tokens, as a model builds it before its tokens are split.

Note [dense frame-causal masks]
    Autoregressive video DiTs (SkyReels-V2's diffusion forcing) build an S x S bool mask where a
    token sees every token of its own block of frames and of the earlier ones: query p sees key s
    when s // F <= p // F, F = frames per block x tokens per frame. A dense mask cannot be split
    over a ring, but this one is ``usp_attention(block_causal=F)`` (Note [staircase masks] in
    ``usp_dit.attention.masks``), which skips hidden blocks instead of reading S^2 booleans. F is read from
    the first row (its count of True); the whole mask is then checked against the frame-causal
    mask of that F, row chunk by row chunk, once per mask tensor (the model passes the same tensor
    to every block), and anything else is refused: the mask is never silently replaced by a
    different one.
"""
from __future__ import annotations

import weakref

import torch

_CHUNK_ROWS = 1024  # rows compared at a time: S x 1024 booleans, never a second S x S tensor


def _matches(mask: torch.Tensor, frame: int) -> bool:
    """``mask`` (B, H, S, S) equals the frame-causal mask of ``frame`` in every batch and head."""
    seq = mask.shape[-1]
    keys = torch.arange(seq, device=mask.device)
    for start in range(0, seq, _CHUNK_ROWS):
        rows = torch.arange(start, min(seq, start + _CHUNK_ROWS), device=mask.device)
        expected = (keys[None, :] // frame) <= (rows[:, None] // frame)
        if not bool((mask[..., start:start + len(rows), :] == expected).all()):
            return False
    return True


class FrameMaskReader:
    """``frame(mask, seq_len)``: the F of a frame-causal mask (Note [dense frame-causal masks]),
    checked once per mask tensor."""

    def __init__(self) -> None:
        # (weak reference to the last mask checked, its version, its F): the same tensor object
        # again (every block of one forward) is not checked again; a new forward's new mask is,
        # even where the allocator reuses the old one's memory.
        self._seen: tuple | None = None

    def frame(self, mask: torch.Tensor, seq_len: int) -> int:
        """Raises NotImplementedError for any mask that is not frame-causal over ``seq_len`` tokens."""
        if mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[-2:]) != (seq_len, seq_len):
            raise NotImplementedError(
                f"usp_dit routes a dense attention mask only when it is a ({seq_len}, {seq_len}) bool "
                f"frame-causal mask over the whole sequence; got {tuple(mask.shape)} {mask.dtype}"
            )
        version = _version(mask)
        if self._seen is not None and self._seen[0]() is mask and self._seen[1] == version:
            return self._seen[2]
        frame = int(mask[0, 0, 0].sum())
        if frame < 1 or not _matches(mask, frame):
            raise NotImplementedError(
                "usp_dit routes a dense attention mask only when it is frame-causal (a token sees its "
                "own block of frames and the earlier ones); this mask is not"
            )
        self._seen = (weakref.ref(mask), version, frame)
        return frame


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter; -1 for an inference-mode tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return -1
