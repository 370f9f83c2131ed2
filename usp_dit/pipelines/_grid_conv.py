"""A stride-1 2-D convolution over a row-major token grid whose tokens are sharded contiguously over the
sequence group: exact, by fetching the halo tokens it reads from the ranks that hold them.

Layout: the grid is (height, width), token t at row t // width, column t % width (as ``PatchEmbed``
flattens a latent), or, with ``frame_rows`` set, a stack of frames of ``frame_rows`` rows each
(a video's (frames, rows, width) tokens, frame-major: height = frames x rows); sequence rank i holds the tokens [off_i, off_i + n_i) of the contiguous layout
(``usp_dit.sharding.partition.split_sizes``). Tokens travel as (batch, channels, n) (a conv's
channels-first layout, the grid flattened); a conv runs on (batch, channels, rows, width).

Note [a conv over sharded tokens]
    A k x k conv with stride 1 and zero padding p = k // 2 reads, for an output token at row r, the
    rows r - p .. r + p. Rank i's tokens [a, b) lie on rows r0 = a // W .. r1 = (b - 1) // W, so it
    needs the whole rows r0 - p .. r1 + p (clipped to the grid): the token window [lo, hi) =
    [max(r0 - p, 0) W, min(r1 + p + 1, H) W), which contains [a, b). The tokens of [lo, a) and
    [b, hi) (its halo) come from the ranks that hold them, in one all-to-all: every rank knows every
    window (they depend on H, W and P only), so no sizes are exchanged. The stock conv then runs on
    the window's rectangle of rows; its own zero padding is the grid's wherever the window touches
    the grid's edge (the top, the bottom, every row's ends), and any output row it gets wrong
    (the window's first and last, when they are halo rows inside the grid) is not one of this
    rank's. The output tokens [a, b) are kept: each is the same sum of the same products as one
    process computes.

        rows      tokens of rank i (▓) in a W = 7 grid, p = 1
        r0 - 1    ░░░░░░░   halo: fetched (from rank i - 1, or further back when shards are short)
        r0        ░░░▓▓▓▓
        r0 + 1    ▓▓▓▓▓▓▓
        r1        ▓▓░░░░░   the rest of r1 and the row below: fetched from rank i + 1 (and on)
        r1 + 1    ░░░░░░░

    The extra work is at most 2 (p + 1) rows of the conv per rank. Backward: the adjoint exchange
    sends each fetched piece's gradient home, where it is added to the owner's rows.

Note [a per-frame conv over sharded video tokens]
    A video's spatial conv (Sana-Video's Mix-FFN: k x k over each frame's (rows, width), frames as
    the batch) must not read across frames: each frame has its own zero padding at its top and
    bottom. The grid is then the frames' rows stacked, height = frames x frame_rows, and the window
    is built as above; where a frame starts inside the window, ``p`` zero rows are put between the
    two frames' rows before the conv, and taken out of its output after. A row beside a frame
    boundary then reads zeros where one process reads the frame's zero padding: the same sum of
    the same products. (The rows fetched across a boundary are read by no kept output.) A conv
    along time (k x 1 over (frames, rows x width)) needs no such rows: it is the plain case with
    height = frames, width = rows x width, its window whole frames.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp_dit.distributed.comm import exchange
from usp_dit.distributed.mesh import USPMesh
from usp_dit.sharding.partition import offsets, split_sizes


@dataclass(frozen=True)
class GridShards:
    """Note [a conv over sharded tokens]: a (height, width) grid's tokens on ``parts`` ranks, and
    the windows a conv of ``halo`` rows each side reads."""

    height: int
    width: int
    parts: int
    halo: int
    frame_rows: int = 0  # rows per frame (Note [a per-frame conv over sharded video tokens]); 0: one image

    def __post_init__(self) -> None:
        if self.frame_rows and self.height % self.frame_rows:
            raise ValueError(f"frame_rows={self.frame_rows} does not divide height={self.height}")

    @property
    def sizes(self) -> list[int]:
        return split_sizes(self.height * self.width, self.parts)

    def span(self, i: int) -> tuple[int, int]:
        """Rank ``i``'s tokens [a, b)."""
        a = offsets(self.sizes)[i]
        return a, a + self.sizes[i]

    def window(self, i: int) -> tuple[int, int]:
        """The tokens [lo, hi) of whole rows rank ``i``'s conv reads (its tokens, ``halo`` rows either side)."""
        a, b = self.span(i)
        first = max(a // self.width - self.halo, 0)
        last = min((b - 1) // self.width + self.halo + 1, self.height)
        return first * self.width, last * self.width

    def piece(self, src: int, dst: int) -> tuple[int, int]:
        """The tokens [s, e) rank ``src`` sends rank ``dst`` (empty: s == e): ``src``'s tokens in
        ``dst``'s window. ``src``'s tokens lie wholly before or after ``dst``'s, so this is one range."""
        if src == dst:
            return 0, 0
        a, b = self.span(src)
        lo, hi = self.window(dst)
        s, e = max(a, lo), min(b, hi)
        return (s, e) if s < e else (0, 0)

    def frame_starts(self, i: int) -> list[int]:
        """The rows of rank ``i``'s window (counted from its first) where a frame starts, its first row excluded."""
        if not self.frame_rows:
            return []
        lo, hi = (t // self.width for t in self.window(i))
        return [r - lo for r in range(lo + 1, hi) if r % self.frame_rows == 0]


def _to_send(x: torch.Tensor, grid: GridShards, rank: int) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    """What this rank sends (its tokens in each rank's window, (B, C, n_to_j) per rank j) and the
    shapes it receives ((B, C, n_from_i) per rank i: their tokens in its window)."""
    a = grid.span(rank)[0]
    chunks = []
    for dst in range(grid.parts):
        s, e = grid.piece(rank, dst)
        chunks.append(x.narrow(-1, s - a, e - s) if e > s else x.narrow(-1, 0, 0))
    shapes = []
    for src in range(grid.parts):
        s, e = grid.piece(src, rank)
        shapes.append((*x.shape[:-1], e - s))
    return chunks, shapes


class _FetchWindow(torch.autograd.Function):
    """(B, C, n_local) this rank's tokens -> (B, C, hi - lo) its window's tokens (Note [a conv over sharded tokens])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, grid: GridShards, rank: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.grid, ctx.rank, ctx.group = grid, rank, group
        chunks, shapes = _to_send(x, grid, rank)
        recv = exchange(chunks, shapes, group, kind="seq_gather")
        return torch.cat([*recv[:rank], x, *recv[rank + 1:]], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grid, rank = ctx.grid, ctx.rank
        widths = [grid.piece(src, rank)[1] - grid.piece(src, rank)[0] for src in range(grid.parts)]
        widths[rank] = grid.sizes[rank]
        parts = list(grad.split(widths, dim=-1))
        back_shapes = [(*grad.shape[:-1], grid.piece(rank, dst)[1] - grid.piece(rank, dst)[0])
                       for dst in range(grid.parts)]
        send = [p if i != rank else p.narrow(-1, 0, 0) for i, p in enumerate(parts)]
        home = exchange(send, back_shapes, ctx.group, kind="seq_gather")
        grad_x = parts[rank].clone()
        a = grid.span(rank)[0]
        for dst, g in enumerate(home):
            s, e = grid.piece(rank, dst)
            if e > s:
                grad_x[..., s - a:e - a] += g
        return grad_x, None, None, None


def _fetch_call(x, grid, rank, group):
    return _FetchWindow.apply(x, grid, rank, group)


# Eagerly outside Dynamo (as usp_dit.attention.usp's sharded calls); traced into the graph under torch.compile.
_fetch_eager = torch.compiler.disable(_fetch_call)


def window_tokens(x: torch.Tensor, grid: GridShards, mesh: USPMesh) -> torch.Tensor:
    """(B, C, n_local) this rank's tokens -> (B, C, rows, width), the whole rows of its window
    (Note [a conv over sharded tokens]); differentiable.

    Raises:
        ValueError: ``x`` does not hold this rank's ``grid.sizes[rank]`` tokens.
    """
    rank = mesh.seq_rank
    if x.shape[-1] != grid.sizes[rank]:
        raise ValueError(f"x has {x.shape[-1]} tokens but sequence rank {rank} holds {grid.sizes[rank]} of the "
                         f"{grid.height} x {grid.width} grid")
    group = mesh.seq_group
    if group is not None:
        call = _fetch_call if torch.compiler.is_compiling() else _fetch_eager
        x = call(x, grid, rank, group)
    return window_rows(x, grid, rank)


def _row_pieces(rows: int, starts: list[int]) -> list[int]:
    """The sizes of the runs of ``rows`` rows cut at ``starts``."""
    edges = [0, *starts, rows]
    return [e - s for s, e in itertools.pairwise(edges)]


def window_rows(x: torch.Tensor, grid: GridShards, rank: int) -> torch.Tensor:
    """(B, C, hi - lo) rank ``rank``'s window tokens -> (B, C, rows, width) its rows, with ``grid.halo``
    zero rows between two frames (Note [a per-frame conv over sharded video tokens])."""
    lo, hi = grid.window(rank)
    x = x.unflatten(-1, ((hi - lo) // grid.width, grid.width))
    starts = grid.frame_starts(rank)
    if not starts:
        return x
    zeros = x.new_zeros(*x.shape[:-2], grid.halo, grid.width)
    pieces = x.split(_row_pieces(x.shape[-2], starts), dim=-2)
    return torch.cat([t for piece in pieces for t in (piece, zeros)][:-1], dim=-2)


def own_tokens(y: torch.Tensor, grid: GridShards, mesh: USPMesh | int) -> torch.Tensor:
    """(B, C, rows, width) a conv's output over this rank's window (``window_tokens``' rows) -> (B, C,
    n_local), its own tokens. ``mesh``: the mesh, or the sequence rank itself."""
    rank = mesh if isinstance(mesh, int) else mesh.seq_rank
    starts = grid.frame_starts(rank)
    if starts:  # drop the zero rows put between frames
        lo, hi = grid.window(rank)
        sizes = _row_pieces((hi - lo) // grid.width, starts)
        split = [n for size in sizes for n in (size, grid.halo)][:-1]
        y = torch.cat(y.split(split, dim=-2)[::2], dim=-2)
    a, b = grid.span(rank)
    lo = grid.window(rank)[0]
    return y.flatten(-2)[..., a - lo:b - lo]
