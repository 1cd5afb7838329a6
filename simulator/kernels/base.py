"""What every kernel model shares: the soft maximum of overlapping times, the parameter
checks and their JSON form."""
from __future__ import annotations

import math
from dataclasses import asdict, fields

import numpy as np

from servelab._validate import check_float

INF = math.inf


def _overlap(compute, memory, q: float):
    """Soft maximum of two non-negative times: max at q = inf, sum at q = 1."""
    if q == INF:
        return np.maximum(compute, memory)
    big = np.maximum(compute, memory)
    safe = np.where(big > 0, big, 1.0)
    return big * ((compute / safe) ** q + (memory / safe) ** q) ** (1.0 / q)


def _check_fields(params, skip: tuple[str, ...] = ()) -> None:
    """Every field a number; fractions of peak in (0, 1]; `overlap` >= 1; `*l2_gain` >= 1;
    everything else finite and >= 0 (fields in `skip` are checked by their owner)."""
    for f in fields(params):
        if f.name in skip:
            continue
        value = getattr(params, f.name)
        check_float(type(params).__name__, f.name, value)
        owner = f"{type(params).__name__}.{f.name}"
        if f.name in params._fractions:
            if not 0 < value <= 1:
                raise ValueError(f"{owner} must be a fraction of peak in (0, 1], got {value!r} "
                                 f"(above 1 means the peak is wrong: override the device figure)")
        elif f.name == "overlap":
            if not value >= 1:
                raise ValueError(f"{owner} must be >= 1 (1: no overlap, inf: full), got {value!r}")
        elif f.name.endswith("l2_gain"):
            if not 1 <= value < INF:
                raise ValueError(f"{owner} must be >= 1 (L2 is never slower than HBM), "
                                 f"got {value!r}")
        elif not 0 <= value < INF:
            raise ValueError(f"{owner} must be finite and >= 0, got {value!r}")


class _Params:
    """Shared checks and (de)serialisation for the parameter dataclasses below."""

    _fractions: tuple[str, ...] = ()
    _added: tuple[str, ...] = ()
    """Fields added after profiles were first written, whose default is the behaviour
    before them: a profile file without one reads as that default."""

    def _check(self) -> None:
        _check_fields(self)

    def to_dict(self) -> dict[str, float | str]:
        return {k: ("inf" if v == INF else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict, source: str):
        if not isinstance(data, dict):
            raise ValueError(f"{source} must be an object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(names))}")
        missing = sorted(names - set(data) - set(cls._added))
        if missing:   # a silent default would be the bare roofline's value
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        values = {k: (INF if v == "inf" else v) for k, v in data.items()}
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None


def l2_hit(working_set, gpu, fraction: float = 1.0, sharpness: float = 8.0):
    """Share of a working set (bytes) served from L2 when a kernel is replayed: a smooth
    step around `fraction` of the L2 capacity, as steep as `sharpness` (8: the set fits
    or it does not, as for a GEMM's tiles; 2: a streamed set that keeps part of itself in
    L2 well past the capacity, as attention's Q, O and K/V do)."""
    if not gpu.l2_mb or not fraction:
        return 0.0
    return 1.0 / (1.0 + (working_set / (fraction * gpu.l2_bytes)) ** sharpness)
