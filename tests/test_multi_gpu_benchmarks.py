"""The multi-GPU benchmarks (benchmarks/bench_scaling.py, bench_parity.py) run end to end on CPU ranks
(gloo), so the scripts the multi-GPU issue needs are known to work before GPUs are lent; grid
parsing is checked without processes."""
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


def _torchrun(script: str, *args: str) -> str:
    """stdout of ``script`` on two CPU ranks; fails the test on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_scaling_tiny_run_on_two_cpu_ranks_matches_one_rank():
    out = _torchrun("benchmarks/bench_scaling.py", "--tiny", "--ring-schedule", "stream", "--rounds", "1", "--iters", "1")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "tiny" in line]
    assert len(rows) == 6, out  # 3 models x grids 2x1, 1x2
    assert "parity: MATCH" in out


def test_parity_tiny_run_on_two_cpu_ranks():
    """Every grid and schedule within bounds (float32 1e-4, float64 1e-10), and the errors are real
    numbers: a ring in float64 differs from one rank by rounding only, not by zero or by much."""
    out = _torchrun("benchmarks/bench_parity.py", "--tiny")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 16, out  # 2 shapes x 2 dtypes x (2x1, 1x2 stream, 1x2 gather, 1x2 allgather)
    assert all(r[-1].strip() == "ok" for r in rows), out
    ring64 = [float(v) for r in rows if r[1].strip() == "float64" and r[2].strip() == "1x2" for v in r[4:-1]]
    assert ring64 and 0 < max(ring64) < 1e-13, ring64
    assert "parity: MATCH (16/16" in out
