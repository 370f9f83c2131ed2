#!/bin/bash
# On the CPU machine: FlashAttention 3's FP8 forward for the GPU machine (backend fp8_fa3), as
# scratch/fa3_fp8/_vllm_fa3_C.abi3.so.xz (11 MB; the library is 153 MB).
#
# flash-attention's own hopper/ build ships without FP8 where we found it (xformers 0.0.34's copy:
# "does not support FP8"); vLLM builds FA3 with its FP8 kernels (head dims 64-256) into
# vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so, registering torch.ops._vllm_fa3_C. It links libtorch's
# C++ ABI, so its vLLM release must pin the GPU machine's torch: vLLM 0.26.0 pins torch 2.11.0 and
# links libcudart.so.13 (the lent GPUs' torch 2.11.0+cu130). Then, there: scripts/gpu_backends/fp8_fa3.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${VLLM_VERSION:-0.26.0}
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp" "vllm==$version"
mkdir -p scratch/fa3_fp8
unzip -o -q -j "$tmp"/vllm-*.whl vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so -d "$tmp"
xz -6 -T2 -c "$tmp/_vllm_fa3_C.abi3.so" > scratch/fa3_fp8/_vllm_fa3_C.abi3.so.xz
rm -rf "$tmp"
ls -la scratch/fa3_fp8
