#!/usr/bin/env bash
# Write docs/plan.md and docs/plan/frontier.png: `servelab plan` on the public Azure code
# trace (2023) at 4x its rate, Llama-3.1-8B, p99 TTFT at most 2 s, every priced catalog GPU
# at TP 1, 2, 4 and 8, fcfs with round-robin routing. Runs are kept in runs/plan-azure/
# (rerunning reuses them). A few minutes on 2 cores. Extra arguments go to `servelab plan`.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup ""
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/python" scripts/plan_example.py "$@"
