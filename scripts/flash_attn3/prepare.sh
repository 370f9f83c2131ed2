#!/bin/bash
# On the CPU machine: gather a FlashAttention 3 test build for the lent H200 into scratch/fa3/.
#
# No FA3 wheel for that machine's torch 2.11 + CUDA 13 is on the package registries, and PyPI's
# flash-attn sdist has no hopper/ sources. xformers 0.0.34 (PyPI) vendors the FA3 Hopper kernels
# as xformers/flash_attn_3/_C.so (flash-attention's own build, registering
# torch.ops.flash_attn_3.fwd/bwd), compiled with CUDA 12 against torch 2.10 through libtorch's
# *stable* C ABI (aoti_torch_* functions only, all 62 present in torch 2.11; checked with nm), so it
# loads on the H200's torch 2.11 given libcudart.so.12 (nvidia-cuda-runtime-cu12).
# Not xformers 0.0.33 (torch 2.9, the C++ ABI): torch 2.10 changed intrusive_ptr's reference
# count (one 64-bit word with a PyObject bit), and its inlined refcounting then freed live tensors
# ("Cannot access data pointer of Tensor that doesn't have storage" on the H200).
# Output: scratch/fa3/{_C.so.xz (35 MiB), libcudart.so.12}; then on the GPU machine
# scripts/flash_attn3/install_on_gpu.sh. The GPU tests check its numerics against float64.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
pip download -q --no-deps xformers==0.0.34 nvidia-cuda-runtime-cu12==12.9.79 --only-binary=:all: \
  --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp"
mkdir -p scratch/fa3
unzip -o -q -j "$tmp"/xformers-*.whl xformers/flash_attn_3/_C.so -d "$tmp"
unzip -o -q -j "$tmp"/nvidia_cuda_runtime_cu12-*.whl nvidia/cuda_runtime/lib/libcudart.so.12 -d scratch/fa3
xz -9 -T2 -c "$tmp/_C.so" > scratch/fa3/_C.so.xz  # 341 MiB -> 36 MiB (the carry limit is 64 MiB)
rm -rf "$tmp"
ls -la scratch/fa3
