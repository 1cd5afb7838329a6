#!/usr/bin/env bash
# Write docs/policies.md and docs/policies/attainment.png: fcfs, priority, edf, mlfq and
# edf with shedding on the embedded default workload (llama-3.1-8b on one H100, the main
# job's SLOs), their capacities and what each buys and costs per tenant. Runs are kept in
# runs/policies/ (rerunning reuses them). About a minute on 2 cores. Extra arguments go to
# scripts/policy_capacity.py (--num-requests N, --out DIR, --doc FILE).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup ""
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/python" scripts/policy_capacity.py "$@"
