"""How a sweep axis value is shown to people (progress lines, report headings, file names)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def show_value(value: Any, axis: str | None = None) -> str:
    """None is "as traced" on the rate axis (no --rates: the trace's own arrivals, or those
    --rate-scale made) and "off" elsewhere (no chunked prefill, no starvation guard);
    floats print without trailing zeros."""
    if value is None:
        return "as traced" if axis == "rate" else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


COLOCATED = "co-located"
"""The "pools" label of a co-located layout in a plan that also has disaggregated ones."""


def is_disaggregated(labels: Mapping[str, Any]) -> bool:
    """Whether a plan layout's labels name a disaggregated pool shape (e.g. "1P+3D")."""
    return labels.get("pools", COLOCATED) != COLOCATED


def count_words(labels: Mapping[str, Any], count: int) -> str:
    """"3 replicas", or "3 pool units" for a disaggregated layout (labels name its
    "pools", e.g. "1P+3D": a unit is that many prefill and decode replicas)."""
    noun = "pool unit" if is_disaggregated(labels) else "replica"
    return f"{count} {noun}{'s' if count != 1 else ''}"
