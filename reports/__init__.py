"""Metrics, run-directory files and (later) plots computed offline from run records."""
from __future__ import annotations

from servelab.reports.columns import REQUEST_STATUSES
from servelab.reports.metrics import (
    LATENCY_METRICS,
    PERCENTILES,
    SUMMARY_KEYS,
    TENANT_KEYS,
    summarize,
)
from servelab.reports.runio import (
    REQUEST_COLUMNS,
    REQUEST_EXTRA_COLUMNS,
    STEP_COLUMNS,
    read_json,
    read_requests_csv,
    read_steps_csv,
    write_json,
    write_requests_csv,
    write_steps_csv,
)

__all__ = [
    "LATENCY_METRICS", "PERCENTILES", "REQUEST_STATUSES", "SUMMARY_KEYS", "TENANT_KEYS",
    "summarize",
    "REQUEST_COLUMNS", "REQUEST_EXTRA_COLUMNS", "STEP_COLUMNS",
    "read_json", "read_requests_csv", "read_steps_csv",
    "write_json", "write_requests_csv", "write_steps_csv",
]
