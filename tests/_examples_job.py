"""torchrun job for tests/test_examples_cli.py: several example runs in one job, one process group.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/_examples_job.py \
        "generate_video --model ltx_video --cfg 2" "generate_image --family sd3" ...

Each argument is one run: an example's name and its command line. Every rank calls that example's
``main(argv)`` in turn, as torchrun would run the script, so its checks, its grid, its output and its
MATCH line are the script's own. Why one job: a run of a tiny pipeline takes well under a second;
its process start-up (torch, diffusers and transformers imported on two ranks) takes ~8 s of CPU.
One job pays that once for every family.

The examples' ``main`` ends with ``dist.destroy_process_group()``; here the group is kept until the
last run (each ``main`` then finds it started and reuses it) and destroyed once at the end.
"""
from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path
from unittest import mock

import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    """examples/<name>.py as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def main(runs: list[str]) -> None:
    modules = {}
    with mock.patch.object(dist, "destroy_process_group", lambda *a, **k: None):
        for run in runs:
            name, *argv = shlex.split(run)
            if name not in modules:
                modules[name] = _example(name)
            modules[name].main(argv)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
