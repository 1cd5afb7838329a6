"""Request traces in: one canonical record, loaders for the public formats, named datasets,
synthetic workloads, transformations and statistics.

    from servelab.traces import resolve_trace, with_rate
    trace = resolve_trace("azure-conv-2023", trace_dir="~/traces")   # or a path, or "default"
    requests = with_rate(trace, 8.0).to_requests(seed=0)

Names are imported lazily (PEP 562), so `import servelab.traces.cli` stays cheap and numpy
is loaded only by what needs it.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "record": ("TraceRecord", "Trace", "RowIssue", "TraceError", "TraceFormatError"),
    "requests": ("TraceRequests",),
    "loaders": ("load_trace", "detect_format"),
    "formats": ("TraceFormat", "TRACE_FORMATS", "register_trace_format", "trace_format_names"),
    "canonical": ("write_csv", "to_csv_text"),
    "datasets": ("DATASETS", "Dataset", "DatasetUnavailableError", "dataset_path", "resolve_trace",
                 "DEFAULT_TRACE_DIR"),
    "distributions": ("ArrivalProcess", "Fixed", "Uniform", "LogNormal", "Empirical", "Quantiles"),
    "synthetic": ("SharedPrefix", "TenantSpec", "WorkloadSpec", "generate", "default_workload",
                  "load_default_spec"),
    "transforms": ("scale_rate", "with_rate", "time_window", "first_n", "clip_lengths", "Assignment",
                   "assign_by_length", "assign_round_robin", "assign_random", "merge"),
    "stats": ("TraceStats", "trace_stats", "format_stats", "prefix_hit_ratio"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
