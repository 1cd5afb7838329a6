"""GPU catalog: the datasheet figures a roofline cost model divides by.

One JSON file per GPU in `simulator/data/gpus/<name>.json` is the whole entry: adding a
GPU is adding a file (see docs/extending.md). Figures are dense (NVIDIA quotes "with
sparsity" at 2×) and come from the vendor datasheets as summarised in the shared
REFERENCE.md. A peak is an upper bound, never a prediction: the cost model's kernel
parameters (`calibration.py`) say which fraction of it each kernel reaches.

Units are chosen so a reader can check them against a datasheet at a glance: TFLOP/s,
GB/s (10^9 bytes per second) and GB of memory. Link bandwidths are *per direction*, which is
what a ring collective or a one-way PCIe copy is limited by; NVIDIA quotes NVLink as a
bidirectional total, so the catalog stores half the quoted figure.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from functools import cache
from importlib import resources
from pathlib import Path

from servelab._validate import check_known_keys

GIB = 1 << 30

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
"""Bytes per element of the weight / KV-cache dtypes the cost model prices. fp32 is what
the real backend runs on a CPU; its GEMMs are priced at the `bf16_tflops` figure (see
`GPUSpec.peak_flops`)."""

_NUMBERS = ("bf16_tflops", "fp8_tflops", "hbm_bandwidth_gbps", "memory_gb", "nvlink_gbps",
            "pcie_gbps", "sm_count", "l2_mb", "host_memory_gb")
_OPTIONAL = ("fp8_tflops", "nvlink_gbps", "l2_mb", "host_memory_gb")


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    bf16_tflops: float
    """Dense BF16/FP16 tensor-core peak, TFLOP/s."""
    fp8_tflops: float | None
    """Dense FP8 peak, TFLOP/s; None where the GPU has no FP8 tensor cores (A100). FP8
    weights then run weight-only (dequantised to BF16 in the GEMM, as Marlin kernels do):
    half the weight bytes, BF16 compute."""
    hbm_bandwidth_gbps: float
    """Device-memory bandwidth, GB/s."""
    memory_gb: float
    """Device memory as the datasheet names it ("80 GB"). Those figures are binary in
    practice (an "80 GB" H100 reports ~79.2 GiB to CUDA), so `memory_bytes` reads them as GiB."""
    nvlink_gbps: float | None
    """NVLink bandwidth per direction, GB/s (half the bidirectional datasheet figure);
    None where the GPU has no NVLink, and tensor-parallel traffic then crosses PCIe."""
    pcie_gbps: float
    """Host link bandwidth per direction, GB/s: what a swap to or from CPU memory crosses."""
    sm_count: int = 1
    """Streaming multiprocessors: how many thread blocks run at once, one per SM (what
    decides whether a small kernel can use the whole chip)."""
    l2_mb: float | None = None
    """L2 cache in NVIDIA's megabytes, which are binary (A100: "40 MB" is 40,960 KB; the RTX
    PRO 6000's "128 MB" holds two 32,767-token sequences' KV, 134,213,632 bytes, which its
    measured decode kernel reads at L2 speed): `l2_bytes`."""
    host_memory_gb: float | None = None
    """Host (CPU) memory per GPU, GB (read as GiB, like `memory_gb`): the vendor reference
    server's system memory divided by its GPUs (DGX H100: 2 TB for 8). It bounds what a
    replica keeps in host memory: the CPU tier of the prefix cache (`--kv-offload-gb`)
    plus the swap pool may use at most this much per GPU of the replica. None: no bound
    known (nothing is checked)."""
    architecture: str = ""
    """GPU family ("ampere", "hopper", ...): which measured profile a GPU without
    measurements of its own borrows (see `calibration`)."""
    compute_capability: str = ""
    """CUDA compute capability ("9.0" for Hopper, "10.0" for B200, "12.0" for the RTX PRO
    6000; NVIDIA's CUDA GPU list, developer.nvidia.com/cuda-gpus): engines pick kernels and
    all-reduce paths by it (`kernels.movement.allreduce_time`). "" for a GPU that has none
    (the cpu entry) or a user's file that does not say: the all-reduce then takes the
    paths every GPU has."""
    calibration: str | None = None
    """Name of the packaged calibration profile this GPU uses by default (its own, or the
    nearest measured architecture's), or — in a GPU file outside the package — the path of
    a profile file (`servelab calibrate --out`), relative to the GPU file's folder; None:
    the bare roofline."""
    description: str = ""
    source: str = ""
    """Where the figures come from, and how a borrowed calibration is justified."""
    device_names: tuple[str, ...] = field(default=())
    """Regular expressions matched against `torch.cuda.get_device_name()` to recognise
    this GPU in a real run's metadata (and in measurement tables that name the device)."""
    aliases: tuple[str, ...] = field(default=())
    """Other names measurement sets use for this GPU, e.g. as folder names ("h100_sxm")."""
    price_per_hour_usd: float | None = None
    """On-demand rent of one GPU for an hour, US dollars: what `servelab plan` minimises
    (overridable with --gpu-price). None: no public price known (cpu)."""
    price_source: str = ""
    """Where the price comes from, and when it was read: cloud prices move."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("GPUSpec.name must be a non-empty string")
        for name in _NUMBERS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GPUSpec({self.name}).{name} must be a positive number, "
                                 f"got {value!r}")
        price = self.price_per_hour_usd
        if price is not None and (isinstance(price, bool) or not isinstance(price, (int, float))
                                  or not price > 0):
            raise ValueError(f"GPUSpec({self.name}).price_per_hour_usd must be a positive number "
                             f"or null, got {price!r}")
        cc = self.compute_capability
        if not isinstance(cc, str) or (cc and not re.fullmatch(r"\d+\.\d+", cc)):
            raise ValueError(f"GPUSpec({self.name}).compute_capability must be a string like "
                             f"\"9.0\" (or empty), got {cc!r}")
        if isinstance(self.sm_count, float) and not self.sm_count.is_integer():
            raise ValueError(f"GPUSpec({self.name}).sm_count must be an integer, got {self.sm_count!r}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GIB)

    @property
    def l2_bytes(self) -> float:
        """L2 capacity in bytes (0 where unknown)."""
        return (self.l2_mb or 0.0) * 1024 * 1024

    @property
    def interconnect_gbps(self) -> float:
        """Per-direction bandwidth tensor-parallel collectives run over."""
        return self.nvlink_gbps if self.nvlink_gbps is not None else self.pcie_gbps

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of a GEMM whose inputs are `dtype` ("bf16"/"fp16"/"fp8"/"fp32").

        fp32 is priced at the `bf16_tflops` figure: on the cpu entry that figure *is* the
        fp32 matmul rate (what `probe.py` measures); on a GPU it overstates plain fp32
        (H100: 67 of 989 TFLOP/s), which a calibrated compute efficiency absorbs. A GPU
        fp32 run is a debugging configuration, not a serving one."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
        if dtype == "fp8" and self.fp8_tflops is not None:
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12

    def with_overrides(self, **values: float) -> "GPUSpec":
        """A copy with measured figures replacing datasheet ones (e.g. a probed CPU)."""
        known = set(_NUMBERS)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GPUSpec field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return replace(self, **values)

    def matches_device_name(self, device_name: str) -> bool:
        return any(re.search(p, device_name) for p in self.device_names)

    def known_as(self, name: str) -> bool:
        """Whether a measurement set's name for a GPU (a folder, a file prefix) is this one."""
        name = name.lower()
        return name == self.name or name in self.aliases

    @classmethod
    def from_dict(cls, data: dict, source: str = "GPU spec") -> "GPUSpec":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        check_known_keys(data, {f.name for f in fields(cls)}, f"{source}: unknown field(s)")
        missing = sorted({"name", "bf16_tflops", "hbm_bandwidth_gbps", "memory_gb",
                          "pcie_gbps", "sm_count"} - set(data))
        if missing:
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        if data.get("architecture") != "cpu":
            _check_units(data, source)
        kwargs = dict(data)
        for key in ("device_names", "aliases"):
            value = kwargs.get(key, [])
            if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
                raise ValueError(f"{source}: {key!r} must be a list of strings")
            kwargs[key] = tuple(value)
        names = kwargs["device_names"]
        for pattern in names:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{source}: bad device_names pattern {pattern!r}: {exc}") from None
        kwargs.setdefault("fp8_tflops", None)
        kwargs.setdefault("nvlink_gbps", None)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None


_UNIT_BOUNDS = {"bf16_tflops": (1.0, 1e5, "TFLOP/s", "a datasheet's 989 TFLOPS is 989"),
                "fp8_tflops": (1.0, 1e5, "TFLOP/s", "a datasheet's 1,979 TFLOPS is 1979"),
                "hbm_bandwidth_gbps": (20.0, 1e6, "GB/s", "a datasheet's 3.35 TB/s is 3350"),
                "memory_gb": (1.0, 1e5, "GB", "an 80 GB GPU is 80"),
                "pcie_gbps": (1.0, 1e4, "GB/s", "PCIe Gen5 x16 is 64"),
                "nvlink_gbps": (1.0, 1e5, "GB/s", "H100's NVLink 4 is 450 per direction"),
                "l2_mb": (0.1, 1e5, "MB", "H100's 50 MB L2 is 50"),
                "host_memory_gb": (1.0, 1e6, "GB", "a DGX H100's 2 TB over 8 GPUs is 256")}
"""Plausible ranges of a GPU file's figures in their units, so that a figure in another
unit (TB/s for GB/s, bytes for GB) is refused rather than priced: far wider than any GPU
(the catalog's span 24-288 GB, 165-5,000 TFLOP/s, 864-8,000 GB/s, 40-128 MB of L2, 300-900
GB/s of NVLink, 64-512 GB of host memory per GPU), only not by 1,000x."""


def _check_units(data: dict, source: str) -> None:
    for name, (low, high, unit, example) in _UNIT_BOUNDS.items():
        value = data.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 \
                and not low <= value <= high:
            raise ValueError(f"{source}: {name} is in {unit} ({example}); {value:g} is outside "
                             f"{low:g}-{high:g}: a figure in another unit?")


def _catalog_folder():
    return resources.files("servelab.simulator") / "data" / "gpus"


@cache
def _catalog() -> dict[str, GPUSpec]:
    """Every packaged GPU file, read once (the catalog is immutable data)."""
    specs: dict[str, GPUSpec] = {}
    for entry in sorted(_catalog_folder().iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        spec = GPUSpec.from_dict(json.loads(entry.read_text()), source=f"gpus/{entry.name}")
        if spec.name != entry.name[:-len(".json")]:
            raise ValueError(f"gpus/{entry.name}: 'name' must match the file name, got {spec.name!r}")
        specs[spec.name] = spec
    return specs


def gpu_names() -> list[str]:
    return sorted(_catalog())


def get_gpu(name: str) -> GPUSpec:
    """The catalog entry `name` (e.g. "h100-sxm") or a GPU spec JSON file's path; unknown
    names list the known ones."""
    catalog = _catalog()
    if isinstance(name, str) and name in catalog:
        return catalog[name]
    if isinstance(name, str) and name.endswith(".json"):
        path = Path(name)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read GPU spec {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        calibration = data.get("calibration") if isinstance(data, dict) else None
        if isinstance(calibration, str) and calibration.endswith(".json"):
            data = {**data, "calibration": str(path.parent / calibration)}   # beside the file
        return GPUSpec.from_dict(data, source=str(path))
    raise ValueError(f"unknown GPU {name!r}; the catalog has {', '.join(gpu_names())} "
                     f"(or pass a GPU spec .json file)")


def gpu_for_device_name(device_name: str) -> str | None:
    """The catalog GPU whose `device_names` match a CUDA device name; None if none does."""
    for spec in _catalog().values():
        if spec.matches_device_name(device_name):
            return spec.name
    return None
