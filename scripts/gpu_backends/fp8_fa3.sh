#!/bin/bash
# On the GPU machine (carry scratch/fa3_fp8, made by scripts/gpu_backends/prepare_fp8_fa3.sh):
# unpack vLLM's FA3 library to /tmp/fa3_fp8 and check that it loads into this torch. Then
#     export USP_DIT_FA3_FP8_LIB=/tmp/fa3_fp8/_vllm_fa3_C.abi3.so
# and usp_attention(..., backend="fp8_fa3") / enable_usp(..., backend="fp8_fa3") use it.
set -euo pipefail
mkdir -p /tmp/fa3_fp8
lib=/tmp/fa3_fp8/_vllm_fa3_C.abi3.so
[ -e "$lib" ] || xz -d -T0 -c scratch/fa3_fp8/_vllm_fa3_C.abi3.so.xz > "$lib"
USP_DIT_FA3_FP8_LIB=$lib python3 -c "
from usp_dit.kernels import get_backend
b = get_backend('fp8_fa3'); b.require(); print('fp8_fa3 ready:', b.available())"
