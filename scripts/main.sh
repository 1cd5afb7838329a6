#!/usr/bin/env bash
# Set up .venv (simulator dependencies only) and run the main job: a policy comparison
# on the embedded default workload (two tenants with priorities, SLOs and a shared system
# prompt) — FCFS, priority, SJF and fair share on Llama-3.1-8B on one H100 at three loads:
# 12 req/s (comfortable), 15.2 req/s (the workload's own rate: busy but stable) and
# 16 req/s (past the knee: FCFS, SJF and fair share break their SLOs, priority holds).
# The global SLOs are the batch tier's (TTFT 10 s, TPOT 200 ms); requests carry their own,
# tighter ones for the interactive tenant, and goodput uses those first.
# Prints where the report is. Extra arguments go to `servelab compare` and override these
# (e.g. --rates 10,14,18, --workers 4, --ray).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
servelab_setup ""
export MPLBACKEND="${MPLBACKEND:-Agg}"
exec "$VENV/bin/servelab" compare --trace default --model llama-3.1-8b --gpu h100-sxm \
    --policies fcfs,priority,sjf,fair --rates 12,15.2,16 --num-requests 2000 \
    --slo-ttft-ms 10000 --slo-tpot-ms 200 --out "${SERVELAB_OUT:-runs/main}" "$@"
