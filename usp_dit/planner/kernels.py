"""Attention kernel time per call, from rates measured on the H200 (kept here as data).

Layout: a call is ``flops = 4 * batch * queries * keys * heads * head_dim`` (forward); times in
seconds.

Note [kernel tables]
    Source: docs/PERFORMANCE.md, "All kernels side by side" (2026-12-03, run 2, one H200, torch
    2.11.0+cu130, `bench_attention.py --suite calls`): the forward of one rank's queries against
    all keys at N = 1, 2, 4, 8 for Flux (head_dim 128, 2.6e11 flops at N = 1), CogVideoX (64) and
    Mochi (128, 2.5e13), median of 5 interleaved rounds. A call's rate is interpolated in log(flops)
    between the measured points of its head_dim (small calls run below the kernel's peak: fewer
    waves, per-call CPU cost) and held at the ends. Forward + backward = forward x the measured
    ratio ("Kernels through their adapters", run 2: FA3 3.98 / 3.51 / 3.81 / 3.87 at Flux /
    CogVideoX / Mochi / Wan; cuDNN 4.04 / 3.49 / 3.74 / 3.66): 3.8 at head_dim 128, 3.5 at 64.
    A causal diagonal call computes half the pairs at the rate of a call of that size (its
    triangular tiles waste some work: x 1.1, an estimate). Other GPUs: unmeasured, the H200's.
"""
from __future__ import annotations

import bisect
import math

# backend -> head_dim -> sorted (flops, forward ms) points.
MEASURED_FORWARD = {
    "flash_attn_3": {
        128: [(3.26e10, 0.059), (6.52e10, 0.116), (1.30e11, 0.235), (2.61e11, 0.417),
              (3.08e12, 4.587), (6.16e12, 9.218), (1.23e13, 18.38), (2.46e13, 36.44)],
        64: [(4.85e11, 1.043), (9.71e11, 1.945), (1.94e12, 3.881), (3.88e12, 7.501)],
    },
    "sdpa_cudnn": {
        128: [(3.26e10, 0.075), (6.52e10, 0.128), (1.30e11, 0.249), (2.61e11, 0.449),
              (3.08e12, 5.483), (6.16e12, 11.056), (1.23e13, 22.193), (2.46e13, 44.002)],
        64: [(4.85e11, 1.287), (9.71e11, 2.406), (1.94e12, 4.809), (3.88e12, 9.516)],
    },
}
BACKWARD_FACTOR = {128: 3.8, 64: 3.5}  # forward + backward time / forward time
CAUSAL_WASTE = 1.1
KERNEL_SOURCE = "docs/PERFORMANCE.md 'All kernels side by side' (2026-12-03, H200, --suite calls, run 2)"
DEFAULT_BACKEND = "flash_attn_3"  # what "auto" takes on an H200 with it installed


def _nearest(table: dict, key: int):
    return table[min(table, key=lambda k: abs(k - key))]


def rate(flops: float, head_dim: int, backend: str = DEFAULT_BACKEND) -> float:
    """Forward flop/s of one call of ``flops`` (Note [kernel tables])."""
    if backend not in MEASURED_FORWARD:
        raise ValueError(f"backend={backend!r} has no measured table; choose one of {sorted(MEASURED_FORWARD)}")
    points = _nearest(MEASURED_FORWARD[backend], head_dim)
    xs = [math.log(f) for f, _ in points]
    rates = [f / (ms * 1e-3) for f, ms in points]
    x = math.log(max(flops, 1.0))
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return rates[0] * (flops / points[0][0]) ** 0.5 if flops < points[0][0] else rates[0]
    if i == len(xs):
        return rates[-1]
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return rates[i - 1] + t * (rates[i] - rates[i - 1])


def call_seconds(flops: float, head_dim: int, *, backward: bool = False, causal: bool = False,
                 backend: str = DEFAULT_BACKEND) -> float:
    """Time of one kernel call of ``flops`` dense-equivalent flops (a causal call: half of them)."""
    if flops <= 0:
        return 0.0
    work = flops / 2 * CAUSAL_WASTE if causal else flops
    seconds = work / rate(work, head_dim, backend)
    return seconds * (_nearest(BACKWARD_FACTOR, head_dim) if backward else 1.0)


