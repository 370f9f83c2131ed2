"""One rank of a job in which rank ``FAIL_RANK`` raises in the middle of a pipeline run.

Run as a plain process per rank (no torchrun agent) by tests/test_pipelines_api.py: nothing but
usp_dit's failure handler and gloo's closed connections may end the ranks that wait for the failed
one. The failing rank prints ``FAILING AT <unix time>`` just before it raises.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from usp_dit.demo.tiny_flux import tiny_flux_pipeline  # noqa: E402
import usp_dit.pipelines  # noqa: E402,F401  (gives DiffusionPipeline .enable_usp)


def main() -> None:
    torch.set_num_threads(1)
    fail_rank = int(os.environ["FAIL_RANK"])
    # A generous timeout: if the job ends, it is not because a collective timed out.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    pipe = tiny_flux_pipeline()
    pipe.enable_usp(ulysses_degree=2, ring_degree=dist.get_world_size() // 2)  # installs the failure handler

    def fail_mid_run(pipe, step, timestep, callback_kwargs):
        if rank == fail_rank and step == 1:
            print(f"FAILING AT {time.time():.3f}", flush=True)
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        return callback_kwargs

    pipe("a fox", height=40, width=40, num_inference_steps=6, max_sequence_length=16,
         generator=torch.Generator().manual_seed(0), callback_on_step_end=fail_mid_run)
    print("finished without failing", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
