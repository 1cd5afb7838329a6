"""Small validators for config dataclasses: each error names the field and the allowed range."""
from __future__ import annotations

import math


def check_int(owner: str, name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an integer, got {value!r}")
    _check_range(owner, name, value, lo, hi)


def check_float(owner: str, name: str, value, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    if lo_open and lo is not None and not value > lo:
        raise ValueError(f"{owner}.{name} must be > {lo}, got {value!r}")
    _check_range(owner, name, value, None if lo_open else lo, hi)


def check_choice(owner: str, name: str, value, choices) -> None:
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}.{name} must be one of {allowed}, got {value!r}")


def check_name(owner: str, name: str, value) -> None:
    """A registry name: a non-empty string (which names exist, the registry checks)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}.{name} must be a non-empty name, got {value!r}")


def check_known_keys(data: dict, known, what: str) -> None:
    """Reject keys of `data` outside `known`: "<what> a, b; known: ..."."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{what} {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def _check_range(owner, name, value, lo, hi) -> None:
    if lo is not None and value < lo:
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{owner}.{name} must be {bound}, got {value!r}")
    if hi is not None and value > hi:
        bound = f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise ValueError(f"{owner}.{name} must be {bound}, got {value!r}")
