#!/bin/bash
# On the GPU machine, after install.sh: every installed kernel side by side in one run.
#   report: which kernels import and what "auto" picks (python -m usp_dit.kernels, head_dim 128, 64);
#   tests:  the GPU tests but FlashInfer's, its kernels compiling meanwhile (4 at once);
#   bench:  benchmarks/bench_attention.py --suite backends at the four shapes of shared/shapes.md;
#   fitests: the FlashInfer tests, once its kernels are built;
#   sage:   the SageAttention adapter against sageattn itself.
# TEST_K narrows the GPU tests (a pytest -k expression), BACKENDS the kernels of the benchmark.
# STAGES picks some (default: all, in this order); logs and JSON rows go to $OUT (or ./out).
set -uo pipefail
source scripts/gpu_backends/env.sh
out=${OUT:-out}; mkdir -p "$out"
stages=${STAGES:-report tests bench fitests}
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
has() { [[ " $stages " == *" $1 "* ]]; }
if has report; then
  { python3 -m usp_dit.kernels; python3 -m usp_dit.kernels --head-dim 64; } 2>&1 | tee "$out/kernels.txt"
fi
if has tests; then
  for cfg in "bfloat16 64" "bfloat16 128" "float16 64" "float16 128"; do
    python3 scripts/gpu_backends/warm_flashinfer.py $cfg >> /tmp/warm_flashinfer.log 2>&1 &
  done
  stamp "GPU tests (FlashInfer's later)"
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/gpu -q -k "${TEST_K:-not flashinfer}" -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests.log" | tail -30
  stamp "waiting for FlashInfer's kernels"
  wait
  cat /tmp/warm_flashinfer.log
fi
if has bench; then
  stamp "backends benchmark"
  python3 benchmarks/bench_attention.py --suite backends --shapes ${SHAPES:-flux,cogvideox,mochi,wan} ${BACKENDS:+--backends $BACKENDS} \
    --out "$out/backends.json" 2>&1 | tee "$out/bench.log"
  python3 benchmarks/bench_attention.py --suite calls --shapes ${CALL_SHAPES:-flux,cogvideox,mochi} \
    --out "$out/calls.json" 2>&1 | tee "$out/calls.log"
fi
if has fitests; then
  stamp "FlashInfer tests"
  timeout ${FI_TIMEOUT:-120} python3 -m pytest tests/gpu -q -k flashinfer -p no:cacheprovider 2>&1 \
    | tee "$out/gpu_tests_flashinfer.log" | tail -15
fi
if has sage; then
  python3 benchmarks/bench_attention.py --suite sage --shapes ${SHAPES:-flux,cogvideox,mochi,wan} --out "$out/sage.json" 2>&1 \
    | tee -a "$out/bench.log"
fi
stamp done
