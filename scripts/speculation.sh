#!/usr/bin/env bash
# Write docs/speculative.md and docs/speculative/speedup.png: speculative decoding's TPOT
# speedup against load and acceptance, and capacity with and without it, for Llama-3.1-70B
# on 4 x H100 with a Llama-3.1-8B draft. Runs are kept in runs/speculation/ (rerunning
# reuses them). A few minutes on 2 cores. Extra arguments go to scripts/speculation.py.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup ""
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/python" scripts/speculation.py "$@"
