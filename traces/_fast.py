"""A bulk fast path for clean CSV traces: one regular expression over the whole file.

Real trace files are clean, and per-row Python parsing costs 10-30 µs a row. Here one
anchored, multi-line regex (run in C) checks every line's shape and captures its fields at
once; Python then only converts them in list comprehensions. If anything is off — a line
that does not match, a zero length, an unsorted time, an impossible date — the fast path
returns None and the loader reparses row by row, which finds the exact line and problem.
The two paths therefore agree by construction on every file the fast path accepts.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import re

from servelab.traces._rows import MAX_LENGTH

_AZURE_TIME = r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?"  # whole second, fraction
_DECIMAL = r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,4})?)"
_LENGTH = r"(\d{1,10})"
_OTHER = r"[^,\n\"]*"
_NS = 10**9


def fast_columns(lines: list[str], names: list[str], roles: dict[str, int], azure_time: bool):
    """(times, prompts, outputs) for the data `lines` (header excluded), or None.

    `roles` maps 'prompt', 'output' and optionally 'time' to column positions. Azure times
    come back as integer nanoseconds, others as float seconds; times are non-decreasing.
    """
    by_pos = {i: role for role, i in roles.items()}
    parts = []
    for i in range(len(names)):
        role = by_pos.get(i)
        parts.append(_OTHER if role is None else _LENGTH if role != "time"
                     else _AZURE_TIME if azure_time else _DECIMAL)
    pattern = re.compile("^" + ",".join(parts) + "$", re.MULTILINE | re.ASCII)
    matches = pattern.findall("\n".join(lines))
    if len(matches) != sum(1 for line in lines if line and not line.isspace()):
        return None
    # Group positions within a match tuple, in column order.
    group_of, g = {}, 0
    for i in range(len(names)):
        role = by_pos.get(i)
        if role is not None:
            group_of[role] = g
            g += 2 if (role == "time" and azure_time) else 1
    pg, og = group_of["prompt"], group_of["output"]
    prompts = [int(m[pg]) for m in matches]
    outputs = [int(m[og]) for m in matches]
    if prompts and (min(prompts) < 1 or min(outputs) < 1 or max(prompts) > MAX_LENGTH
                    or max(outputs) > MAX_LENGTH):
        return None
    if "time" not in roles:
        return None, prompts, outputs
    tg = group_of["time"]
    times = _azure_ns(matches, tg) if azure_time else [float(m[tg]) for m in matches]
    if times is None or (times and not azure_time and not math.isfinite(max(times) - min(times))):
        return None
    if any(times[i] > times[i + 1] for i in range(len(times) - 1)):
        return None
    return times, prompts, outputs


_SERVELAB_CELLS = {  # the canonical format's columns; any other column is read as text
    "arrival_s": _DECIMAL, "prompt_tokens": _LENGTH, "output_tokens": _LENGTH,
    "tenant": r"([^,\n\"]*)", "priority": r"(-?\d{1,12})?",
    "slo_ttft_ms": _DECIMAL + "?", "slo_tpot_ms": _DECIMAL + "?",
    "prefix_block_size": "", "prefix_hashes": "",  # empty cells only: hashes go row by row
}


def fast_servelab(lines: list[str], names: list[str]):
    """(times, prompts, outputs, extra fields per row) of a clean file in servelab's own
    format (`traces.canonical`), or None to parse row by row. Accepted cells are those the
    row parser reads without trimming or rounding: plain decimals, digit lengths, integer
    priorities, printable tenants, positive SLOs, no prefix hashes."""
    lowered = [n.lower() for n in names]
    if not {"arrival_s", "prompt_tokens", "output_tokens"} <= set(lowered):
        return None  # the row parser names what is missing
    groups = [name for name in lowered if _SERVELAB_CELLS.get(name, _OTHER) not in ("", _OTHER)]
    pattern = "^" + ",".join(_SERVELAB_CELLS.get(name, _OTHER) for name in lowered) + "$"
    matches = re.compile(pattern, re.MULTILINE | re.ASCII).findall("\n".join(lines))
    if len(matches) != sum(1 for line in lines if line and not line.isspace()):
        return None
    col = {name: [m[g] for m in matches] for g, name in enumerate(groups)}
    prompts = list(map(int, col["prompt_tokens"]))
    outputs = list(map(int, col["output_tokens"]))
    times = list(map(float, col["arrival_s"]))
    if prompts and (min(prompts) < 1 or min(outputs) < 1 or max(prompts) > MAX_LENGTH
                    or max(outputs) > MAX_LENGTH or not min(times) >= 0
                    or not math.isfinite(max(times))):
        return None
    if any(times[i] > times[i + 1] for i in range(len(times) - 1)):
        return None
    n = len(matches)
    tenants = [t or "default" for t in col["tenant"]] if "tenant" in col else ["default"] * n
    if not all(map(str.isprintable, tenants)):
        return None
    priorities = [int(p) if p else 0 for p in col["priority"]] if "priority" in col else [0] * n
    slos = []
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        values = [float(v) if v else None for v in col[name]] if name in col else [None] * n
        present = [v for v in values if v is not None]
        if present and not (min(present) > 0 and math.isfinite(max(present))):
            return None
        slos.append(values)
    extras = [(None, None, t, p, a, b) for t, p, a, b in zip(tenants, priorities, *slos)]
    return times, prompts, outputs, extras


def _azure_ns(matches: list[tuple], g: int) -> list[int] | None:
    """Integer ns since 0001-01-01: each distinct whole second is parsed once (an hour-long
    trace has at most 3,600), then only the fraction is converted per row."""
    base = {}
    for stamp in {m[g] for m in matches}:
        hh, mm, ss = int(stamp[11:13]), int(stamp[14:16]), int(stamp[17:19])
        if hh > 23 or mm > 59 or ss > 59:
            return None
        try:
            day = _dt.date.fromisoformat(stamp[:10]).toordinal()
        except ValueError:
            return None
        base[stamp] = (day * 86400 + hh * 3600 + mm * 60 + ss) * _NS
    scale = [10 ** (9 - k) for k in range(10)]
    f = g + 1
    return [base[m[g]] + (int(m[f]) * scale[len(m[f])] if m[f] else 0) for m in matches]


_MOONCAKE_LINE = re.compile(r'^\{"timestamp": (\d{1,15}), "input_length": (\d{1,10}), "output_length": (\d{1,10}), '
                            r'"hash_ids": \[(\d{1,18}(?:, \d{1,18})*)\]\}$', re.MULTILINE | re.ASCII)


def fast_mooncake(lines: list[str]):
    """(times ms, prompts, outputs, hash tuples) when every line has exactly the released
    files' layout (the key order and spacing of `json.dumps`), else None. The pattern
    accepts only JSON that `json.loads` reads the same way, so results are identical."""
    matches = _MOONCAKE_LINE.findall("\n".join(lines))
    if len(matches) != sum(1 for line in lines if line and not line.isspace()):
        return None
    times = [int(m[0]) for m in matches]
    prompts = [int(m[1]) for m in matches]
    outputs = [int(m[2]) for m in matches]
    if prompts and (min(prompts) < 1 or min(outputs) < 1 or max(prompts) > MAX_LENGTH
                    or max(outputs) > MAX_LENGTH):
        return None
    if any(times[i] > times[i + 1] for i in range(len(times) - 1)):
        return None
    # The pattern admits only digits and ", " in a list, so one json.loads of all lists is safe.
    hashes = json.loads("[[" + "],[".join(m[3] for m in matches) + "]]") if matches else []
    return times, prompts, outputs, [tuple(h) for h in hashes]
