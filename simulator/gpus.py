"""GPU catalog: the datasheet peaks a roofline cost model divides by.

Figures are dense (NVIDIA quotes "with sparsity" at 2×) and come from the vendor
datasheets as summarised in the shared REFERENCE.md. A peak is an upper bound, never a
prediction: the cost model multiplies each peak by an efficiency (see `calibration.py`).

Units are chosen so a reader can check them against a datasheet at a glance: TFLOP/s,
GB/s (10^9 bytes per second) and GB of memory. Link bandwidths are *per direction*, which is
what a ring collective or a one-way PCIe copy is limited by; NVIDIA quotes NVLink as a
bidirectional total, so the catalog stores half the quoted figure.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

GIB = 1 << 30

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
"""Bytes per element of the weight / KV-cache dtypes the cost model prices. fp32 is what
the real backend runs on a CPU; its GEMMs are priced at the `bf16_tflops` figure (see
`GPUSpec.peak_flops`)."""


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

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("GPUSpec.name must be a non-empty string")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name" or (value is None and f.name in ("fp8_tflops", "nvlink_gbps")):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GPUSpec({self.name}).{f.name} must be a positive number, "
                                 f"got {value!r}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GIB)

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
        known = {f.name for f in fields(self)} - {"name"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GPUSpec field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return replace(self, **values)


_CATALOG: dict[str, GPUSpec] = {
    # name: BF16 TFLOP/s, FP8 TFLOP/s, HBM GB/s, memory GB, NVLink GB/s per dir., PCIe GB/s per dir.
    "a100-80gb": GPUSpec("a100-80gb", 312.0, None, 2039.0, 80.0, 300.0, 32.0),   # NVLink3 600 bidir., Gen4
    "h100-sxm": GPUSpec("h100-sxm", 989.0, 1979.0, 3350.0, 80.0, 450.0, 64.0),   # NVLink4 900 bidir., Gen5
    "h200": GPUSpec("h200", 989.0, 1979.0, 4800.0, 141.0, 450.0, 64.0),          # H200 SXM
    "l40s": GPUSpec("l40s", 362.0, 733.0, 864.0, 48.0, None, 32.0),              # no NVLink, Gen4
    # HGX B200: NVLink5 1.8 TB/s bidir.; host link taken as Gen5 (the conservative reading
    # of "Gen5/6").
    "b200": GPUSpec("b200", 2250.0, 4500.0, 7700.0, 180.0, 900.0, 64.0),
    # A generic server CPU running the PyTorch reference path: an order-of-magnitude
    # placeholder (a few-core fp32/BF16 matmul, DDR bandwidth), meant to be replaced by a
    # probed figure (`servelab.validation.probe`, stored in CalibrationProfile.gpu_overrides).
    # It errs high on purpose: a fit bounds every efficiency by 1, so a peak below the
    # machine's would cap the fit. "Swap" is a memcpy here.
    "cpu": GPUSpec("cpu", 1.0, None, 50.0, 64.0, None, 20.0),
}


def gpu_names() -> list[str]:
    return sorted(_CATALOG)


def get_gpu(name: str) -> GPUSpec:
    """The catalog entry `name` (e.g. "h100-sxm"); unknown names list the known ones."""
    try:
        return _CATALOG[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown GPU {name!r}; the catalog has {', '.join(gpu_names())}") from None
