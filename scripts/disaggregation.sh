#!/usr/bin/env bash
# Write the results section of docs/disaggregation.md and docs/disaggregation/latency.png:
# co-located against disaggregated prefill/decode at one GPU count (4 x H100, Llama-3.1-8B)
# on a prefill-heavy trace, p90 TTFT and p99 TPOT against the rate; the KV link; decode-heavy
# traffic. Runs are kept in runs/disaggregation/ (rerunning reuses them). A few minutes on
# 2 cores. Extra arguments go to scripts/disaggregation.py.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup ""
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/python" scripts/disaggregation.py "$@"
