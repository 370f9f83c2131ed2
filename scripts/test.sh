#!/usr/bin/env bash
# The whole CPU test suite (GPU tests skip themselves without CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest tests -q "$@"
