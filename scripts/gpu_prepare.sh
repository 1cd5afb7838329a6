#!/usr/bin/env bash
# Prepare, here (with network to PyPI and ../shared beside the checkout), everything the
# GPU machine needs and lacks, in .gpu/ (git-ignored; name it in the device call's carry):
#   .gpu/wheels/   simpy, the one runtime dependency the device image does not ship
#                  (pure Python; its image has torch, triton, transformers, scipy, pyarrow,
#                  matplotlib, tqdm, numpy, pytest, hypothesis)
#   .gpu/traces/   the azure-conv-2023 slice the checks replay (../shared does not travel)
#   .gpu/commit    the commit the tree came from (the device copy has no .git)
# Then: scripts/gpu_check.sh on the device (docs/validation.md has the exact call).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
SIMPY_VERSION="${SIMPY_VERSION:-4.1.2}"
mkdir -p .gpu/wheels .gpu/traces
rm -f .gpu/wheels/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation py --platform any -d .gpu/wheels "simpy==$SIMPY_VERSION"
"$PY" scripts/gpu_check.py slice --trace-dir "${SERVELAB_SHARED:-$ROOT/../shared}/traces" \
    --out .gpu/traces/azure-conv-2023-slice.csv
{ git rev-parse HEAD; git status --porcelain | grep -q . && echo "(with uncommitted changes)"; } \
    > .gpu/commit || true
echo "prepared .gpu: $(ls .gpu/wheels | tr '\n' ' ')$(du -sh .gpu | cut -f1) in all"
