#!/bin/bash
# On the CPU machine: gather every optional attention kernel for the lent H200 (torch 2.11, CUDA 13,
# Python 3.12, no internet) into two carries of at most 64 MiB each, for one warm machine:
#   .whl/cu13/     nvidia-cutlass-dsl-libs-cu13 4.8.1 (FlashAttention 4's CuTe DSL runtime): its wheel
#                  is 92 MB, so its two big libraries travel xz-compressed (193+44 MB -> 50+13 MB)
#                  and the rest as a tar; first call: scripts/gpu_backends/install_cu13.sh
#   .whl/kernels/  the other packages (flash-attn-4, the CuTe DSL base, quack, FlashInfer, TVM FFI,
#                  SageAttention, diffusers) and, with scratch/fa3 from scripts/flash_attn3/prepare.sh,
#                  FlashAttention 3; second call: scripts/gpu_backends/install.sh
# FlashAttention 2: scripts/flash_attn2/compile_kernels.sh builds scratch/fa2.tgz (8.7 MB), which fits
# in the second carry (link it there with scripts/flash_attn2/link_on_gpu.sh after install.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl/cu13 .whl/kernels
get() {  # wheels for the H200's CPython 3.12, x86_64
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$@"
}
# Compiled wheels travel as wheels; the pure-Python ones are unpacked into one tar.xz (FlashInfer's
# wheel is mostly CUDA sources for its JIT: 18 MB zipped, 7.6 MB as xz), with diffusers, which
# usp_dit imports and that machine lacks. Since 4.6 the DSL's Python (``cutlass.cute``) is in
# nvidia-cutlass-dsl-libs-core, which libs-base requires: without it FA4 fails on `import cutlass.cute`.
get .whl/kernels nvidia-cutlass-dsl-libs-base==4.8.1 torch-c-dlpack-ext==0.1.5 apache-tvm-ffi==0.1.15.post2
if [ ! -f .whl/kernels/pure.tar.xz ]; then
  tmp=$(mktemp -d)
  get "$tmp" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 quack-kernels==0.6.5 flashinfer-python==0.6.18.post1 \
    sageattention==1.0.6 diffusers==0.42.1 importlib-metadata==10.2.0
  for w in "$tmp"/*.whl; do unzip -q -o "$w" -d "$tmp/x"; done
  tar cf - -C "$tmp/x" . | xz -9 -T2 > .whl/kernels/pure.tar.xz
  rm -rf "$tmp"
fi
if [ ! -f .whl/cu13/rest.tar ]; then
  tmp=$(mktemp -d)
  get "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
  unzip -q "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl -d "$tmp/x"
  ir=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
  rt=nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
  xz -9 -T2 -c "$tmp/x/$ir" > .whl/cu13/cutlass_ir.so.xz
  xz -9 -T2 -c "$tmp/x/$rt" > .whl/cu13/cute_dsl_runtime.so.xz
  rm "$tmp/x/$ir" "$tmp/x/$rt"
  rm -rf "$tmp/x/nvidia_cutlass_dsl/cu13/lib/stubs"  # aarch64 and QNX stubs
  tar cf .whl/cu13/rest.tar -C "$tmp/x" .
  rm -rf "$tmp"
fi
[ -f scratch/fa3/_C.so.xz ] || bash scripts/flash_attn3/prepare.sh
du -cb .whl/cu13/* | tail -1
du -cb .whl/kernels/* scratch/fa3/* | tail -1
