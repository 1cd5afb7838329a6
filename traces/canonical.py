"""servelab's own trace CSV: the canonical form every other format converts to.

    arrival_s,prompt_tokens,output_tokens[,tenant,priority][,slo_ttft_ms,slo_tpot_ms][,prefix_block_size,prefix_hashes]

Optional column groups are written only when some record needs them, so a plain trace
stays a three-column file. Times are written with `repr`, the shortest text that reads
back to the same float, so write -> load is exact; prefix hashes are space-separated
integers; an empty SLO or prefix cell means none. `load_trace` reads the file back
(format 'servelab'), times kept verbatim.
"""
from __future__ import annotations

import csv
import io
import os

from servelab.traces.record import Trace

BASE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
TENANT_COLUMNS = ("tenant", "priority")
SLO_COLUMNS = ("slo_ttft_ms", "slo_tpot_ms")
PREFIX_COLUMNS = ("prefix_block_size", "prefix_hashes")


def _cell(v) -> str:
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


def columns_for(trace: Trace) -> tuple[str, ...]:
    """The columns `trace` needs: the base three plus each optional group some record uses."""
    recs = trace.records
    cols = BASE_COLUMNS
    if any(r.tenant != "default" or r.priority != 0 for r in recs):
        cols += TENANT_COLUMNS
    if any(r.slo_ttft_ms is not None or r.slo_tpot_ms is not None for r in recs):
        cols += SLO_COLUMNS
    if any(r.prefix_hashes is not None for r in recs):
        cols += PREFIX_COLUMNS
    return cols


def to_csv_text(trace: Trace) -> str:
    cols = columns_for(trace)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(cols)
    for r in trace.records:
        row = [repr(float(r.arrival_s)), r.prompt_tokens, r.output_tokens]
        if "tenant" in cols:
            row += [r.tenant, r.priority]
        if "slo_ttft_ms" in cols:
            row += [_cell(r.slo_ttft_ms), _cell(r.slo_tpot_ms)]
        if "prefix_hashes" in cols:
            row += [_cell(r.prefix_block_size),
                    "" if r.prefix_hashes is None else " ".join(map(str, r.prefix_hashes))]
        writer.writerow(row)
    return buf.getvalue()


def write_csv(trace: Trace, path: str | os.PathLike) -> None:
    """Write `trace` as canonical CSV (LF line endings, UTF-8)."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(to_csv_text(trace))
