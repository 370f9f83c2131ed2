"""Starting a torchrun job: device, process group and thread budget from torchrun's variables."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(timeout_minutes: float = 10) -> tuple[int, int, torch.device]:
    """Start the process group (NCCL on GPUs, else gloo) if the job has several ranks.

    Returns ``(rank, world_size, device)``. On CPU the machine's cores are shared out among the
    local ranks, so that one rank's threads do not starve the others.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, device
