"""Small validators for config dataclasses: each error names the field and the allowed range.

`within` and `bounds_text` are the one range check and its wording: the config checks
below and the command line's number parser (`servelab.options.number`) both use them.
"""
from __future__ import annotations

import math


def check_int(owner: str, name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an integer, got {value!r}")
    _check_range(owner, name, value, lo, hi)


def check_float(owner: str, name: str, value, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, note: str = "") -> None:
    """A number, not NaN (inf passes unless a bound excludes it), in the range; `note`
    follows the range in parentheses ("must be > 0 (inf: no limit), got 0")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    if lo_open and lo is not None and not within(value, lo, lo_open=True):
        raise ValueError(f"{owner}.{name} must be {bounds_text(lo, lo_open=True)}"
                         f"{_note(note)}, got {value!r}")
    _check_range(owner, name, value, None if lo_open else lo, hi, note)


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


def within(value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False) -> bool:
    """Whether `value` lies in the range: `lo` <= value (< with `lo_open`), value <= `hi`
    (< with `hi_open`); a missing bound does not limit. NaN lies in no bounded range."""
    if lo is not None and not (value > lo if lo_open else value >= lo):
        return False
    return hi is None or (value < hi if hi_open else value <= hi)


def bounds_text(lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False) -> str:
    """The range as a message states it: 'in [0, 1]', 'in (0, 1)', '>= 1', '> 0', '<= 8',
    or '' when unbounded."""
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi}"
    return ""


def _check_range(owner, name, value, lo, hi, note: str = "") -> None:
    if not within(value, lo, hi):
        raise ValueError(f"{owner}.{name} must be {bounds_text(lo, hi)}{_note(note)}, got {value!r}")


def _note(note: str) -> str:
    return f" ({note})" if note else ""


def check_bounded(what: str, value, lo=None, hi=None, *, lo_open: bool = False,
                  hi_open: bool = False, integer: bool = False, noun: str | None = None,
                  error: type[ValueError] = ValueError) -> None:
    """Raise `error` ("<what> must be a finite number > 0, got 'x'"; with `integer`, "<what>
    must be an int >= 0, got ...") unless `value` is a finite number (an int with `integer`;
    never a bool) in the range `within` checks. For checks whose owner is not a config
    field, e.g. a trace transform's argument, which raise their module's own `error`;
    `noun` replaces 'an int' / 'a finite number' where a module words it otherwise."""
    if integer:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not within(value, lo, hi, lo_open=lo_open, hi_open=hi_open):
        noun = noun or ("an int" if integer else "a finite number")
        bounds = bounds_text(lo, hi, lo_open=lo_open, hi_open=hi_open)
        raise error(f"{what} must be {noun}{' ' + bounds if bounds else ''}, got {value!r}")
