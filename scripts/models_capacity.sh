#!/usr/bin/env bash
# Write the "Serving capacity (simulated)" section of docs/models.md: for Qwen3-30B-A3B
# (TP1, two TP1 replicas, TP2, EP2) and Llama-3.1-70B (FP8 on one H100, BF16 and FP8 on two)
# on H100, and DeepSeek-V3 (FP8, TP8 and EP8) on 8 x H200, the highest rate of a grid that
# meets p99 TTFT <= 2 s, p99 TPOT <= 100 ms with nothing rejected. Runs are kept in
# runs/models-capacity/ (rerunning reuses them). Several minutes on 2 cores. Extra arguments
# go to scripts/models_capacity.py (--num-requests N, --workers N, --out DIR, --doc FILE).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup ""
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/python" scripts/models_capacity.py "$@"
