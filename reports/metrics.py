"""Serving metrics from per-request and per-step records, named as `vllm bench serve` names them.

`summarize()` turns the rows of requests.csv and steps.csv into one flat, JSON-ready dict
(summary.json). Definitions follow vLLM's benchmark (`vllm/benchmarks/serve.py`,
`calculate_metrics`) so that a simulated run and a `vllm bench serve` run read alike:

- Only *finished* requests enter the latency and throughput figures (vLLM counts only
  successful requests); rejected ones are counted in ``rejected``.
- ``duration`` runs from the first arrival (of any request) to the last completion of a
  finished request, unless the caller passes ``duration_s``. Every rate is a count divided by
  it, and is 0.0 when the duration is 0.
- TTFT = first token - arrival; E2EL = last token - arrival;
  TPOT = (E2EL - TTFT) / (output_tokens - 1), so it excludes the first token, and a request
  with one output token has no TPOT (it is left out of the TPOT statistics, and counts as
  meeting a TPOT SLO, as vLLM's goodput treats its TPOT as 0).
- ITL is one value per gap between consecutive output tokens. From ``token_times`` when the
  record kept them; otherwise a finished request with k > 1 tokens contributes k - 1 gaps, all
  equal to its mean gap (its TPOT). That approximation keeps the mean ITL exact but narrows
  the spread: std and percentiles see no jitter inside a request. The repeated gaps are never
  materialised; they enter the statistics as weights (see `_weighted_stats`).
- Percentiles use numpy's default linear interpolation; std is the population std (numpy's
  default). A statistic over no values is None (null in JSON), never 0.0: a run where
  nothing finished has no TTFT, and 0 ms would read as a perfect one.
- A request with n > 1 samples produced ``output_tokens`` tokens per sample: it adds
  ``output_tokens * n`` to the output totals and throughputs (and to per-tenant service), its
  prompt once. Its latencies are those of the record (sample 0).
- ``request_goodput``: finished requests per second meeting every SLO that applies to them;
  a record's own ``slo_ttft_ms`` / ``slo_tpot_ms`` override the global ones. A value equal to
  its SLO meets it (vLLM's ``slo >= value``). With no SLO at all it equals
  ``request_throughput``.

Beyond vLLM's keys:

- ``num_preemptions``: summed over all records. Queueing delay: scheduled_s - arrival_s of
  finished requests (until first scheduled; waiting after a preemption is not in it).
- KV-cache usage: kv_blocks_used / kv_blocks_total per step record; its mean is weighted by
  step duration (a fast-forwarded record, num_steps > 1, by its total duration), its max is
  over records. ``mean_batch_size``: num_running averaged over steps, a fast-forwarded record
  counting num_steps times.
- Prefix caching (only when the records carry ``cached_tokens``, i.e. the run kept a prefix
  cache; the keys are absent otherwise): ``prefix_cache_hit_rate`` = cached prompt tokens /
  prompt tokens of finished requests (vLLM's ``cached_tokens``, counted at a request's first
  admission), and its split by the tier the hits came from, ``prefix_cache_gpu_hit_rate`` and
  ``prefix_cache_cpu_hit_rate`` (they add up to the rate). None when no prompt token finished.
- ``per_tenant`` (sorted by tenant): service = (1 x input + 2 x output tokens of finished
  requests) / duration, VTC's weighting; ``jain_fairness_index`` = Jain's index over the
  tenants' service divided by their weights (None when nobody was served). A tenant with no
  finished request has ``mean_ttft_ms`` None. KV-cache usage and batch size are None
  without step records.

Cost: one pass over the records per column to build numpy arrays, then vectorised numpy work
(O(m log m) for the ITL percentiles over m requests, never per token): about 2 s of CPU for a
million requests on a busy 2-core machine.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from servelab.records import RequestRecord, StepRecord
from servelab.reports.columns import (RequestArrays, column, describe_record, finished_mask, floats,
                                      ints, is_number)

PERCENTILES = (90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
VTC_INPUT_WEIGHT = 1.0
VTC_OUTPUT_WEIGHT = 2.0
"""Weights of a served token in a tenant's service, as in VTC (OSDI'24)."""

SUMMARY_KEYS: tuple[str, ...] = (
    "duration", "completed", "rejected", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{metric}_ms"
      for metric in LATENCY_METRICS
      for stat in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))),
    "num_preemptions", "mean_queueing_delay_ms", "p99_queueing_delay_ms",
    "mean_kv_cache_usage", "max_kv_cache_usage", "mean_batch_size",
    "jain_fairness_index", "per_tenant",
)
"""Keys of `summarize()`'s result, in order. ``per_tenant`` maps tenant -> TENANT_KEYS."""

PREFIX_CACHE_KEYS: tuple[str, ...] = (
    "prefix_cache_hit_rate", "prefix_cache_gpu_hit_rate", "prefix_cache_cpu_hit_rate")
"""Keys `summarize()` appends after SUMMARY_KEYS when the run kept a prefix cache."""

TENANT_KEYS: tuple[str, ...] = (
    "completed", "rejected", "within_slo", "total_input_tokens", "total_output_tokens",
    "mean_ttft_ms", "service_tokens_per_s",
)


def summarize(
    requests: Sequence[RequestRecord],
    steps: Sequence[StepRecord],
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2el_ms: float | None = None,
    duration_s: float | None = None,
    tenant_weights: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Summary of one run, keyed by SUMMARY_KEYS (see the module docstring for definitions).

    Every value is a plain int, float or None (never NaN), so the dict is JSON-serialisable
    as is; None marks a statistic over an empty set (see the module docstring).
    ``tenant_weights`` are the tenants' shares (default 1 each): the Jain index is taken over
    each tenant's service divided by its weight, so weighted fair share scores 1.0 (tenants
    that sent no request are not in it).
    Raises ValueError naming the offending request or step for inconsistent records.
    """
    for name, slo in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms),
                      ("slo_e2el_ms", slo_e2el_ms)):
        if slo is not None and not (is_number(slo) and 0 <= slo < math.inf):
            raise ValueError(f"{name} must be a finite number >= 0 or None, got {slo!r}")
    if duration_s is not None and not (is_number(duration_s) and 0 < duration_s < math.inf):
        raise ValueError(f"duration_s must be a finite number > 0 or None, got {duration_s!r}")

    r = RequestArrays(requests)
    fin = r.finished
    if duration_s is None:
        duration_s = float(r.finish[fin].max() - r.arrival.min()) if fin.any() else 0.0

    def per_s(count: float) -> float:
        return float(count) / duration_s if duration_s > 0 else 0.0

    ttft, tpot_all, e2el = _latencies(r)
    tpot = tpot_all[r.output_tokens[fin] > 1]
    out = r.output_tokens[fin]
    queueing = (r.scheduled[fin] - r.arrival[fin]) * 1e3
    good = ~np.any(_slo_misses(r, ttft, tpot_all, e2el, slo_ttft_ms, slo_tpot_ms, slo_e2el_ms), axis=0)

    total_input = int(r.prompt_tokens[fin].sum())
    total_output = int((out * r.n[fin]).sum())
    values: dict[str, Any] = {
        "duration": float(duration_s),
        "completed": int(fin.sum()),
        "rejected": int(len(fin) - fin.sum()),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_s(fin.sum()),
        "request_goodput": per_s(good.sum()),
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        **_stats("ttft", ttft),
        **_stats("tpot", tpot),
        **_weighted_stats("itl", *_itl_gaps(r)),
        **_stats("e2el", e2el),
        "num_preemptions": int(r.num_preemptions.sum()),
        "mean_queueing_delay_ms": _mean(queueing),
        "p99_queueing_delay_ms": _percentiles(queueing, [99])[99],
        **_step_stats(steps),
    }
    per_tenant = _per_tenant(r, ttft, good, duration_s)
    values["jain_fairness_index"] = _jain_index(per_tenant, tenant_weights or {})
    values["per_tenant"] = per_tenant
    summary = {key: values[key] for key in SUMMARY_KEYS}
    if not np.isnan(floats(requests, "cached_tokens")).all():
        summary.update(prefix_cache_rates(requests, fin, r.prompt_tokens))
    return summary


def prefix_cache_rates(requests: Sequence[RequestRecord], finished: np.ndarray | None = None,
                       prompt_tokens: np.ndarray | None = None) -> dict[str, float | None]:
    """PREFIX_CACHE_KEYS over the finished requests (a record without a count as 0)."""
    if finished is None:
        finished = finished_mask(requests)
    if prompt_tokens is None:
        prompt_tokens = ints(requests, "prompt_tokens")
    cached = np.nan_to_num(floats(requests, "cached_tokens")).astype(np.int64)
    cpu = np.nan_to_num(floats(requests, "cpu_cached_tokens")).astype(np.int64)
    if len(requests) and ((cached < 0) | (cpu < 0) | (cpu > cached) | (cached > prompt_tokens)).any():
        bad = int(np.argmax((cached < 0) | (cpu < 0) | (cpu > cached) | (cached > prompt_tokens)))
        raise ValueError(f"request {requests[bad].request_id}: cached tokens must satisfy "
                         "0 <= cpu_cached_tokens <= cached_tokens <= prompt_tokens")
    total = int(prompt_tokens[finished].sum())
    if not total:
        return dict.fromkeys(PREFIX_CACHE_KEYS)
    hit, from_cpu = int(cached[finished].sum()), int(cpu[finished].sum())
    return {"prefix_cache_hit_rate": hit / total, "prefix_cache_gpu_hit_rate": (hit - from_cpu) / total,
            "prefix_cache_cpu_hit_rate": from_cpu / total}


@dataclass(frozen=True)
class SLOOutcomes:
    """Per request (all of them, in the order given): whether it finished, and which SLOs
    a finished request missed (a rejected one misses nothing here: it simply did not
    finish). The same rules as ``request_goodput``."""

    finished: np.ndarray
    ttft_missed: np.ndarray
    tpot_missed: np.ndarray
    e2el_missed: np.ndarray
    has_slo: bool
    """Some SLO (global or a request's own) applied to some request."""

    @property
    def met(self) -> np.ndarray:
        """Finished within every SLO that applies to it."""
        return self.finished & ~(self.ttft_missed | self.tpot_missed | self.e2el_missed)


def slo_outcomes(requests: Sequence[RequestRecord], *, slo_ttft_ms: float | None = None,
                 slo_tpot_ms: float | None = None, slo_e2el_ms: float | None = None) -> SLOOutcomes:
    """Which requests met their SLOs and which SLO each missed (a record's own SLO first),
    for analyses finer than goodput: attainment per tenant, the metric that broke. O(n)."""
    r = RequestArrays(requests)
    ttft, tpot_all, e2el = _latencies(r)
    misses = _slo_misses(r, ttft, tpot_all, e2el, slo_ttft_ms, slo_tpot_ms, slo_e2el_ms)
    full = np.zeros((3, len(r.finished)), dtype=bool)
    full[:, r.finished] = misses
    has_slo = any(v is not None for v in (slo_ttft_ms, slo_tpot_ms, slo_e2el_ms)) or \
        bool((~np.isnan(r.slo_ttft)).any() or (~np.isnan(r.slo_tpot)).any())
    return SLOOutcomes(r.finished, *full, has_slo=has_slo)


def _latencies(r: "RequestArrays") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(TTFT, TPOT, E2EL) in ms of the finished requests; TPOT is 0 for one-token requests,
    as vLLM's goodput has it (`summarize` leaves them out of the TPOT statistics)."""
    fin = r.finished
    ttft = (r.first_token[fin] - r.arrival[fin]) * 1e3
    e2el = (r.finish[fin] - r.arrival[fin]) * 1e3
    out = r.output_tokens[fin]
    multi = out > 1
    tpot_all = np.zeros_like(e2el)
    tpot_all[multi] = (e2el[multi] - ttft[multi]) / (out[multi] - 1)
    return ttft, tpot_all, e2el


def _slo_misses(r: "RequestArrays", ttft: np.ndarray, tpot: np.ndarray, e2el: np.ndarray,
                slo_ttft_ms: float | None, slo_tpot_ms: float | None,
                slo_e2el_ms: float | None) -> np.ndarray:
    """(3, finished) booleans: TTFT, TPOT and E2E SLO missed, a record's own SLO first; a
    value equal to its SLO meets it."""
    fin = r.finished
    missed = np.zeros((3, len(ttft)), dtype=bool)
    for row, (value, own, default) in enumerate(((ttft, r.slo_ttft[fin], slo_ttft_ms),
                                                 (tpot, r.slo_tpot[fin], slo_tpot_ms),
                                                 (e2el, None, slo_e2el_ms))):
        slo = np.full(len(value), math.nan if default is None else float(default))
        if own is not None:
            slo = np.where(np.isnan(own), slo, own)
        missed[row] = ~np.isnan(slo) & (value > slo)
    return missed


def _itl_gaps(r: RequestArrays) -> tuple[np.ndarray, np.ndarray]:
    """(gap values in ms, how many gaps each value stands for) over the finished requests.

    Exact gaps come from ``token_times`` (weight 1 each), all requests' times concatenated
    and differenced at once; a request without them stands for output_tokens - 1 gaps equal
    to its mean gap.
    """
    times = column(r.requests, "token_times")
    has_times = np.zeros(len(times), dtype=bool)
    if times.count(None) != len(times):
        has_times = np.array([t is not None for t in times], dtype=bool)
    exact_idx = np.flatnonzero(r.finished & has_times)
    kept = [times[i] for i in exact_idx]
    try:
        lengths = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
        flat = np.fromiter(chain.from_iterable(kept), dtype=float, count=int(lengths.sum()))
        starts = np.cumsum(lengths) - lengths
        inside = np.ones(max(len(flat) - 1, 0), dtype=bool)
        inside[starts[(starts > 0) & (starts < len(flat))] - 1] = False  # gaps across requests
        exact = np.diff(flat)[inside] * 1e3 if len(flat) else np.zeros(0)
        valid = bool((exact >= 0).all())  # False for NaN too
    except (TypeError, ValueError):  # not a sequence of numbers
        valid = False
    if not valid:
        bad = next(i for i in exact_idx if not _non_decreasing(times[i]))
        raise ValueError(f"{describe_record(r.requests, bad)}: token_times must be a list of finite, "
                         f"non-decreasing numbers")

    approx = r.finished & ~has_times & (r.output_tokens > 1)
    mean_gap = (r.finish[approx] - r.first_token[approx]) * 1e3 / (r.output_tokens[approx] - 1)
    values = np.concatenate([exact, mean_gap])
    weights = np.concatenate([np.ones(len(exact), dtype=np.int64), r.output_tokens[approx] - 1])
    return values, weights


def _non_decreasing(times: object) -> bool:
    try:
        t = np.asarray(times, dtype=float)
    except (TypeError, ValueError):
        return False
    return t.ndim == 1 and bool(np.isfinite(t).all() and (np.diff(t) >= 0).all())


def _step_stats(steps: Sequence[StepRecord]) -> dict[str, float | None]:
    """KV-cache usage (fraction of blocks; mean weighted by step time) and mean batch size.

    A record with num_steps > 1 is a fast-forwarded run of identical decode steps: it weighs
    by its (total) duration for KV usage and by num_steps for the batch size. If every step
    took zero time, the KV mean falls back to weighting by num_steps.
    """
    if not steps:
        return {"mean_kv_cache_usage": None, "max_kv_cache_usage": None, "mean_batch_size": None}
    duration = floats(steps, "duration_s")
    num_steps = ints(steps, "num_steps")
    used = ints(steps, "kv_blocks_used")
    total = ints(steps, "kv_blocks_total")
    running = ints(steps, "num_running")
    for bad, what in ((~(np.isfinite(duration) & (duration >= 0)),
                       "duration_s must be finite and >= 0"),
                      (num_steps < 1, "num_steps must be >= 1"),
                      (total < 1, "kv_blocks_total must be >= 1"),
                      ((used < 0) | (used > total),
                       "kv_blocks_used must be in [0, kv_blocks_total]"),
                      (running < 0, "num_running must be >= 0")):
        if bad.any():
            raise ValueError(f"{describe_record(steps, int(np.argmax(bad)))}: {what}")
    usage = used / total
    weight = duration if duration.sum() > 0 else num_steps.astype(float)
    return {
        "mean_kv_cache_usage": float(np.dot(usage, weight) / weight.sum()),
        "max_kv_cache_usage": float(usage.max()),
        "mean_batch_size": float(np.dot(running, num_steps) / num_steps.sum()),
    }


def _per_tenant(r: RequestArrays, ttft_finished: np.ndarray, good_finished: np.ndarray,
                duration_s: float) -> dict[str, dict]:
    """TENANT_KEYS per tenant (sorted by name); every tenant that sent a request appears.
    ``within_slo`` counts its finished requests that met every SLO (goodput's numerator)."""
    codes = {name: c for c, name in enumerate(dict.fromkeys(r.tenants))}
    k = len(codes)
    if k == 1:
        code = np.zeros(len(r.tenants), dtype=np.int64)
    else:
        code = np.fromiter(map(codes.__getitem__, r.tenants), dtype=np.int64,
                           count=len(r.tenants))
    fin = r.finished

    def by_tenant(mask: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(code[mask], weights=weights, minlength=k)

    completed = by_tenant(fin)
    rejected = by_tenant(~fin)
    input_tokens = by_tenant(fin, r.prompt_tokens[fin]).astype(np.int64)
    output_tokens = by_tenant(fin, (r.output_tokens * r.n)[fin]).astype(np.int64)
    ttft_sum = by_tenant(fin, ttft_finished)
    good = np.zeros(len(fin), dtype=bool)
    good[fin] = good_finished
    within = by_tenant(good)
    result = {}
    for name in sorted(codes):
        c = codes[name]
        service = VTC_INPUT_WEIGHT * input_tokens[c] + VTC_OUTPUT_WEIGHT * output_tokens[c]
        result[name] = {
            "completed": int(completed[c]),
            "rejected": int(rejected[c]),
            "within_slo": int(within[c]),
            "total_input_tokens": int(input_tokens[c]),
            "total_output_tokens": int(output_tokens[c]),
            "mean_ttft_ms": float(ttft_sum[c] / completed[c]) if completed[c] else None,
            "service_tokens_per_s": float(service / duration_s) if duration_s > 0 else 0.0,
        }
    return result


def _jain_index(per_tenant: dict[str, dict], tenant_weights: Mapping[str, float]) -> float | None:
    """Jain's index (sum x)^2 / (k sum x^2) of weight-normalised service x.

    1.0 when every tenant got the same normalised service, 1/k when one got everything;
    None when nobody was served (fairness of nothing is undefined).
    """
    for name, w in tenant_weights.items():
        if not (is_number(w) and 0 < w < math.inf):
            raise ValueError(f"tenant_weights[{name!r}] must be a finite number > 0, got {w!r}")
    x = np.array([t["service_tokens_per_s"] / tenant_weights.get(name, 1.0)
                  for name, t in per_tenant.items()], dtype=float)
    sum_sq = float(np.dot(x, x))
    return float(x.sum() ** 2 / (len(x) * sum_sq)) if sum_sq > 0 else None


def _stats(metric: str, values_ms: np.ndarray) -> dict[str, float | None]:
    """mean/median/std/pXX of one latency, as vLLM reports them (None over no values)."""
    pct = _percentiles(values_ms, PERCENTILES)
    return {
        f"mean_{metric}_ms": _mean(values_ms),
        f"median_{metric}_ms": float(np.median(values_ms)) if len(values_ms) else None,
        f"std_{metric}_ms": float(np.std(values_ms)) if len(values_ms) else None,
        **{f"p{p}_{metric}_ms": pct[p] for p in PERCENTILES},
    }


def _weighted_stats(metric: str, values: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    """`_stats` of the multiset holding values[i] weights[i] times, without building it.

    Percentiles are numpy's linear interpolation at virtual index (N-1)·q of the sorted
    multiset, found by binary search in the cumulative weights: O(m log m) for m values,
    however many gaps they stand for.
    """
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    total = int(weights.sum())
    if total == 0:
        return _stats(metric, np.zeros(0))
    mean = float(np.dot(values, weights) / total)
    std = float(math.sqrt(np.dot(weights, (values - mean) ** 2) / total))
    order = np.argsort(values)  # ties hold equal values, so their order cannot matter
    sorted_values, cum = values[order], np.cumsum(weights[order])

    def quantile(q: float) -> float:
        h = (total - 1) * q
        lo = math.floor(h)
        a, b = sorted_values[np.searchsorted(cum, [lo, min(lo + 1, total - 1)], side="right")]
        return float(_lerp(a, b, h - lo))

    return {
        f"mean_{metric}_ms": mean,
        f"median_{metric}_ms": quantile(0.5),
        f"std_{metric}_ms": std,
        **{f"p{p}_{metric}_ms": quantile(p / 100) for p in PERCENTILES},
    }


def _lerp(a: float, b: float, t: float) -> float:
    """numpy's percentile interpolation (it switches ends at t = 0.5 for stability)."""
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


def _percentiles(values: np.ndarray, ps: Sequence[float]) -> dict[float, float | None]:
    if not len(values):
        return {p: None for p in ps}
    return {p: float(v) for p, v in zip(ps, np.percentile(values, ps))}


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if len(values) else None
