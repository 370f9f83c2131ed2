#!/bin/bash
# On the GPU machine, first call (carry .whl/cu13): unpack the CuTe DSL cu13 libraries into
# /tmp/site_cu13; install.sh, in the next call to the same warm machine, merges them into /tmp/site.
set -euo pipefail
dst=/tmp/site_cu13
ir=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
rt=nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
mkdir -p "$dst" && tar xf .whl/cu13/rest.tar -C "$dst"
unxz() { python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'), 1<<24)" "$1" "$2"; }
mkdir -p "$(dirname "$dst/$ir")" "$(dirname "$dst/$rt")"
unxz .whl/cu13/cutlass_ir.so.xz "$dst/$ir"
unxz .whl/cu13/cute_dsl_runtime.so.xz "$dst/$rt"
du -sh "$dst"
