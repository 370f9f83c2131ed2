#!/bin/bash
# On the CPU machine: the wheels of scripts/gpu_backends/fp8_flashinfer.sh, for the GPU machine's
# CPython 3.12 (22 MB: fits one carry beside .whl/diff).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl/fi flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5 nvidia-ml-py einops tabulate
