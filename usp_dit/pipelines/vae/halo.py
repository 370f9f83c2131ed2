"""Halo rows between neighbouring ranks, and the convolutions that read them.

Layout: (batch, channels, [frames,] rows, width); rows are dim -2 (Note [an exact parallel VAE]).

A convolution spanning k > 1 rows gets its padding rows in one of two ways, and both are handled
at the one place every ``nn.Conv2d`` / ``nn.Conv3d`` computes, its ``_conv_forward`` (replaced on
the instance while the parallel VAE is enabled; it behaves as stock outside a parallel decode):

    "module"    the convolution pads itself (``conv.padding``): the halo is added here, and the
                convolution runs without row padding (the image border keeps the stock padding
                mode, zeros, replicate or reflect, on the first and last ranks; circular, which
                wraps the image's rows, is refused);
    "explicit"  the stock code padded the input before the call (``F.pad`` in a causal
                convolution wrapper, with zeros or by replicating): the pad rows on the sides
                facing another rank are replaced by that rank's rows.

Note [chunked convolutions]
    Some VAEs' convolutions (CogVideoX's and Mochi's ``CogVideoXSafeConv3d``, Kandinsky 6 SR's
    ``Kandinsky6SRSafeConv3d``) cut a large input into time chunks by its size and convolve each
    chunk: their ``_conv_forward`` runs once a chunk, and the chunk count follows the element
    count of the rank's own piece. Pieces of different row counts would then make different
    numbers of halo exchanges, which pair up wrongly or wait for ever. Their ``forward`` is
    replaced too (``chunked_conv_forward``): the halo is added once, to the whole input, and the
    chunks' ``_conv_forward`` calls within use it without an exchange. The time chunks are still
    cut by each rank's own size (the stock memory bound), and each chunk's rows are exactly the
    rows the stock code convolves.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROWS = -2


@dataclass(frozen=True)
class RowGroup:
    """The ranks decoding one latent together: ``sizes[r]`` latent rows on group rank ``r``."""

    group: dist.ProcessGroup
    rank: int
    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.sizes)

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)


class _Active(threading.local):
    rows: RowGroup | None = None
    haloed: bool = False  # the input of the convolution running now holds its halo (Note [chunked convolutions])


_ACTIVE = _Active()


def active() -> RowGroup | None:
    """The row group of the parallel decode running now in this thread, else ``None``."""
    return _ACTIVE.rows


@contextmanager
def decoding(rows: RowGroup) -> Iterator[None]:
    """Within: the replaced convolutions, norms and attention act on row pieces of ``rows``."""
    previous, _ACTIVE.rows = _ACTIVE.rows, rows
    try:
        yield
    finally:
        _ACTIVE.rows = previous


def neighbour_rows(real: torch.Tensor, top: int, bottom: int, rows: RowGroup):
    """``(above, below)``: the previous rank's last ``top`` rows and the next rank's first ``bottom``
    rows of ``real`` (``None`` at the image border). Each rank sends its own first ``bottom`` rows
    up and last ``top`` rows down, in one batch of point-to-point transfers."""
    n = real.shape[ROWS]
    if n < max(top, bottom):
        raise RuntimeError(f"parallel VAE: a halo of {max(top, bottom)} rows is wider than rank {rows.rank}'s {n} rows")
    ops, above, below = [], None, None
    if top and not rows.first:
        above = real.new_empty(real.shape[:ROWS] + (top, real.shape[-1]))
        ops.append(dist.P2POp(dist.irecv, above, rows.peer(rows.rank - 1), rows.group))
    if bottom and not rows.last:
        below = real.new_empty(real.shape[:ROWS] + (bottom, real.shape[-1]))
        ops.append(dist.P2POp(dist.irecv, below, rows.peer(rows.rank + 1), rows.group))
    if bottom and not rows.first:
        ops.append(dist.P2POp(dist.isend, real.narrow(ROWS, 0, bottom).contiguous(), rows.peer(rows.rank - 1), rows.group))
    if top and not rows.last:
        ops.append(dist.P2POp(dist.isend, real.narrow(ROWS, n - top, top).contiguous(), rows.peer(rows.rank + 1), rows.group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return above, below


def gathered_counts(n: int, rows: RowGroup, device: torch.device) -> list[int]:
    """Every rank's ``n`` (e.g. its token count at one level), in group rank order."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(rows.size)]
    dist.all_gather(every, mine, group=rows.group)
    return [int(t.item()) for t in every]


def _border(x: torch.Tensor, count: int, at_top: bool, mode: str) -> torch.Tensor:
    """``count`` rows padding ``x``'s top or bottom border as ``F.pad`` with ``mode`` would."""
    if mode in ("zeros", "constant"):
        return x.new_zeros(x.shape[:ROWS] + (count, x.shape[-1]))
    pad = [0, 0, count, 0] if at_top else [0, 0, 0, count]
    padded = F.pad(x, pad + [0, 0] * (x.dim() - 4), mode=mode)  # replicate / reflect want every spatial dim
    return padded.narrow(ROWS, 0 if at_top else padded.shape[ROWS] - count, count)


def add_halo(x: torch.Tensor, top: int, bottom: int, rows: RowGroup, mode: str) -> torch.Tensor:
    """``x`` with ``top`` rows above and ``bottom`` below: the neighbours' rows, or the image's
    border padded with ``mode`` on the first / last rank.

    The border is padded from the piece extended by the neighbour's rows on its other side: a
    reflecting pad reads the rows next to the edge row (rows 1..top of the image at the top), which
    a piece of one row (P not dividing the rows) only has together with the next rank's first rows.
    Zeros and replicate read at most the edge row itself, which is the piece's own."""
    above, below = neighbour_rows(x, top, bottom, rows)
    if top and above is None:
        above = _border(x if below is None else torch.cat([x, below], dim=ROWS), top, True, mode)
    if bottom and below is None:
        below = _border(x if above is None else torch.cat([above, x], dim=ROWS), bottom, False, mode)
    return torch.cat([t for t in (above, x, below) if t is not None], dim=ROWS)


def replace_pad_rows(x: torch.Tensor, top: int, bottom: int, rows: RowGroup) -> torch.Tensor:
    """``x`` padded by the stock code with ``top`` / ``bottom`` rows: those facing another rank
    become that rank's rows (the image border keeps the stock padding). Written into ``x`` in
    place: it is the tensor the stock code's ``F.pad`` (or padding module) just made for this call,
    so no copy of the padded piece is needed (one fewer activation-sized tensor per convolution)."""
    n = x.shape[ROWS] - top - bottom
    above, below = neighbour_rows(x.narrow(ROWS, top, n), top, bottom, rows)
    if above is not None:
        x.narrow(ROWS, 0, top).copy_(above)
    if below is not None:
        x.narrow(ROWS, top + n, bottom).copy_(below)
    return x


# ---- convolutions -----------------------------------------------------------------------------

PadsOf = Callable[[torch.nn.Module], tuple[int, int, str]]
"""``(top, bottom, where)`` of a convolution at call time; ``where`` is "module" or "explicit"."""


def module_pads(conv: torch.nn.Module) -> tuple[int, int, str]:
    """A convolution that pads its rows itself (``conv.padding``)."""
    return conv.padding[-2], conv.padding[-2], "module"


def conv_reason(conv: torch.nn.Module, top: int, bottom: int, where: str) -> str | None:
    """Why ``conv`` cannot run on row pieces, or None. Stride 1: it keeps the row count (top +
    bottom = dilation (k - 1)). Stride s > 1 (an encoder's downsampling): on a piece of a multiple
    of s rows it gives exactly rows / s rows, i.e. e = top + bottom - dilation (k - 1) is in
    [1 - s, 0] (the last piece, at the image's border, is padded as the stock code pads it).
    Depends on the convolution alone, so every rank finds the same answer."""
    k, d, s = conv.kernel_size[-2], conv.dilation[-2], conv.stride[-2]
    e = top + bottom - d * (k - 1)
    if where == "module" and (top or bottom) and conv.padding_mode == "circular":
        return f"a {type(conv).__name__} pads circularly: its first rows read the image's last rows"
    if isinstance(conv.padding, str) or (where == "explicit" and conv.padding[-2]) or not (1 - s <= e <= 0) or (s == 1 and e):
        return (f"a {type(conv).__name__} with kernel {conv.kernel_size}, stride {conv.stride}, padding {conv.padding} "
                f"and row padding ({top}, {bottom}) does not map row pieces to row pieces")
    return None


def _with_halo(conv: torch.nn.Module, x: torch.Tensor, top: int, bottom: int, where: str,
               rows: RowGroup) -> torch.Tensor:
    """``x`` with its halo rows: the stock pad rows replaced ("explicit") or rows added ("module")."""
    if where == "explicit":
        return replace_pad_rows(x, top, bottom, rows)
    return add_halo(x, top, bottom, rows, conv.padding_mode)


def _checked_pads(conv: torch.nn.Module, pads_of: PadsOf) -> tuple[int, int, str]:
    top, bottom, where = pads_of(conv)
    reason = conv_reason(conv, top, bottom, where)  # the pads can change at call time (a pad_mode)
    if reason:
        raise NotImplementedError(f"parallel VAE: {reason}")
    return top, bottom, where


def halo_conv_forward(conv: torch.nn.Module, pads_of: PadsOf, x: torch.Tensor, weight, bias) -> torch.Tensor:
    """``conv._conv_forward`` with the halo rows of the parallel decode (stock outside one)."""
    stock = type(conv)._conv_forward
    rows = active()
    if rows is None:
        return stock(conv, x, weight, bias)
    top, bottom, where = _checked_pads(conv, pads_of)
    if not _ACTIVE.haloed:
        x = _with_halo(conv, x, top, bottom, where, rows)
    if where == "explicit":
        return stock(conv, x, weight, bias)
    other = list(conv.padding)
    other[-2] = 0
    conv_fn = F.conv3d if weight.dim() == 5 else F.conv2d
    if conv.padding_mode != "zeros":  # the other dims' padding in the module's own mode
        pairs = [p for pad in reversed(other) for p in (pad, pad)]
        x, other = F.pad(x, pairs, mode=conv.padding_mode), [0] * len(other)
    return conv_fn(x, weight, bias, conv.stride, tuple(other), conv.dilation, conv.groups)


def chunked_conv_forward(conv: torch.nn.Module, pads_of: PadsOf, x: torch.Tensor) -> torch.Tensor:
    """``forward`` of a convolution that convolves its input in chunks cut by size: the halo added
    once, here, for every chunk's ``_conv_forward`` within (Note [chunked convolutions])."""
    stock = type(conv).forward
    rows = active()
    if rows is None or _ACTIVE.haloed:
        return stock(conv, x)
    top, bottom, where = _checked_pads(conv, pads_of)
    x = _with_halo(conv, x, top, bottom, where, rows)
    _ACTIVE.haloed = True
    try:
        return stock(conv, x)
    finally:
        _ACTIVE.haloed = False
