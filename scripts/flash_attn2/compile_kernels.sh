#!/bin/bash
# A trimmed FlashAttention 2 build for testing the flash_attn_2 adapter on the lent H200, which has
# torch 2.11.0+cu130 and Python 3.12 but no flash-attn wheel and no internet (docs/PERFORMANCE.md, "FlashAttention 2, FlashInfer").
#
# Step 1 (this script, on a CPU machine with CUDA 13.0's nvcc at /usr/local/cuda-13.0): compile
# flash-attn 2.8.3.post2's kernels for sm_90 only, head dims 64 and 128, fp16/bf16, non-causal,
# forward and backward (8 files, about 16 minutes on 2 cores), against torch 2.11.0+cu130's headers;
# trim flash_api.cpp to dispatch only those (scripts/flash_attn2/trim_api.py); pack it all into
# scratch/fa2.tgz.
# Step 2 (scripts/flash_attn2/link_on_gpu.sh, on the GPU machine): compile flash_api.cpp against
# that machine's Python and link the module into /tmp/site.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-/tmp/fa2work}
NVCC=${NVCC:-/usr/local/cuda-13.0/bin/nvcc}
mkdir -p "$WORK/obj" && cd "$WORK"
# SKIP_CUDA_BUILD: its setup.py otherwise wants CUDA_HOME just to report metadata
[ -d flash_attn-2.8.3.post2 ] || { FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download -q --no-deps --no-binary :all: \
                                     --no-build-isolation flash-attn==2.8.3.post2 -d .; tar xzf flash_attn-2.8.3.post2.tar.gz; }
[ -d torch211 ] || { pip download -q --no-deps -d . --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 torch==2.11.0;
                     unzip -q torch-2.11.0-*.whl 'torch/include/*' -d torch211; }
T=$WORK/torch211/torch/include
SRC=$WORK/flash_attn-2.8.3.post2
python3 "$ROOT/scripts/flash_attn2/trim_api.py" "$SRC/csrc/flash_attn/flash_api.cpp" "$SRC/csrc/flash_attn/flash_api_trim.cpp"
compile() {  # one kernel file -> obj/NAME.o
  "$NVCC" -c "$SRC/csrc/flash_attn/src/$1.cu" -o "obj/$1.o" -O3 -std=c++17 -U__CUDA_NO_HALF_OPERATORS__ \
    -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ \
    --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math -gencode arch=compute_90,code=sm_90 \
    -Xcompiler -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 -I "$SRC/csrc/flash_attn" -I "$SRC/csrc/flash_attn/src" \
    -I "$SRC/csrc/cutlass/include" -I "$T" -I "$T/torch/csrc/api/include"
}
export -f compile; export NVCC SRC T
for dir in fwd bwd; do for d in 64 128; do for t in bf16 fp16; do echo "flash_${dir}_hdim${d}_${t}_sm80"; done; done; done \
  | xargs -P "$(nproc)" -I{} bash -c '[ -f obj/{}.o ] || compile {}'
tar czf "$ROOT/scratch/fa2.tgz" obj -C "$SRC" csrc/flash_attn/flash_api_trim.cpp csrc/flash_attn/src csrc/cutlass/include flash_attn/__init__.py flash_attn/flash_attn_interface.py
ls -la "$ROOT/scratch/fa2.tgz"
