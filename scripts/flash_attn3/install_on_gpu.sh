#!/bin/bash
# On the GPU machine: install the FA3 test build from scratch/fa3 (see prepare.sh) as the package
# flash_attn_3 under /tmp/site (put /tmp/site on PYTHONPATH). Its __init__ loads libcudart.so.12
# before flash_attn_3._C, whose import registers torch.ops.flash_attn_3.
set -euo pipefail
site=${SITE:-/tmp/site}
pkg=$site/flash_attn_3
mkdir -p "$pkg"
cp scratch/fa3/libcudart.so.12 "$pkg/"
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open('scratch/fa3/_C.so.xz'), open(sys.argv[1],'wb'), 1<<24)" "$pkg/_C.so"
cat > "$pkg/__init__.py" <<'PY'
# Test build (scripts/flash_attn3): the CUDA 12 runtime the carried _C.so needs, loaded first.
import ctypes
import os

import torch  # noqa: F401  (torch's own libraries first)

ctypes.CDLL(os.path.join(os.path.dirname(__file__), "libcudart.so.12"), mode=ctypes.RTLD_GLOBAL)
PY
python3 -c "import sys; sys.path.insert(0, '$site'); import flash_attn_3._C, torch; print('flash_attn_3 ops:', torch.ops.flash_attn_3.fwd.default._schema.name)"
