"""The multi-GPU benchmark (benchmarks/bench_scaling.py) runs end to end on CPU ranks (gloo), so the
script the multi-GPU issue needs is known to work before GPUs are lent; its grid parsing is checked
without processes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.bench_scaling import parse_grids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_grids():
    assert parse_grids(None, 8) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert parse_grids(None, 6) == [(2, 3), (1, 6)]
    assert parse_grids("2x2,4x1", 4) == [(2, 2), (4, 1)]
    with pytest.raises(ValueError, match="--grids entry 2x1: U \\* R must equal the world size 4"):
        parse_grids("2x1", 4)


def test_tiny_run_on_two_cpu_ranks_matches_one_rank():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "benchmarks/bench_scaling.py", "--tiny", "--ring-schedule", "stream", "--rounds", "1", "--iters", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "tiny" in line]
    assert len(rows) == 6, proc.stdout  # 3 models x grids 2x1, 1x2
    assert "parity: MATCH" in proc.stdout
