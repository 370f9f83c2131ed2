#!/bin/bash
# On the GPU machine, second call (carry .whl/kernels, scratch/fa3 and, if built, scratch/fa2.tgz):
# install the wheels, the cu13 libraries from the first call, FlashAttention 3 and 2 into /tmp/site. Then
# `source scripts/gpu_backends/env.sh` puts them on PYTHONPATH.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/kernels/*.whl
python3 -c "import lzma,sys,tarfile; tarfile.open(fileobj=lzma.open(sys.argv[1])).extractall(sys.argv[2])" \
  .whl/kernels/pure.tar.xz /tmp/site
[ -d /tmp/site_cu13 ] && cp -r /tmp/site_cu13/. /tmp/site/ || echo "no /tmp/site_cu13: FlashAttention 4 will not import"
SITE=/tmp/site bash scripts/flash_attn3/install_on_gpu.sh
[ -f scratch/fa2.tgz ] && bash scripts/flash_attn2/link_on_gpu.sh > /tmp/fa2_link.log 2>&1 && echo "flash_attn_2 linked" || true
