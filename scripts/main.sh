#!/usr/bin/env bash
# The main job: a tiny random FluxPipeline (built in code, nothing downloaded) generates a 1008x1008
# image through its real __call__ on a 2x2 Ulysses x Ring grid of 4 CPU ranks (torchrun, gloo), writes
# out/flux_usp.png and prints its match against the same pipeline on one rank. Extra arguments go to
# examples/generate_image.py (e.g. --ulysses 4 --ring 1, --height 512 --width 768, --steps 8).
# The attention-only demo: python3 -m torch.distributed.run --standalone --nproc-per-node 4 examples/usp_attention_demo.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
NPROC=${NPROC:-4}
mkdir -p out
exec python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" examples/generate_image.py \
  --output out/flux_usp.png "$@"
