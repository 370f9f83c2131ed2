"""torchrun job plumbing for the examples: start-up from torchrun's variables, the one-rank check."""
from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable

import numpy as np
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


# max |diff| / max |one rank| of final images or frames, by the transformer's dtype. float32: the
# sharded transformer differs from one rank's by float32 rounding (~1e-6); denoising steps and an
# untrained VAE (large gain) bring it to ~3e-6 (Flux 1008x1008, 4 steps) .. ~3e-5 (tiny video), so
# 1e-4 leaves room for longer runs. Half precision: rounding of 1e-3 per op, compounded over steps.
MATCH_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def compare_with_one_rank(pipe, run_alone: Callable[[], np.ndarray], result: np.ndarray, rank: int) -> None:
    """Disable USP; rank 0 runs ``run_alone()`` and prints its match with ``result``; the others wait."""
    pipe.disable_usp()
    if rank == 0:
        start = time.perf_counter()
        ref = run_alone()
        diff = float(np.abs(result.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-12))
        tol = MATCH_TOLERANCE[pipe.transformer.dtype]
        verdict = "MATCH" if diff <= tol else "MISMATCH"
        print(f"one rank: {time.perf_counter() - start:.1f} s; max|diff|/max|one rank| = {diff:.2e} "
              f"(tolerance {tol:.0e}): {verdict}", flush=True)
    if dist.is_initialized():
        dist.barrier()
