"""A short probe of this machine's CPU: the peaks the cost model's cpu entry divides by.

    probe = probe_cpu()                      # ~0.1–0.3 s
    gpu = get_gpu("cpu").with_overrides(**probe.gpu_overrides())

The catalog's cpu entry is an order-of-magnitude placeholder; a CPU run of the real
backend (the PyTorch reference path) is better priced against what this machine does:

- compute: the best of a few timed square matmuls (2·n³ FLOPs each) in the run's dtype
  (fp32 by default), the rate a large GEMM reaches with the current thread setting — the
  CPU's practical peak, as a datasheet figure is a GPU's;
- memory: the best of a few copies of a buffer far larger than the last-level cache
  (read + write = 2 × its size in bytes per copy).

Best-of-k, not mean: the machine may be shared, and a peak is what an unhindered run
reaches. The probe uses torch when importable (the real backend's own kernels and thread
pool), numpy otherwise. It reads a clock — it is a measurement — so nothing calls it
implicitly; `servelab validate` runs it for CPU runs and records the figures it used.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["CPUProbe", "probe_cpu"]

_TORCH_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CPUProbe:
    matmul_flops_per_s: float
    copy_bytes_per_s: float
    dtype: str
    """The matmul's dtype (torch's name: float32, bfloat16, float16)."""
    library: str
    """"torch" or "numpy": whose kernels were timed."""
    threads: int | None
    """torch's intra-op thread count during the probe (None with numpy)."""
    matmul_size: int
    copy_bytes: int

    def gpu_overrides(self) -> dict[str, float]:
        """GPUSpec fields for the cpu entry: the matmul rate as its GEMM peak (the cost
        model prices every CPU dtype at `bf16_tflops`), the copy rate as its memory
        bandwidth and as its "PCIe" (a swap is a host memcpy)."""
        gbps = self.copy_bytes_per_s / 1e9
        return {"bf16_tflops": self.matmul_flops_per_s / 1e12, "hbm_bandwidth_gbps": gbps,
                "pcie_gbps": gbps}

    def to_dict(self) -> dict:
        return {"matmul_gflops": self.matmul_flops_per_s / 1e9,
                "copy_gbps": self.copy_bytes_per_s / 1e9, "dtype": self.dtype,
                "library": self.library,
                "threads": self.threads, "matmul_size": self.matmul_size,
                "copy_bytes": self.copy_bytes}


def probe_cpu(dtype: str = "float32", matmul_size: int = 384, copy_mib: int = 64,
              repeats: int = 5, use_torch: bool | None = None) -> CPUProbe:
    """Time `repeats` `dtype` matmuls of `matmul_size`² and copies of `copy_mib` MiB; keep
    the best of each. Defaults cost ~0.3 s on one loaded core, mostly the copies.
    Without torch (numpy) only float32 is available."""
    if matmul_size < 16 or copy_mib < 1 or repeats < 1:
        raise ValueError(f"probe_cpu needs matmul_size >= 16, copy_mib >= 1, repeats >= 1; got "
                         f"{matmul_size}, {copy_mib}, {repeats}")
    if use_torch is None:
        try:
            import torch  # noqa: F401
            use_torch = True
        except ImportError:
            use_torch = False
    n, nbytes = matmul_size, copy_mib * 2**20
    if use_torch:
        import torch

        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"probe dtype must be one of {', '.join(_TORCH_DTYPES)}, got {dtype!r}")
        kind = getattr(torch, dtype)
        a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(kind)
        b = torch.randn(n, n, generator=torch.Generator().manual_seed(1)).to(kind)
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        matmul, copy = (lambda: torch.mm(a, b)), (lambda: dst.copy_(src))
        library, threads = "torch", torch.get_num_threads()
    else:
        import numpy as np

        if dtype != "float32":
            raise ValueError(f"the numpy probe times float32 only, got {dtype!r}")
        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        src = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.empty_like(src)
        matmul, copy = (lambda: a @ b), (lambda: np.copyto(dst, src))
        library, threads = "numpy", None
    matmul()   # warm: page in, pick kernels, spin up the pool
    copy()
    t_mm = _best_of(matmul, repeats)
    t_copy = _best_of(copy, repeats)
    return CPUProbe(2.0 * n ** 3 / t_mm, 2.0 * nbytes / t_copy, dtype, library, threads, n,
                    nbytes)


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)
