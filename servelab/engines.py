"""Engine presets: the serving engine a run mirrors, its defaults, and the kernels that price it.

A user compares servelab with the engine they run, so the same flags must mean the same
engine. A preset names one engine version and supplies every default that engine would
use for a flag the user did not give:

    preset = get_preset("vllm-0.24")
    preset.defaults(device_memory_bytes=80 * GIB, device_name="h100-sxm")
    # {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "chunked_prefill": "budget", ...}

`engine_version` selects the calibration profiles fitted to kernels measured inside that
engine (`simulator/calibration.py`); `None` keeps each GPU's catalog profile.

vLLM's defaults below are read from its source (vLLM V1, `vllm/engine/arg_utils.py`:
`EngineArgs.get_batch_defaults` and `_set_default_args`; `vllm/config/scheduler.py`;
`vllm/config/cache.py`; `vllm/v1/core/kv_cache_manager.py`), as summarised in the shared
REFERENCE.md ("Engine defaults"). The three vLLM presets share V1's scheduler defaults —
they were not re-read tag by tag, only on the current source — and differ in the kernel
tables that price them. Pure standard library.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30

BUDGET = "budget"
"""`chunked_prefill` value meaning: one prefill may take the whole step token budget
(vLLM V1: `long_prefill_token_threshold` 0), i.e. the chunk cap equals
`max_num_batched_tokens` whatever that is set to."""


@dataclass(frozen=True)
class EnginePreset:
    name: str
    engine_version: str | None
    """Engine version whose measured kernels price the run (a `calibration` engine
    version, e.g. "0.24.0"); None: each GPU's catalog profile."""
    description: str
    chunked_prefill: int | str | None
    """Largest prefill chunk per sequence and step: tokens, `BUDGET`, or None (off)."""
    enable_prefix_caching: bool
    watermark: float
    preemption: str
    gpu_memory_utilization: float
    block_size: int
    large_gpu_batch: tuple[int, int] | None
    """(max_num_batched_tokens, max_num_seqs) on a GPU of >= 70 GiB other than an A100
    (vLLM: "GPUs like H100 and MI300x"); None: the same as `batch` everywhere."""
    batch: tuple[int, int]
    """(max_num_batched_tokens, max_num_seqs) elsewhere, and where the device is unknown."""
    async_scheduling: bool = False
    """The engine schedules the next batch while the current one runs, so a request that
    arrives during a step waits one more step (`simulator/async_scheduling.py`). vLLM
    turns it on by default from 0.14 where nothing incompatible is configured
    (`VllmConfig.__post_init__`, `vllm/config/vllm.py`; vLLM PR #27614, listed in its
    "Async Scheduling Plan", issue #27679; PR #31998 of 2026-01-08 extends the default
    to EAGLE/MTP speculation, saying it was already on otherwise). The recorded vLLM
    0.19 run in `../shared/real-runs/.../RTX4090/Llama-3.1-8B` resolves
    `scheduler_config.async_scheduling: true` without the flag being given."""

    def batch_defaults(self, device_memory_bytes: int, device_name: str) -> tuple[int, int]:
        """vLLM's `EngineArgs.get_batch_defaults` for the OpenAI API server (`vllm serve`):
        8192 tokens and 1024 sequences when the device has >= 70 GiB and is not an A100 (a
        large budget cut an A100's throughput, vLLM PR #17885), else 2048 and 256."""
        if self.large_gpu_batch is not None and device_memory_bytes >= 70 * GIB \
                and "a100" not in device_name.lower():
            return self.large_gpu_batch
        return self.batch

    def defaults(self, device_memory_bytes: int, device_name: str) -> dict:
        """Every default this engine gives, keyed by the config field it sets."""
        tokens, seqs = self.batch_defaults(device_memory_bytes, device_name)
        return {"max_num_seqs": seqs, "max_num_batched_tokens": tokens,
                "chunked_prefill": self.chunked_prefill,
                "enable_prefix_caching": self.enable_prefix_caching,
                "watermark": self.watermark, "preemption": self.preemption,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "block_size": self.block_size, "async_scheduling": self.async_scheduling}

    def describe(self) -> str:
        return f"{self.name} ({self.description})"


def _vllm(version: str) -> EnginePreset:
    major_minor = version.rsplit(".", 1)[0]
    return EnginePreset(
        name=f"vllm-{major_minor}", engine_version=version,
        description=f"vLLM {major_minor} V1 defaults: one prefill may take the whole token budget, "
                    "prefix caching on, recompute preemption, no watermark, asynchronous "
                    f"scheduling; priced by kernels measured inside vLLM {version}",
        chunked_prefill=BUDGET, enable_prefix_caching=True, watermark=0.0,
        preemption="recompute", gpu_memory_utilization=0.9, block_size=16,
        large_gpu_batch=(8192, 1024), batch=(2048, 256), async_scheduling=True)


SERVELAB = EnginePreset(
    name="servelab", engine_version=None,
    description="servelab's own defaults: prefill chunks capped at 512 tokens, prefix caching "
                "off, a 1% block watermark (vLLM v0's), 128 sequences and 2048 tokens per step; "
                "priced by each GPU's catalog profile",
    chunked_prefill=512, enable_prefix_caching=False, watermark=0.01, preemption="recompute",
    gpu_memory_utilization=0.9, block_size=16, large_gpu_batch=None, batch=(2048, 128))

PRESETS: dict[str, EnginePreset] = {p.name: p for p in (
    _vllm("0.14.0"), _vllm("0.19.0"), _vllm("0.24.0"), SERVELAB)}
DEFAULT_ENGINE = "vllm-0.24"
"""The newest engine with measured kernels (`../shared/gpu-measurements`)."""


def engine_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> EnginePreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(PRESETS)}") from None
