"""``USPAttention``: ``usp_attention`` as a module, to drop into any model's attention.

Layout: q (batch, seq_local, heads, head_dim); k, v (batch, seq_local, kv_heads, head_dim); the
output is laid out like q. ``seq_local`` is this rank's shard of the sequence in the module's
``layout`` (``usp_dit.shard_sequence(x, mesh, layout=...)``).
"""
from __future__ import annotations

import torch
from torch import nn

from usp_dit.attention.masks import check_frame
from usp_dit.attention.usp import usp_attention
from usp_dit.distributed.mesh import USPMesh
from usp_dit.sharding.layouts import check_layout


class USPAttention(nn.Module):
    """Attention of this rank's sequence shard against the whole sequence, on a Ulysses x Ring grid.

    A thin module over ``usp_dit.usp_attention`` (no parameters): replace a model's
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` by ``self.attn(q, k, v)`` with
    ``self.attn = USPAttention(mesh, causal=True, layout="zigzag")`` and feed the model this rank's
    shard of the tokens (and of its positions: RoPE must see the global ones). With one rank it is
    ordinary (causal) attention.

    Args:
        mesh: the grid from ``usp_dit.init_usp``; ``None`` takes the default mesh at each call.
        causal: query at global position p attends to keys at global positions <= p.
        block_causal: a frame length F instead of ``causal`` (a token sees its own frame and the
            earlier ones).
        layout: "contiguous", "zigzag" or "stripe": where this rank's tokens sit in the sequence
            (Note [sequence layouts] in ``usp_dit.sharding.layouts``). "zigzag" and "stripe" give every
            ring rank the same causal work.
        backend: "auto" or a kernel name from ``usp_dit.kernels.list_backends()``.
        scale: softmax scale, default ``head_dim ** -0.5``.

    Raises:
        ValueError: a bad ``layout`` or ``block_causal``, or ``causal`` with ``block_causal``.
    """

    def __init__(
        self,
        mesh: USPMesh | None = None,
        *,
        causal: bool = False,
        block_causal: int | None = None,
        layout: str = "contiguous",
        backend: str = "auto",
        scale: float | None = None,
    ) -> None:
        super().__init__()
        check_frame(causal, block_causal)  # refused here, not at the first forward
        self.mesh = mesh
        self.causal = causal
        self.block_causal = block_causal
        self.layout = check_layout(layout)
        self.backend = backend
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """q (batch, seq_local, heads, head_dim), k/v (batch, seq_local, kv_heads, head_dim) ->
        (batch, seq_local, heads, head_dim). ``seq_len``: the full sequence length, if known
        (checked against every rank's shard)."""
        return usp_attention(
            q, k, v, mesh=self.mesh, causal=self.causal, block_causal=self.block_causal, layout=self.layout,
            seq_len=seq_len, scale=self.scale, backend=self.backend,
        ).out

    def extra_repr(self) -> str:
        mask = f"block_causal={self.block_causal}" if self.block_causal is not None else f"causal={self.causal}"
        return f"{mask}, layout={self.layout!r}, backend={self.backend!r}, mesh={self.mesh!r}"
