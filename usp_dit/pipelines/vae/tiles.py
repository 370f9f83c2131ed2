"""Independent pieces of a VAE call (tiles, cubes) dealt out over a replica's ranks.

Layout: any; the pieces are whole tensors (a tile's latent, a cube of video), one result each.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from usp_dit.distributed.comm import gather_uneven
from usp_dit.pipelines.vae.rows import row_offsets, row_split


def dealt(inputs: list[torch.Tensor], run: Callable[[torch.Tensor], torch.Tensor],
          group: dist.ProcessGroup) -> list[torch.Tensor]:
    """``[run(x) for x in inputs]`` with the work split over ``group``: rank r runs its contiguous
    run of inputs (``row_split`` of their count), and the results, which must share one shape, are
    all-gathered in input order. Every rank passes the same ``inputs``.

    A rank with no input (fewer inputs than ranks) learns the result's shape from group rank 0,
    which always has one."""
    sizes = row_split(len(inputs), dist.get_world_size(group))
    rank = dist.get_rank(group)
    start = row_offsets(sizes)[rank]
    mine = [run(x) for x in inputs[start:start + sizes[rank]]]
    shape = [tuple(mine[0].shape), mine[0].dtype] if mine else [None, None]
    if min(sizes) == 0:
        dist.broadcast_object_list(shape, group_src=0, group=group)
    stacked = torch.stack(mine) if mine else inputs[0].new_empty((0, *shape[0]), dtype=shape[1])
    return list(gather_uneven(stacked, sizes, 0, group).unbind(0))
