"""Calibration profiles: the cost model's parameters for one GPU, and where they came from.

A profile holds two layers, fitted from two kinds of measurement:

- `kernels` (`kernels.KernelParams`): per kernel family, the efficiencies, floors and
  latencies of `kernels.py`, fitted to measured kernel times of one GPU
  (`servelab calibrate --from-measurements`). They are properties of the GPU and the
  engine's kernels, not of a model: the same parameters price any model's shapes.
- `scales` and `step_overhead_s`: a multiplier per op class on top of the kernel model and
  the CPU time of one engine step, fitted to the steps of real runs of one setup
  (`servelab validate --fit`). With every class's kernel time held fixed a step's
  modelled time is linear in them:

      step_time = step_overhead_s + Σ_class scales[class] · class_time(shape)

  so that fit is a non-negative least-squares problem (`servelab.validation.fit`).

Packaged profiles (`simulator/data/calibration/<name>.json`) are the defaults: each GPU's
catalog entry names the one it uses (its own, or the nearest measured architecture's).
Kernel times move between engine versions (on one H100, vLLM 0.24 against 0.14: BF16 GEMMs
and attention 0.81-1.07 between the 10th and 90th percentiles, docs/fidelity.md; other
kernels up to 2.9 times, ../shared/gpu-measurements/README.md), so a kernel-level profile
names the engine version its tables were measured inside (`engine_version`), and one GPU
may have a profile per version (`<gpu>.json` for vLLM 0.14.0, `<gpu>.vllm-<major.minor>.json`
for the others); `profile_for` picks the one that prices a GPU under an engine version.
`"none"` is the bare roofline: every peak reached, no floors, no overhead.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from functools import cache
from importlib import resources
from pathlib import Path

from servelab._validate import check_bounded, check_known_keys
from servelab.simulator.gpus import DTYPE_BYTES, GPUSpec, get_gpu
from servelab.simulator.kernels import KernelParams

FORMAT = "servelab.calibration/2"

OP_CLASSES = ("gemm", "attn_prefill", "attn_decode", "elementwise", "collective", "host_link")
"""The op classes a step's time is split into (see `CostModel.class_times`)."""

ENGINE_VERSIONS = ("0.14.0", "0.19.0", "0.24.0")
"""The vLLM versions packaged profiles were fitted inside (aiconfigurator's
`aiconfigurator-vllm-<version>` tables in ../shared/gpu-measurements), oldest first: the
newest is last. A test checks this against the packaged files."""
DEFAULT_STEP_OVERHEAD_S = 1e-3
"""CPU work per engine step (scheduling, input preparation, sampling bookkeeping, graph
launch) that kernel measurements do not see. 1 ms is an assumption for a CUDA-graph
engine such as vLLM v1; engines without graphs measured several ms. Fit it from real runs
(`servelab validate --fit`) to replace it."""

NONE = "none"
"""The `--calibration` value that selects the bare roofline."""


@dataclass(frozen=True)
class CalibrationProfile:
    """What measurements taught the cost model about one GPU (and, optionally, a setup)."""

    device: str
    """GPU catalog name the kernel parameters were measured on (their efficiencies are
    fractions of its peaks)."""
    kernels: KernelParams
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    scales: dict[str, float] = field(default_factory=dict)
    """Per op class (`OP_CLASSES`) multiplier fitted to real runs; absent classes are 1."""
    source: dict[str, str] = field(default_factory=dict)
    """Provenance: project, data commit or date, engine and version, GPU as measured, and
    per kernel family which table it was fitted to (or which profile it was carried from)."""
    fit_stats: dict[str, float] = field(default_factory=dict)
    """How good the fit was (samples, held-out MAPE, ...)."""
    gpu_overrides: dict[str, float] = field(default_factory=dict)
    """Measured device figures replacing catalog ones (GPUSpec field -> value)."""
    model: str | None = None
    """The setup a run-fitted profile was measured on (None for kernel-level profiles)."""
    engine_version: str | None = None
    """The vLLM version the kernel tables were measured inside ("0.24.0"): kernel times of
    one GPU differ between versions. None: unknown (a run-fitted profile of another engine,
    a hand-written one)."""
    tp: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    notes: str = ""

    def __post_init__(self) -> None:
        _check_profile(self)

    def scale(self, op_class: str) -> float:
        return self.scales.get(op_class, 1.0)

    def setup_note(self, model: str, tp: int, weight_dtype: str, kv_dtype: str) -> str | None:
        """For a run-fitted profile (`model` set) priced on another setup, one line saying
        so: its step overhead and op-class scales were fitted to that setup's real runs and
        do not transfer (docs/validation.md); None where the setups agree or the profile is
        kernel-level."""
        if self.model is None:
            return None
        fitted = (self.model, self.tp, self.weight_dtype, self.kv_dtype)
        if fitted == (model, tp, weight_dtype, kv_dtype):
            return None
        show = lambda m, t, w, k: f"{m} at tp {t}, {w} weights, {k} KV"   # noqa: E731
        return (f"the calibration profile was fitted to real runs of {show(*fitted)}; this run "
                f"is {show(model, tp, weight_dtype, kv_dtype)}: its step overhead and op-class "
                "scales describe that setup, not this one")

    def with_fit(self, scales: dict[str, float], step_overhead_s: float,
                 fit_stats: dict[str, float], **setup) -> "CalibrationProfile":
        return replace(self, scales=dict(scales), step_overhead_s=step_overhead_s,
                       fit_stats=dict(fit_stats), **setup)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "device": self.device, "engine_version": self.engine_version,
                "model": self.model, "tp": self.tp,
                "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype,
                "step_overhead_s": self.step_overhead_s, "scales": dict(self.scales),
                "kernels": self.kernels.to_dict(), "source": dict(self.source),
                "fit_stats": dict(self.fit_stats), "gpu_overrides": dict(self.gpu_overrides),
                "notes": self.notes}

    @classmethod
    def from_dict(cls, data: dict, source: str = "calibration profile") -> "CalibrationProfile":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") == "servelab.calibration/1":
            raise ValueError(f"{source}: format servelab.calibration/1 (whole-op efficiencies) "
                             f"is retired; refit it with `servelab validate --fit` or "
                             f"`servelab calibrate --from-measurements`")
        if data.get("format") != FORMAT:
            raise ValueError(f"{source}: field 'format' must be {FORMAT!r}, got {data.get('format')!r}")
        check_known_keys(data, {f.name for f in fields(cls)} | {"format"}, f"{source}: unknown field(s)")
        for required in ("device", "kernels"):
            if required not in data:
                raise ValueError(f"{source}: missing field {required!r}")
        kernels = KernelParams.from_dict(data["kernels"], source=f"{source}: kernels")
        kwargs = {k: v for k, v in data.items() if k not in ("format", "kernels")}
        try:
            return cls(kernels=kernels, **kwargs)
        except (TypeError, ValueError) as exc:
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
        """Write the profile as JSON, atomically: an existing file is replaced whole or
        left as it was."""
        from servelab.atomic import write_atomic

        path = Path(path)
        write_atomic(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


def bare_roofline(device: str) -> CalibrationProfile:
    """Peaks reached by every kernel, no floors, no step overhead."""
    return CalibrationProfile(device=device, kernels=KernelParams.roofline(), step_overhead_s=0.0,
                              source={"project": "servelab", "data": "none: the bare roofline"})


def packaged_names() -> list[str]:
    folder = resources.files("servelab.simulator") / "data" / "calibration"
    return sorted(e.name[:-len(".json")] for e in folder.iterdir() if e.name.endswith(".json"))


@cache
def packaged(name: str) -> CalibrationProfile:
    """A profile shipped with servelab (`simulator/data/calibration/<name>.json`)."""
    entry = resources.files("servelab.simulator") / "data" / "calibration" / f"{name}.json"
    if not entry.is_file():
        raise ValueError(f"no packaged calibration profile {name!r}; packaged: "
                         f"{', '.join(packaged_names()) or 'none'}")
    return CalibrationProfile.from_dict(json.loads(entry.read_text()),
                                        source=f"calibration/{name}.json")


def load_profile(name_or_path: str | Path) -> CalibrationProfile:
    """A packaged profile by name, or a profile file."""
    if isinstance(name_or_path, str) and not name_or_path.endswith(".json") \
            and name_or_path in packaged_names():
        return packaged(name_or_path)
    return CalibrationProfile.load(name_or_path)


def resolve(gpu: GPUSpec | str, calibration: "CalibrationProfile | str | Path | None" = None,
            engine_version: str | None = None, *,
            engine_flag: str = "--engine vllm-{major_minor}") -> CalibrationProfile:
    """The profile that prices `gpu`: `calibration` as given (a profile, a file, a packaged
    name, or "none" for the bare roofline), else — with an `engine_version` — the packaged
    profile `profile_for` picks for that version, else the GPU's default
    (`GPUSpec.calibration`).

    A profile measured on another GPU is accepted only where the catalog says this GPU
    borrows it (H200 from H100: efficiencies are fractions of each GPU's own peaks). A
    chosen profile fitted inside another engine version than `engine_version` is an error
    (either one unknown, None, is accepted) naming the flag that chooses the profile's
    version, `engine_flag` formatted with it (`{version}`, `{major_minor}`)."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if engine_version is not None:
        version_key(engine_version, "engine version")
    if calibration is None:
        if engine_version is not None:
            return profile_for(spec, engine_version)[0]
        return load_profile(spec.calibration) if spec.calibration else bare_roofline(spec.name)
    if isinstance(calibration, CalibrationProfile):
        profile, label = calibration, "the calibration profile given"
    elif str(calibration) == NONE:
        return bare_roofline(spec.name)
    else:
        profile, label = load_profile(calibration), f"calibration profile {calibration}"
    lender = spec.name if profile.device == spec.name else _borrowed_device(spec)
    if profile.device not in (spec.name, lender):
        advice = (f"(whose catalog entry borrows {spec.calibration or 'no profile'}): fit one "
                  f"for {spec.name}" if lender != spec.name else
                  f"(which has its own, e.g. {spec.calibration}): leave the calibration out")
        raise ValueError(f"calibration profile is for device {profile.device!r}, not "
                         f"{spec.name!r} {advice}")
    if engine_version is not None and profile.engine_version is not None \
            and version_key(profile.engine_version) != version_key(engine_version):
        if not isinstance(calibration, CalibrationProfile) \
                and same_profile(calibration, packaged_choice(spec, engine_version)[0]):
            return profile   # the one leaving it out picks, carried over to this engine
        raise ValueError(f"{label} was fitted to kernels measured inside vLLM "
                         f"{profile.engine_version}, not the chosen engine's {engine_version}: "
                         f"leave the calibration out to use {_shown(packaged_choice(spec, engine_version)[0])}, "
                         f"or choose that engine ("
                         + engine_flag.format(version=profile.engine_version,
                                              major_minor=".".join(profile.engine_version.split(".")[:2]))
                         + ")")
    return profile


def same_profile(a: str | Path, b: str) -> bool:
    """Do two calibration arguments (packaged names or files) name the same profile?"""
    if str(a) == str(b):
        return True
    pa, pb = Path(a), Path(b)
    return pa.suffix == ".json" and pb.suffix == ".json" and pa.is_file() and pb.is_file() \
        and pa.resolve() == pb.resolve()


# ------------------------------------------------------------- engine-version resolution


def _shown(name: str) -> str:
    return "the bare roofline" if name == NONE else name


def version_key(version: str, what: str = "engine version") -> tuple[int, int, int]:
    """"0.24" or "0.24.0" -> (0, 24, 0), for comparing versions; ValueError otherwise."""
    parts = version.split(".") if isinstance(version, str) else []
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{what} must be a version such as 0.24.0, got {version!r}; "
                         f"packaged profiles exist for {', '.join(ENGINE_VERSIONS)}")
    numbers = [int(p) for p in parts] + [0] * (3 - len(parts))
    return numbers[0], numbers[1], numbers[2]


def _distance(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    return abs(a[0] - b[0]), abs(a[1] - b[1]) if a[0] == b[0] else 0, abs(a[2] - b[2])


@cache
def _packaged_versions() -> dict[str, dict[tuple[int, int, int], str]]:
    """Device -> {engine version -> packaged name}, for the kernel-level packaged profiles
    (read once: packaged data does not change)."""
    index: dict[str, dict[tuple[int, int, int], str]] = {}
    for name in packaged_names():
        profile = packaged(name)
        if profile.engine_version is None:
            continue
        key = version_key(profile.engine_version, f"calibration/{name}.json: engine_version")
        versions = index.setdefault(profile.device, {})
        if key in versions:
            raise ValueError(f"calibration/{name}.json and calibration/{versions[key]}.json are "
                             f"both {profile.device} at vLLM {profile.engine_version}")
        versions[key] = name
    return index


def _borrowed_device(spec: GPUSpec) -> str | None:
    """The measured GPU whose kernel parameters the catalog entry borrows (its own name
    where it has a profile of its own)."""
    if not spec.calibration:
        return None
    if spec.calibration in packaged_names() or spec.calibration.endswith(".json"):
        try:
            return load_profile(spec.calibration).device
        except ValueError:   # a GPU file's own profile not written yet: it lends nothing
            return None
    return spec.calibration


def _nearest(versions: dict[tuple[int, int, int], str], want: tuple[int, int, int]
             ) -> tuple[int, int, int]:
    """The version closest to `want` (major first, then minor, then patch); a tie goes to
    the newer one."""
    return min(versions, key=lambda v: (_distance(v, want), tuple(-x for x in v)))


def _fmt(key: tuple[int, int, int]) -> str:
    return ".".join(map(str, key))


def packaged_choice(spec: GPUSpec | str, engine_version: str) -> tuple[str, str]:
    """(packaged profile name, one line saying where it comes from): see `profile_for`.
    "none" where the GPU has no measured profile to use (the bare roofline)."""
    spec = get_gpu(spec) if isinstance(spec, str) else spec
    want = version_key(engine_version)
    if spec.calibration and spec.calibration.endswith(".json"):     # a file the GPU file names
        version = load_profile(spec.calibration).engine_version
        fitted = f"fitted inside vLLM {version}" if version else "engine version unknown"
        carried = "" if version is None or version_key(version) == want else \
            f"; carried over to vLLM {_fmt(want)}"
        return spec.calibration, (f"{spec.calibration} (the profile {spec.name}'s GPU file "
                                  f"names, {fitted}{carried})")
    index = _packaged_versions()
    own = index.get(spec.name, {})
    if want in own:
        return own[want], f"{spec.name} kernels measured inside vLLM {_fmt(want)}"
    if own:
        got = _nearest(own, want)
        return own[got], (f"carried over: no {spec.name} tables for vLLM {_fmt(want)}; "
                          f"{spec.name}'s vLLM {_fmt(got)} profile (nearest engine version "
                          f"measured on this GPU)")
    lender = _borrowed_device(spec)
    borrowed = index.get(lender, {}) if lender else {}
    if want in borrowed:
        return borrowed[want], (f"carried over: no {spec.name} tables; {lender}'s vLLM "
                                f"{_fmt(want)} profile ({spec.name} borrows {lender}'s, "
                                f"as its GPU file names)")
    if borrowed:
        got = _nearest(borrowed, want)
        return borrowed[got], (f"carried over: no {spec.name} tables, no {lender} tables for "
                               f"vLLM {_fmt(want)}; {lender}'s vLLM {_fmt(got)} profile "
                               f"(nearest engine version measured on the GPU {spec.name} "
                               f"borrows from)")
    if spec.calibration:          # a profile of unknown engine version: as the catalog says
        return spec.calibration, (f"{spec.calibration} (the catalog's profile for {spec.name}; "
                                  f"engine version unknown)")
    return NONE, f"the bare roofline: no measured kernels for {spec.name}"


def carried_over(spec: GPUSpec | str, engine_version: str) -> bool:
    """Whether `packaged_choice` prices `spec` under vLLM `engine_version` with kernels
    measured on another GPU or inside another engine version."""
    spec = get_gpu(spec) if isinstance(spec, str) else spec
    name = packaged_choice(spec, engine_version)[0]
    if name == NONE:
        return False
    profile = load_profile(name)
    return profile.device != spec.name or (
        profile.engine_version is not None
        and version_key(profile.engine_version) != version_key(engine_version))


def profile_for(spec: GPUSpec | str, engine_version: str) -> tuple[CalibrationProfile, str]:
    """The packaged profile that prices `spec` under vLLM `engine_version`, and one line
    saying where it comes from. A GPU file outside the package that names a profile file
    gets that file, whatever its version; otherwise, in order:

    1. the GPU's own profile fitted inside that version;
    2. else the GPU's own profile at the nearest version measured on it. Across engine
       versions one GPU's kernels moved little at the median (H100, vLLM 0.24 against
       0.14: 0.94-1.02 for BF16 attention and GEMMs, docs/fidelity.md) but much across
       architectures at one version (B200's decode attention is priced 65-95% slow at the
       median by H100's parameters, issue 33), so the GPU's own kernels at another
       version are the better guess;
    3. else the profile of the GPU its catalog entry borrows from (`GPUSpec.calibration`:
       the nearest measured architecture, e.g. h200 -> h100-sxm, rtx-4090 -> l40s) at that
       version, or at the nearest version measured on that GPU;
    4. else the bare roofline (a GPU whose catalog entry borrows nothing, e.g. `cpu`).

    "Nearest" compares major, then minor, then patch numbers; a tie goes to the newer
    version (an engine keeps a kernel backend it adopted more often than it reverts one).
    Efficiencies are fractions of each GPU's own peaks, so a carried-over profile prices
    the GPU's own datasheet figures."""
    name, line = packaged_choice(spec, engine_version)
    spec = get_gpu(spec) if isinstance(spec, str) else spec
    return (bare_roofline(spec.name) if name == NONE else load_profile(name)), line


def _check_profile(p: CalibrationProfile) -> None:
    if not isinstance(p.device, str) or not p.device:
        raise ValueError(f"field 'device' must be a non-empty string, got {p.device!r}")
    if p.model is not None and (not isinstance(p.model, str) or not p.model):
        raise ValueError(f"field 'model' must be a non-empty string or null, got {p.model!r}")
    if p.engine_version is not None:
        version_key(p.engine_version, "field 'engine_version'")
    if not isinstance(p.kernels, KernelParams):
        raise ValueError(f"field 'kernels' must be a KernelParams, got {type(p.kernels).__name__}")
    check_bounded("field 'tp'", p.tp, 1, integer=True, noun="an integer")
    for name in ("weight_dtype", "kv_dtype"):
        if getattr(p, name) not in DTYPE_BYTES:
            raise ValueError(f"field {name!r} must be one of {', '.join(DTYPE_BYTES)}, "
                             f"got {getattr(p, name)!r}")
    check_bounded("field 'step_overhead_s'", p.step_overhead_s, 0)
    unknown = sorted(set(p.scales) - set(OP_CLASSES)) if isinstance(p.scales, dict) else []
    if unknown:
        raise ValueError(f"field 'scales': unknown op class(es) {', '.join(unknown)}; "
                         f"known: {', '.join(OP_CLASSES)}")
    for name, kind in (("source", str), ("gpu_overrides", (int, float)), ("fit_stats", (int, float)),
                       ("scales", (int, float))):
        mapping = getattr(p, name)
        if not isinstance(mapping, dict) or not all(
                isinstance(k, str) and isinstance(v, kind) and not isinstance(v, bool)
                for k, v in mapping.items()):
            raise ValueError(f"field {name!r} must map names to "
                             f"{'strings' if kind is str else 'numbers'}, got {mapping!r}")
    for name, value in p.scales.items():
        if not 0 < value < math.inf:
            raise ValueError(f"field 'scales': {name} must be a finite number > 0, got {value!r}")
    if not isinstance(p.notes, str):
        raise ValueError(f"field 'notes' must be a string, got {p.notes!r}")
