"""How a sweep axis value is shown to people (progress lines, report headings, file names)."""
from __future__ import annotations

from typing import Any


def show_value(value: Any, axis: str | None = None) -> str:
    """None is "as traced" on the rate axis (no --rates: the trace's own arrivals, or those
    --rate-scale made) and "off" elsewhere (no chunked prefill, no starvation guard);
    floats print without trailing zeros."""
    if value is None:
        return "as traced" if axis == "rate" else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)
