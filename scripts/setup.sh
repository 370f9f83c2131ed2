#!/usr/bin/env bash
# Installs usp_dit and what its demo and tests need. Idempotent: quick when already installed.
# torch is installed first at the CPU build this project is tested with, so that the loose
# "torch>=2.6" requirement is already met and pip does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Presence is checked with importlib.util.find_spec, not by importing: importing torch, Diffusers,
# transformers and PEFT costs ~10 s of CPU, paid by every scripts/test.sh and scripts/main.sh call.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
# Checked from / so that this folder's own usp_dit/ does not count as installed.
here=$PWD
installed=$(cd / && "$PY" -c "
import importlib.util, os
names = 'usp_dit diffusers transformers accelerate numpy safetensors peft pytest PIL tqdm torchao gguf fastapi uvicorn prometheus_client openai imageio imageio_ffmpeg'.split()
specs = [importlib.util.find_spec(name) for name in names]
if all(specs):
    print(os.path.dirname(os.path.dirname(specs[0].origin)))
" 2>/dev/null || true)
if [ "$installed" != "$here" ]; then
  "$PY" -m pip install -q -e ".[test]"
fi
