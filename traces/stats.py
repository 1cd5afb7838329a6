"""Summary statistics of a trace and their text rendering for `servelab trace stats`.

Percentiles interpolate linearly between closest ranks (numpy's default), the convention
of the shared traces README, so the figures can be checked against it directly.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from servelab.traces.record import RowIssue, Trace


@dataclass(frozen=True)
class Summary:
    min: float
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values) -> "Summary | None":
        a = np.asarray(values, dtype=np.float64)
        if a.size == 0:
            return None
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(a.min()), float(a.mean()), float(p50), float(p90), float(p99), float(a.max()))


@dataclass(frozen=True)
class TraceStats:
    source: str
    format: str
    num_requests: int
    source_rows: int | None
    span_s: float
    mean_rate: float | None
    """rows / (last - first arrival), as the shared README defines it."""
    interarrival: Summary | None
    interarrival_cv: float | None
    prompt: Summary | None
    output: Summary | None
    tenants: tuple[tuple[str, int, tuple[int, ...]], ...]
    """(tenant, requests, priorities seen), most requests first."""
    with_prefix_hashes: int
    prefix_hit_ratio: float | None
    """Share of prompt tokens an unbounded prefix cache would hit (leading run of
    already-seen block ids, times the block size, capped at the prompt length)."""
    dropped: tuple[RowIssue, ...]
    clipped: tuple[RowIssue, ...]
    clipped_requests: int
    """Requests clipped, each once (`clipped` counts per reason)."""
    notes: tuple[str, ...]
    histogram: tuple[tuple[float, float, int], ...]
    """Inter-arrival gap histogram: (low s, high s, count); a (0, 0, n) row counts equal times."""


def prefix_hit_ratio(trace: Trace) -> float | None:
    """Infinite-cache prefix hit ratio over requests with hashes (None if none have any)."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace.records:
        if r.prefix_hashes is None:
            continue
        run = 0
        for h in r.prefix_hashes:
            if h not in seen:
                break
            run += 1
        hit += min(run * r.prefix_block_size, r.prompt_tokens)
        total += r.prompt_tokens
        seen.update(r.prefix_hashes)
    return hit / total if total else None


def lru_prefix_hit_ratio(trace: Trace, capacity_tokens: int,
                         block_size: int | None = None) -> float | None:
    """The prefix hit ratio of an LRU cache of `capacity_tokens` token slots in blocks of
    `block_size` tokens (default: the trace's hashed blocks; a KV block size must divide
    those), None if no request has hashes. What a serving cache of that size can expect
    at most: it also holds running requests' blocks and commits a block only once computed.

    Requests come in arrival order. Each hits the leading run of its blocks the cache
    holds (a block of hashed block h is (h, its offset in h); hits counted in tokens,
    capped at the prompt), then its blocks become the most recently used, its first
    one most of all (a prefix's head is what others share, so it goes last), and the
    least recently used go while more than capacity_tokens // block_size are held.
    O(blocks) with an OrderedDict.
    """
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    hit = total = 0
    for r in trace.records:
        if r.prefix_hashes is None:
            continue
        bs = block_size or r.prefix_block_size
        if r.prefix_block_size % bs:
            raise ValueError(f"block size {bs} does not divide the trace's hashed blocks of "
                             f"{r.prefix_block_size} tokens")
        covered = min(r.prompt_tokens, len(r.prefix_hashes) * r.prefix_block_size)
        per = r.prefix_block_size // bs
        blocks = [(h, j) for h in r.prefix_hashes for j in range(per)][:-(-covered // bs)]
        run = 0
        for b in blocks:
            if b not in cache:
                break
            run += 1
        hit += min(run * bs, r.prompt_tokens)
        total += r.prompt_tokens
        for b in reversed(blocks):
            cache[b] = None
            cache.move_to_end(b)
        limit = capacity_tokens // bs
        while len(cache) > limit:
            cache.popitem(last=False)
    return hit / total if total else None


def format_lru_hit_ratios(trace: Trace, capacities: list[int], block_size: int | None) -> str:
    """Lines of `servelab trace stats --lru-cache-tokens`: the LRU ideal of each size."""
    unit = f"{block_size}-token blocks" if block_size else "the trace's hashed blocks"
    lines = []
    for tokens in capacities:
        ratio = lru_prefix_hit_ratio(trace, tokens, block_size)
        if ratio is None:
            lines.append(f"an LRU prefix cache of {tokens} tokens: no hit ratio, the trace's "
                         "requests carry no prefix hashes")
        else:
            lines.append(f"an LRU prefix cache of {tokens} tokens ({unit}) would hit {ratio:.1%} "
                         "of their prompt tokens")
    return "\n".join(lines)


def trace_stats(trace: Trace, *, bins: int = 10) -> TraceStats:
    recs = trace.records
    times = np.array([r.arrival_s for r in recs], dtype=np.float64)
    gaps = np.diff(times)
    tenants: dict[str, Counter] = {}
    for r in recs:
        tenants.setdefault(r.tenant, Counter())[r.priority] += 1
    tenant_rows = sorted(((name, sum(c.values()), tuple(sorted(c))) for name, c in tenants.items()),
                         key=lambda x: (-x[1], x[0]))
    cv = float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() > 0 else None
    return TraceStats(
        source=trace.source, format=trace.format, num_requests=len(recs), source_rows=trace.source_rows,
        span_s=trace.span_s, mean_rate=trace.mean_rate, interarrival=Summary.of(gaps), interarrival_cv=cv,
        prompt=Summary.of([r.prompt_tokens for r in recs]), output=Summary.of([r.output_tokens for r in recs]),
        tenants=tuple(tenant_rows), with_prefix_hashes=sum(r.prefix_hashes is not None for r in recs),
        prefix_hit_ratio=prefix_hit_ratio(trace), dropped=trace.dropped, clipped=trace.clipped,
        clipped_requests=trace.num_clipped, notes=trace.notes, histogram=gap_histogram(gaps, bins))


def gap_histogram(gaps, bins: int = 10) -> tuple[tuple[float, float, int], ...]:
    """Counts of gaps on `bins` log-spaced bins between the smallest and largest positive gap,
    plus a (0, 0, n) row first for gaps of exactly 0 s (requests logged at the same time)."""
    a = np.asarray(gaps, dtype=np.float64)
    zero, pos = int((a == 0).sum()), a[a > 0]
    rows = [(0.0, 0.0, zero)] if zero else []
    if pos.size:
        lo, hi = float(pos.min()), float(pos.max())
        edges = np.geomspace(lo, hi, bins + 1) if hi > lo else np.array([lo, hi])
        counts, _ = np.histogram(pos, bins=edges)
        rows += [(float(a_), float(b_), int(c)) for a_, b_, c in zip(edges, edges[1:], counts)]
    return tuple(rows)


def render_histogram(rows, width: int = 40) -> list[str]:
    if not rows:
        return ["  (fewer than two requests: no inter-arrival gaps)"]
    for digits in range(3, 10):  # enough significant digits to tell the edges apart
        labels = ["0 s (same time)" if hi == 0 else
                  f"{_fmt_s(lo, digits)} (every gap)" if lo == hi else
                  f"{_fmt_s(lo, digits)} - {_fmt_s(hi, digits)}" for lo, hi, _ in rows]
        if len(set(labels)) == len(labels) and all(
                _fmt_s(lo, digits) != _fmt_s(hi, digits) for lo, hi, _ in rows if hi > lo):
            break
    top = max(c for _, _, c in rows) or 1
    label_w = max(map(len, labels))
    return [f"  {label:>{label_w}} | {'#' * math.ceil(width * c / top):<{width}} {c}"
            for label, (_, _, c) in zip(labels, rows)]


def _fmt_s(x: float, digits: int = 3) -> str:
    if x == 0 or x >= 1:
        return f"{x:.{digits}g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.{digits}g} ms"
    return f"{x * 1e6:.{digits}g} us"


def _summary_row(name: str, s: Summary | None, unit: str = "") -> str:
    if s is None:
        return f"  {name:<14} -"
    f = (lambda v: _fmt_s(v)) if unit == "s" else (lambda v: f"{v:.1f}" if v != int(v) else f"{int(v)}")
    return (f"  {name:<14} min {f(s.min)}  mean {f(s.mean)}  p50 {f(s.p50)}  p90 {f(s.p90)}  "
            f"p99 {f(s.p99)}  max {f(s.max)}")


def format_stats(st: TraceStats, *, lengths_only: bool = False) -> str:
    """The text of `servelab trace stats`. lengths_only: a length-only table loaded without
    --rate, whose arrival times are placeholders: they are left out, and the output says
    how to draw them."""
    lines = [f"trace: {st.source}  (format {st.format})"]
    rows = f" of {st.source_rows} data rows" if st.source_rows is not None else ""
    lines.append(f"requests: {st.num_requests}{rows}")
    if lengths_only:
        lines.append("arrivals: none (a length-only table); they are drawn only when you pass --rate "
                     "REQ_PER_S (a Gamma renewal process: --cv CV, 1 = Poisson; --seed N)")
    else:
        rate = f"{st.mean_rate:.3f} req/s" if st.mean_rate is not None else "-"
        lines.append(f"span: {st.span_s:.3f} s ({st.span_s / 60:.1f} min)   mean rate: {rate}"
                     + (f"   inter-arrival CV: {st.interarrival_cv:.3f}" if st.interarrival_cv is not None else ""))
    lines += ["lengths (tokens):", _summary_row("prompt", st.prompt), _summary_row("output", st.output)]
    if not lengths_only:
        lines += ["inter-arrival:", _summary_row("gap", st.interarrival, "s"), *render_histogram(st.histogram)]
    if len(st.tenants) > 1 or (st.tenants and st.tenants[0][0] != "default") or any(
            p != (0,) for _, _, p in st.tenants):
        lines.append("tenants:")
        lines += [f"  {name}: {n} requests, priority {', '.join(map(str, prios))}" for name, n, prios in st.tenants]
    if st.with_prefix_hashes:
        hit = f"{st.prefix_hit_ratio:.1%}" if st.prefix_hit_ratio is not None else "-"
        lines.append(f"prefix hashes: {st.with_prefix_hashes} requests; an unbounded prefix cache "
                     f"would hit {hit} of their prompt tokens")
    for title, issues, total in (("dropped rows", st.dropped, sum(i.count for i in st.dropped)),
                                 ("clipped requests", st.clipped, st.clipped_requests)):
        lines.append(f"{title}: {total}")
        lines += [f"  {i.count} x {i.reason} (first: {i.example})" for i in issues]
    notes = [n for n in st.notes if not (lengths_only and n.startswith("arrivals drawn"))]
    if notes:
        lines.append("notes:")
        lines += [f"  {n}" for n in notes]
    return "\n".join(lines)
