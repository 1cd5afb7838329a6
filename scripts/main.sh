#!/usr/bin/env bash
# Set up .venv (simulator dependencies only) and run the main job: a policy comparison
# on the embedded default workload. Extra arguments go to `servelab compare`.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup "test"
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/servelab" compare --trace default --out "${SERVELAB_OUT:-runs/main}" "$@"
