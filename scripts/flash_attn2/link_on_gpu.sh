#!/bin/bash
# On the GPU machine: link the FA2 test build (kernels compiled on the CPU machine with nvcc 13.0
# for sm_90, see scripts/flash_attn2/compile_kernels.sh) with its flash_api compiled here, into /tmp/site.
set -e
mkdir -p /tmp/fa2 && tar xzf scratch/fa2.tgz -C /tmp/fa2
cd /tmp/fa2
PYINC=$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])")
TORCH=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
SUFFIX=$(python3 -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
ABI=$(python3 -c "import torch;print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
CUDA=${CUDA_HOME:-/usr/local/cuda}
echo "abi=$ABI suffix=$SUFFIX pyinc=$PYINC cuda=$CUDA"
time g++ -O2 -std=c++17 -fPIC -shared -D_GLIBCXX_USE_CXX11_ABI=$ABI -DTORCH_EXTENSION_NAME=flash_attn_2_cuda \
  -DTORCH_API_INCLUDE_EXTENSION_H -I$PYINC -I$TORCH/include -I$TORCH/include/torch/csrc/api/include -I$CUDA/include \
  -Icsrc/flash_attn -Icsrc/flash_attn/src -Icsrc/cutlass/include csrc/flash_attn/flash_api_trim.cpp obj/*.o \
  -L$TORCH/lib -lc10 -lc10_cuda -ltorch -ltorch_cpu -ltorch_cuda -ltorch_python -L$CUDA/lib64 -lcudart \
  -Wl,-rpath,$TORCH/lib -o /tmp/site/flash_attn_2_cuda$SUFFIX
cp -r flash_attn /tmp/site/
ls -la /tmp/site/flash_attn_2_cuda$SUFFIX
