#!/usr/bin/env bash
# The main job: parallel attention on a Ulysses x Ring grid of CPU ranks (torchrun, gloo),
# printing its match against one rank. Extra arguments go to the example script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
NPROC=${NPROC:-4}
exec python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" examples/usp_attention_demo.py "$@"
