#!/usr/bin/env bash
# Write the results section of docs/distserve.md and docs/distserve/attainment.png: DistServe's
# simulator result (OPT-13B on A100s, TTFT 200 ms / TPOT 100 ms at P90, 1.56 req/s per GPU with
# prefill TP2 and decode TP1) reproduced in servelab's simulator on the ShareGPT lengths, beside
# a co-located baseline on the same 3 GPUs. Runs are kept in runs/distserve/ (rerunning reuses
# them). About four minutes on 2 cores. Extra arguments go to scripts/distserve.py.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup ""
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/python" scripts/distserve.py "$@"
