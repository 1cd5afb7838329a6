"""The cost model's free parameters, their published defaults, and calibration files.

A roofline prices an op at `max(FLOPs / (peak · eff_c), bytes / (bandwidth · eff_m))`;
the efficiencies, a fixed per-step overhead and a decode-attention saturation constant are
everything a calibration may change. They live here, apart from the physics in
`cost_model.py`, so a fitted profile is a small JSON file and a fitter never touches code.

Linear form for fitting. With every op's bound (compute or memory) held fixed, a step's
modelled time is linear in the *coefficients* below:

    step_time = Σ_name coefficient[name] · feature[name]

where `CostModel.features(shape)` gives the features (seconds at efficiency 1, counts) and
`coefficients(eff, overhead)` the weights: `1/eff` for a roofline term, `half/eff` for the
decode-attention per-sequence term, seconds for latencies and the overhead. A
non-negative least-squares fit over measured steps yields coefficients, and
`efficiencies_from_coefficients` turns them back into a profile.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from servelab._validate import check_known_keys
from servelab.simulator.gpus import DTYPE_BYTES

FORMAT = "servelab.calibration/1"

# End-to-end prefill MFU anchors of a published roofline simulator (REFERENCE.md): H100
# 0.45, A100 0.38, L40S 0.32. They are the default compute efficiency of every op. A bare
# 8192³ GEMM runs faster (~0.8 measured on H100), but serving GEMMs are smaller and the
# anchors absorb what a per-op roofline leaves out. H200 and B200 inherit H100's figure
# (same or newer tensor cores, no published anchor); other devices get 0.40.
_PREFILL_MFU = {"h100-sxm": 0.45, "h200": 0.45, "b200": 0.45, "a100-80gb": 0.38, "l40s": 0.32}
_FALLBACK_MFU = 0.40

DEFAULT_STEP_OVERHEAD_S = 1e-3
"""CPU work per engine step (scheduling, input preparation, sampling bookkeeping, kernel or
CUDA-graph launch) that the GPU roofline does not see. 1 ms is an assumption for a
CUDA-graph engine such as vLLM v1; engines without graphs measured several ms. It is the
first thing a calibration should replace."""


@dataclass(frozen=True, slots=True)
class Efficiencies:
    """Fractions of peak reached per op class; each in (0, 1] unless stated."""

    gemm_compute: float = _FALLBACK_MFU
    gemm_memory: float = 0.85
    """Weight streaming by a skinny GEMM: ~0.9 of datasheet bandwidth is what a device
    copy reaches (REFERENCE: H100 3.0 of 3.35 TB/s, H200 4.3 of 4.8)."""
    attn_prefill_compute: float = _FALLBACK_MFU
    attn_prefill_memory: float = 0.70
    attn_decode_compute: float = _FALLBACK_MFU
    attn_decode_memory: float = 0.85
    """Bandwidth fraction a paged decode kernel reaches at long context (saturation)."""
    attn_decode_context_half: float = 256.0
    """Mean context (tokens) at which decode attention reaches half of `attn_decode_memory`.
    The efficiency curve is eff(L) = attn_decode_memory · L / (L + half): with the defaults
    0.28 at 128 tokens, 0.43 at 256, 0.68 at 1024, 0.80 at 4096 — "well under 50% at short
    context, 70–85% at long context" (REFERENCE). In bytes this is a fixed cost of `half`
    tokens' worth of KV reads per sequence, so decode-attention time stays linear in the
    context sum (what makes closed-form fast-forward possible). Tokens, >= 0."""
    elementwise_memory: float = 0.70
    """Norms, activation, rotary, embedding gather and copy-on-write block copies."""
    collective_link: float = 0.80
    """Sustained fraction of per-direction link bandwidth in a ring collective (REFERENCE:
    H100 NVLink p2p ≈ 83% of nominal)."""
    collective_latency_s: float = 5e-6
    """Fixed cost of one all-reduce launch (seconds, >= 0): the small-message latency of an
    intra-node NVLink all-reduce is a few µs. An assumption."""
    swap_link: float = 0.70
    """Fraction of per-direction PCIe bandwidth a swap reaches: pinned host copies reach
    ~0.8, and swap moves many block-sized pieces per layer."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"Efficiencies.{f.name} must be a number, got {value!r}")
            if f.name in ("attn_decode_context_half", "collective_latency_s"):
                if not 0 <= value < math.inf:
                    raise ValueError(f"Efficiencies.{f.name} must be finite and >= 0, got {value!r}")
            elif not 0 < value <= 1:
                raise ValueError(f"Efficiencies.{f.name} must be a fraction of peak in (0, 1], "
                                 f"got {value!r} (a value above 1 means the peak is wrong: "
                                 f"override the device figure instead)")

    def decode_attention_memory_efficiency(self, mean_context: float) -> float:
        """The saturating bandwidth fraction of decode attention at a mean context length."""
        if mean_context <= 0:
            return 0.0
        return self.attn_decode_memory * mean_context / (mean_context + self.attn_decode_context_half)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "efficiencies") -> "Efficiencies":
        if not isinstance(data, dict):
            raise ValueError(f"{source} must be an object of efficiencies, got {type(data).__name__}")
        check_known_keys(data, {f.name for f in fields(cls)}, f"{source}: unknown field(s)")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def default_efficiencies(gpu_name: str) -> Efficiencies:
    """Published-anchor efficiencies for a catalog device (compute = its prefill MFU)."""
    mfu = _PREFILL_MFU.get(gpu_name, _FALLBACK_MFU)
    return Efficiencies(gemm_compute=mfu, attn_prefill_compute=mfu, attn_decode_compute=mfu)


# --- the linear form -----------------------------------------------------------------------

# feature name -> (Efficiencies field it calibrates, kind): "inv" coefficient = 1/eff,
# "half" = context_half/attn_decode_memory, "seconds" = the field itself.
COEFFICIENT_FIELDS: dict[str, tuple[str, str]] = {
    "gemm.compute": ("gemm_compute", "inv"),
    "gemm.memory": ("gemm_memory", "inv"),
    "attn_prefill.compute": ("attn_prefill_compute", "inv"),
    "attn_prefill.memory": ("attn_prefill_memory", "inv"),
    "attn_decode.compute": ("attn_decode_compute", "inv"),
    "attn_decode.memory": ("attn_decode_memory", "inv"),
    "attn_decode.memory_per_seq": ("attn_decode_context_half", "half"),
    "elementwise.memory": ("elementwise_memory", "inv"),
    "collective.link": ("collective_link", "inv"),
    "collective.latency": ("collective_latency_s", "seconds"),
    "swap.link": ("swap_link", "inv"),
}
FEATURE_NAMES: tuple[str, ...] = ("overhead", *COEFFICIENT_FIELDS)


def coefficients(eff: Efficiencies, step_overhead_s: float) -> dict[str, float]:
    """The weights of `CostModel.features`: step_time = Σ coefficient · feature."""
    out = {"overhead": float(step_overhead_s)}
    for name, (attr, kind) in COEFFICIENT_FIELDS.items():
        value = getattr(eff, attr)
        if kind == "inv":
            out[name] = 1.0 / value
        elif kind == "half":
            out[name] = value / eff.attn_decode_memory
        else:
            out[name] = value
    return out


def efficiencies_from_coefficients(coefs: dict[str, float], base: Efficiencies,
                                   base_overhead_s: float) -> tuple[Efficiencies, float]:
    """Invert `coefficients`; names absent from `coefs` keep `base`'s values.

    Raises ValueError when a coefficient maps outside its field's range (e.g. a fitted
    1/eff below 1, i.e. an efficiency above 1: the device's peak figure is then wrong).
    """
    unknown = sorted(set(coefs) - set(FEATURE_NAMES))
    if unknown:
        raise ValueError(f"unknown coefficient(s) {', '.join(unknown)}; known: {', '.join(FEATURE_NAMES)}")
    values: dict[str, float] = {}
    for name, (attr, kind) in COEFFICIENT_FIELDS.items():
        if name in coefs and kind == "inv":
            if not coefs[name] > 0:
                raise ValueError(f"coefficient {name!r} must be > 0 to invert, got {coefs[name]!r}")
            values[attr] = 1.0 / coefs[name]
        elif name in coefs and kind == "seconds":
            values[attr] = coefs[name]
    eff = replace(base, **values)
    if "attn_decode.memory_per_seq" in coefs:  # after attn_decode_memory is settled
        eff = replace(eff, attn_decode_context_half=coefs["attn_decode.memory_per_seq"]
                      * eff.attn_decode_memory)
    overhead = coefs.get("overhead", base_overhead_s)
    if not 0 <= overhead < math.inf:
        raise ValueError(f"coefficient 'overhead' must be finite and >= 0, got {overhead!r}")
    return eff, float(overhead)


# --- profiles ------------------------------------------------------------------------------

@dataclass(frozen=True)
class CalibrationProfile:
    """What a calibration run learned about one (device, model, dtypes, tp) setup."""

    device: str
    """GPU catalog name the profile's efficiencies are relative to."""
    model: str
    efficiencies: Efficiencies
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    tp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    software: dict[str, str] = field(default_factory=dict)
    """Versions the measurements were taken with (engine, torch, CUDA, driver, ...)."""
    gpu_overrides: dict[str, float] = field(default_factory=dict)
    """Measured device figures replacing catalog ones (GPUSpec field -> value)."""
    fit_stats: dict[str, float] = field(default_factory=dict)
    """How good the fit was (e.g. samples, median and p90 relative error)."""
    notes: str = ""

    def __post_init__(self) -> None:
        _check_profile(self, "CalibrationProfile")

    def to_dict(self) -> dict:
        return {"format": FORMAT, "device": self.device, "model": self.model, "tp": self.tp,
                "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype,
                "step_overhead_s": self.step_overhead_s, "efficiencies": self.efficiencies.to_dict(),
                "gpu_overrides": dict(self.gpu_overrides), "software": dict(self.software),
                "fit_stats": dict(self.fit_stats), "notes": self.notes}

    @classmethod
    def from_dict(cls, data: dict, source: str = "calibration profile") -> "CalibrationProfile":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"{source}: field 'format' must be {FORMAT!r}, got {data.get('format')!r}")
        check_known_keys(data, {f.name for f in fields(cls)} | {"format"}, f"{source}: unknown field(s)")
        for required in ("device", "model", "efficiencies"):
            if required not in data:
                raise ValueError(f"{source}: missing field {required!r}")
        eff = Efficiencies.from_dict(data["efficiencies"], source=f"{source}: field 'efficiencies'")
        kwargs = {k: v for k, v in data.items() if k not in ("format", "efficiencies")}
        try:
            return cls(efficiencies=eff, **kwargs)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "CalibrationProfile":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read calibration profile {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data, source=str(path))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


def _check_profile(p: CalibrationProfile, owner: str) -> None:
    for name in ("device", "model"):
        if not isinstance(getattr(p, name), str) or not getattr(p, name):
            raise ValueError(f"field {name!r} must be a non-empty string, got {getattr(p, name)!r}")
    if not isinstance(p.efficiencies, Efficiencies):
        raise ValueError(f"field 'efficiencies' must be an Efficiencies, got {type(p.efficiencies).__name__}")
    if isinstance(p.tp, bool) or not isinstance(p.tp, int) or p.tp < 1:
        raise ValueError(f"field 'tp' must be an integer >= 1, got {p.tp!r}")
    for name in ("weight_dtype", "kv_dtype"):
        if getattr(p, name) not in DTYPE_BYTES:
            raise ValueError(f"field {name!r} must be one of {', '.join(DTYPE_BYTES)}, "
                             f"got {getattr(p, name)!r}")
    o = p.step_overhead_s
    if isinstance(o, bool) or not isinstance(o, (int, float)) or not 0 <= o < math.inf:
        raise ValueError(f"field 'step_overhead_s' must be a finite number >= 0, got {o!r}")
    for name, kind in (("software", str), ("gpu_overrides", (int, float)), ("fit_stats", (int, float))):
        mapping = getattr(p, name)
        if not isinstance(mapping, dict) or not all(
                isinstance(k, str) and isinstance(v, kind) and not isinstance(v, bool)
                for k, v in mapping.items()):
            raise ValueError(f"field {name!r} must map names to "
                             f"{'strings' if kind is str else 'numbers'}, got {mapping!r}")
    if not isinstance(p.notes, str):
        raise ValueError(f"field 'notes' must be a string, got {p.notes!r}")
