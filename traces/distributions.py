"""Seeded arrival processes and token-length distributions for synthetic workloads.

Every sampler takes an explicit `numpy.random.Generator`; nothing here owns a random
state, so two workloads built in one process never influence each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from servelab._validate import check_bounded
from servelab.traces.record import TraceError


def _check_positive(owner: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    """A finite number > 0 (>= 0 with `allow_zero`), else a TraceError naming owner.name."""
    check_bounded(f"{owner}.{name}", value, 0, lo_open=not allow_zero, error=TraceError)


@dataclass(frozen=True)
class ArrivalProcess:
    """A renewal process with Gamma inter-arrival gaps of mean 1/rate and coefficient of
    variation `cv`: cv=1 is Poisson, cv>1 bursty, cv<1 more regular, cv=0 evenly spaced.

    Gaps scale exactly with 1/rate for a fixed generator state, so the same seed at a
    higher rate replays the same pattern, compressed.
    """

    rate: float
    cv: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("ArrivalProcess", "rate", self.rate)
        _check_positive("ArrivalProcess", "cv", self.cv, allow_zero=True)

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.cv == 0:
            return np.full(n, 1.0 / self.rate)
        shape = 1.0 / (self.cv * self.cv)
        return rng.gamma(shape, 1.0 / (self.rate * shape), size=n)

    def times(self, rng: np.random.Generator, *, n: int | None = None,
              duration_s: float | None = None) -> np.ndarray:
        """Arrival times in seconds after time 0 (the first one a gap after it): exactly
        `n` of them, or all that fall before `duration_s`. Cost O(count)."""
        if (n is None) == (duration_s is None):
            raise TraceError("ArrivalProcess.times needs exactly one of n and duration_s")
        if n is not None:
            if n < 0:
                raise TraceError(f"ArrivalProcess.times: n must be >= 0, got {n}")
            return np.cumsum(self.gaps(n, rng))
        _check_positive("ArrivalProcess.times", "duration_s", duration_s, allow_zero=True)
        chunks, end = [], 0.0
        expected = self.rate * duration_s
        chunk = int(expected + 4 * math.sqrt(expected + 1) * max(self.cv, 1.0)) + 16
        while end < duration_s:
            t = end + np.cumsum(self.gaps(chunk, rng))
            chunks.append(t)
            end = float(t[-1])
        times = np.concatenate(chunks) if chunks else np.empty(0)
        return times[times < duration_s]

    def describe(self) -> str:
        kind = "poisson" if self.cv == 1 else f"gamma cv={self.cv:g}"
        return f"{kind} rate={self.rate:g}/s"


class LengthDist(Protocol):
    """Draws token lengths (ints >= 1)."""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray: ...

    def to_dict(self) -> dict: ...


def _as_lengths(x: np.ndarray, low: int = 1, high: int | None = None) -> np.ndarray:
    out = np.rint(x).astype(np.int64)
    return np.clip(out, max(1, low), high if high is not None else np.iinfo(np.int64).max)


@dataclass(frozen=True)
class Fixed:
    value: int

    def __post_init__(self) -> None:
        check_bounded("Fixed.value", self.value, 1, integer=True, error=TraceError)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)

    def to_dict(self) -> dict:
        return {"kind": "fixed", "value": self.value}


@dataclass(frozen=True)
class Uniform:
    """Integers uniform on [low, high], both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not (isinstance(self.low, int) and isinstance(self.high, int) and 1 <= self.low <= self.high):
            raise TraceError(f"Uniform needs ints 1 <= low <= high, got low={self.low!r} high={self.high!r}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)

    def to_dict(self) -> dict:
        return {"kind": "uniform", "low": self.low, "high": self.high}


@dataclass(frozen=True)
class LogNormal:
    """exp(Normal(mu, sigma)), rounded and clipped to [low, high]."""

    mu: float
    sigma: float
    low: int = 1
    high: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu):
            raise TraceError(f"LogNormal.mu must be finite, got {self.mu!r}")
        _check_positive("LogNormal", "sigma", self.sigma, allow_zero=True)
        if self.low < 1 or (self.high is not None and self.high < self.low):
            raise TraceError(f"LogNormal needs 1 <= low <= high, got low={self.low} high={self.high}")

    @classmethod
    def from_mean_cv(cls, mean: float, cv: float, low: int = 1, high: int | None = None) -> "LogNormal":
        """The log-normal with this mean and coefficient of variation (before clipping)."""
        _check_positive("LogNormal", "mean", mean)
        _check_positive("LogNormal", "cv", cv, allow_zero=True)
        var = math.log1p(cv * cv)
        return cls(math.log(mean) - var / 2, math.sqrt(var), low, high)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return _as_lengths(rng.lognormal(self.mu, self.sigma, size=n), self.low, self.high)

    def to_dict(self) -> dict:
        return {"kind": "lognormal", "mu": self.mu, "sigma": self.sigma, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class Empirical:
    """Resamples observed lengths with replacement (e.g. the prompts of a real trace)."""

    values: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.values or any(not isinstance(v, int) or v < 1 for v in self.values):
            raise TraceError("Empirical.values must be a non-empty tuple of ints >= 1")

    @classmethod
    def from_trace(cls, trace, which: str) -> "Empirical":
        """`which` is 'prompt' or 'output'."""
        if which not in ("prompt", "output"):
            raise TraceError(f"Empirical.from_trace: which must be 'prompt' or 'output', got {which!r}")
        attr = "prompt_tokens" if which == "prompt" else "output_tokens"
        return cls(tuple(getattr(r, attr) for r in trace.records))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.asarray(self.values, dtype=np.int64)[rng.integers(0, len(self.values), size=n)]

    def to_dict(self) -> dict:
        return {"kind": "empirical", "values": list(self.values)}


@dataclass(frozen=True)
class Quantiles:
    """Inverse-CDF sampling through a table of quantiles, linear in between.

    A compact non-parametric fit: about a hundred numbers reproduce a multi-modal length
    distribution (such as Azure's) that a log-normal misses by 25% at the median.
    """

    probs: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        p, v = self.probs, self.values
        if len(p) < 2 or len(p) != len(v) or p[0] != 0.0 or p[-1] != 1.0:
            raise TraceError("Quantiles needs equally long probs and values, probs from 0.0 to 1.0")
        if any(b < a for a, b in zip(p, p[1:])) or any(b < a for a, b in zip(v, v[1:])) or v[0] < 1:
            raise TraceError("Quantiles.probs and values must be non-decreasing, values >= 1")

    @classmethod
    def fit(cls, data: Sequence[int], probs: Sequence[float]) -> "Quantiles":
        values = np.percentile(np.asarray(data, dtype=np.float64), np.asarray(probs) * 100.0)
        return cls(tuple(float(p) for p in probs), tuple(round(float(x), 2) for x in values))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return _as_lengths(np.interp(rng.random(n), self.probs, self.values))

    def to_dict(self) -> dict:
        return {"kind": "quantiles", "probs": list(self.probs), "values": list(self.values)}


def length_dist_from_dict(d: dict) -> LengthDist:
    """Inverse of `to_dict`, for workload files."""
    kind = d.get("kind")
    if kind == "fixed":
        return Fixed(int(d["value"]))
    if kind == "uniform":
        return Uniform(int(d["low"]), int(d["high"]))
    if kind == "lognormal":
        return LogNormal(float(d["mu"]), float(d["sigma"]), int(d.get("low", 1)), d.get("high"))
    if kind == "empirical":
        return Empirical(tuple(int(v) for v in d["values"]))
    if kind == "quantiles":
        return Quantiles(tuple(float(p) for p in d["probs"]), tuple(float(v) for v in d["values"]))
    raise TraceError(f"unknown length distribution kind {kind!r} "
                     "(expected fixed, uniform, lognormal, empirical or quantiles)")
