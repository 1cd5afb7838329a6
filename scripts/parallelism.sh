#!/usr/bin/env bash
# Write docs/parallelism.md and docs/parallelism/capacity.png: capacity of DeepSeek-V3 (FP8)
# on 8 x H200 (TP8) against 16 x H100 (TP8 x PP2), and of Llama-3.1-70B on H100 in FP8 on one
# GPU against BF16 on two (TP2, or TP1 x PP2). Runs are kept in runs/parallelism/ (rerunning
# reuses them). A few minutes on 2 cores. Extra arguments go to scripts/parallelism.py.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup ""
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/python" scripts/parallelism.py "$@"
