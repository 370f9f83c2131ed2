#!/usr/bin/env bash
# The CPU test suite (GPU tests skip themselves without CUDA). Arguments go to pytest:
#   bash scripts/test.sh                                   # the whole tests/ folder
#   bash scripts/test.sh tests/test_partition.py -x        # just these files or node ids
#   bash scripts/test.sh -k ring -x                        # flags alone: the whole folder, filtered
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# No path here on purpose: given none, pytest takes pyproject.toml's testpaths (tests/); given
# some, it runs just those. Adding "tests" ourselves would run the whole folder besides them.
exec python3 -m pytest -q "$@"
