#!/usr/bin/env bash
# Set up .venv (simulator dependencies only) and run the main job: how much traffic each
# scheduling policy serves within its SLOs. On the embedded default workload (two tenants
# with priorities, their own SLOs and a shared system prompt) with Llama-3.1-8B on one
# H100, `servelab capacity` finds for FCFS, priority, SJF and fair share the highest
# request rate at which 90% of the requests meet their SLOs (to within 2%), then runs every
# policy at every capacity found. The report opens with the answer. The search starts from
# a ladder of rates every policy runs (16, 20, 24 req/s: around where the capacities lie,
# so that few probes are needed; any other start finds the same, with more probes).
# Each run replays 4,000 requests (about 160 s of arrivals): long enough for the queue to
# settle at most capacities; the report says where it did not, and how the answer moves
# with the run's length. The global SLOs are the batch tier's (TTFT 10 s, TPOT 200 ms);
# requests carry their own, tighter ones for the interactive tenant, which come first.
# Prints where the report is. Extra arguments go to `servelab capacity` and override these
# (e.g. --num-requests 8000, --tolerance 0.01, --workers 4, --ray).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup ""
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/servelab" capacity --trace default --model llama-3.1-8b --gpu h100-sxm \
    --policies fcfs,priority,sjf,fair --rates 16,20,24 --num-requests 4000 \
    --slo-ttft-ms 10000 --slo-tpot-ms 200 --out "${SERVELAB_OUT:-runs/main}" "$@"
