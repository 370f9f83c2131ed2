#!/bin/bash
# On the GPU machine (carry .whl): FlashInfer alone (its FP8 prefill, backend fp8_flashinfer) into
# /tmp/site, with diffusers; then `export PYTHONPATH=/tmp/site:$PWD`. Prepare .whl/fi on the CPU
# machine with scripts/gpu_backends/prepare_fp8_flashinfer.sh.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/fi/*.whl .whl/diff/*.whl
