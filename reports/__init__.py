"""Metrics, run-directory files and plots computed offline from run records.

The run-directory files (requests and steps as CSV or Parquet, JSON documents) are read and
written by `servelab.reports.runio`, imported on its own: it loads pyarrow.
"""
from __future__ import annotations

from servelab.reports.columns import REQUEST_STATUSES
from servelab.reports.metrics import (
    LATENCY_METRICS,
    PERCENTILES,
    SUMMARY_KEYS,
    TENANT_KEYS,
    summarize,
)

__all__ = [
    "LATENCY_METRICS", "PERCENTILES", "REQUEST_STATUSES", "SUMMARY_KEYS", "TENANT_KEYS",
    "summarize",
]
