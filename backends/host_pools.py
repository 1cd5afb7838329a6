"""Host memory of a real run: the CPU tier's size in blocks, and whether the host pools fit.

A real run keeps up to three KV pools in host memory: on a CPU the device pool itself, the
swap pool (`--cpu-kv-blocks`) and the CPU tier of the prefix cache (`--kv-offload-gb`,
pinned on CUDA). The machine is the one the run is on, so the bound is the memory it has
available now, not the catalog's reference server (`servelab.host_memory`, which the
simulator uses). Errors are ValueErrors, one line each, raised before anything is allocated.
"""
from __future__ import annotations

import os

import torch

from servelab.config import CacheConfig
from servelab.host_memory import GIB, host_tier_blocks as tier_blocks
from servelab.models import ModelSpec

__all__ = ["available_host_bytes", "check_host_memory", "host_tier_blocks"]


def host_tier_blocks(kv_offload_gb: float, spec: ModelSpec, dtype: torch.dtype,
                     block_size: int) -> int:
    """Blocks of a CPU tier of `kv_offload_gb` GiB; ValueError when not one fits."""
    elem = torch.empty((), dtype=dtype).element_size()
    block_bytes = spec.kv_bytes_per_token(elem) * block_size
    blocks = tier_blocks(kv_offload_gb, block_bytes)
    if not blocks:
        raise ValueError(f"--kv-offload-gb {kv_offload_gb:g} holds no KV block: one block of "
                         f"{spec.name} in {str(dtype).removeprefix('torch.')} takes "
                         f"{block_bytes / 2**20:.3g} MiB ({block_size} tokens)")
    return blocks


def available_host_bytes() -> int | None:
    """Host memory available now (Linux's MemAvailable: free plus reclaimable page cache),
    or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _pinned(pool_bytes: int) -> int:
    """Host memory a pinned pool takes: its K and V tensors, each rounded up to a power
    of two by torch's caching host allocator (`pin_memory=True`)."""
    half = pool_bytes // 2
    return 2 * (1 << (half - 1).bit_length()) if half else 0


def check_host_memory(spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                      cache: CacheConfig, kv_offload_gb: float) -> None:
    """Refuse a run whose host allocations cannot fit in the memory available now (the
    kernel would kill the process mid-allocation, or pinning would fail): on a CPU the
    weights and every KV pool, on CUDA the swap pool and the CPU tier of the prefix cache,
    pinned (see `_pinned`). A no-op where the available memory cannot be read."""
    available = available_host_bytes()
    if available is None:
        return
    elem = torch.empty((), dtype=dtype).element_size()
    block_bytes = spec.kv_bytes_per_token(elem) * cache.block_size
    parts = {"weights": spec.num_params * elem, "KV pool": cache.num_gpu_blocks * block_bytes} \
        if device.type == "cpu" else {}
    pooled = _pinned if device.type == "cuda" else (lambda nbytes: nbytes)
    parts["swap pool"] = pooled(cache.num_cpu_blocks * block_bytes)
    parts["CPU tier"] = pooled(cache.num_host_blocks * block_bytes)
    needed = sum(parts.values())
    if needed <= available:
        return
    what = " + ".join(f"{name} {size / GIB:.1f}" for name, size in parts.items() if size)
    lead = f"--kv-offload-gb {kv_offload_gb:g}: " if kv_offload_gb else ""
    raise ValueError(f"{lead}{spec.name} in {str(dtype).removeprefix('torch.')} on {device} "
                     f"needs {needed / GIB:.1f} GiB of host memory ({what} GiB), "
                     f"{available / GIB:.1f} GiB is available")
