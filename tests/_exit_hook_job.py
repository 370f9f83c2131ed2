"""A user's job, run as plain processes by test_pipelines_api: builds a 2-rank Ulysses mesh, destroys
the process group and exits. It prints how many gloo threads are left once every exit hook has run,
i.e. what interpreter teardown would meet (a group destroyed there can abort the process)."""
from __future__ import annotations

import atexit
import os


def _gloo_threads_left() -> None:
    from usp_dit.testing import _gloo_threads

    print(f"GLOO THREADS AT TEARDOWN {_gloo_threads()}", flush=True)


atexit.register(_gloo_threads_left)  # registered before usp_dit's hook, so it runs after it

import torch.distributed as dist  # noqa: E402

import usp_dit  # noqa: E402

mesh = usp_dit.init_usp(ulysses_degree=int(os.environ["WORLD_SIZE"]))
print(f"RANKS {mesh.ulysses_rank}", flush=True)
dist.destroy_process_group()
