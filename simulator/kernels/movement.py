"""Kernels that only move data: element-wise ops, all-reduces, all-to-alls, host copies."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servelab.simulator.gpus import GPUSpec
from servelab.simulator.kernels.base import _Params

# ------------------------------------------------------------------------- element-wise


@dataclass(frozen=True, slots=True)
class ElementwiseParams(_Params):
    """Bandwidth-bound kernels: norms, rotary, activation, KV-cache writes, embedding."""

    floor_s: float = 0.0
    """Seconds no element-wise kernel beats (launch and one wave of thread blocks)."""
    memory_eff: float = 1.0
    """Fraction of HBM bandwidth a large element-wise kernel reaches."""

    _fractions = ("memory_eff",)

    def __post_init__(self) -> None:
        self._check()


def elementwise_time(nbytes, gpu: GPUSpec, p: ElementwiseParams):
    """Seconds of one element-wise kernel moving `nbytes` (read + written); 0 for 0."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    return np.where(nbytes > 0, p.floor_s + nbytes / (gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff),
                    0.0)


# --------------------------------------------------------------------------- collectives


@dataclass(frozen=True, slots=True)
class CollectiveParams(_Params):
    """All-reduce across the tensor-parallel GPUs of one node.

    As engines ship it: a custom all-reduce for small messages (vLLM uses it up to
    `custom_max_bytes`, and without NVLink only between `pcie_custom_max_gpus` GPUs, the
    pair a PCIe switch connects peer to peer), in two flavours — one-shot (every GPU reads
    all its peers' whole buffers: (n-1) x the message, one synchronisation) and two-shot
    (reduce-scatter then all-gather: 2(n-1)/n of it, a second synchronisation) — of which
    the faster is taken, as the engine's size thresholds pick; a ring (NCCL) otherwise,
    moving 2(n-1)/n of the message per GPU. Without NVLink a group larger than a switch's
    pair sends every GPU's share across the host's fabric, which `fabric_gbps` caps."""

    custom_latency_s: float = 0.0
    """Seconds of a small custom all-reduce: launch plus a barrier over the peers."""
    two_shot_s: float = 0.0
    """Extra seconds of the two-shot flavour's second phase (one more barrier)."""
    custom_link_eff: float = 1.0
    """Fraction of per-direction link bandwidth the custom all-reduce moves data at."""
    ring_latency_s: float = 0.0
    """Fixed seconds of a ring all-reduce (launch, channel setup)."""
    ring_link_eff: float = 1.0
    """Bus bandwidth of the ring as a fraction of the per-direction link figure."""
    hop_s: float = 0.0
    """Extra seconds per additional GPU in the group (one more synchronisation step)."""
    fabric_gbps: float = 0.0
    """GB/s of the shared host fabric (PCIe switches, the socket link) that the ring
    traffic of all GPUs without NVLink crosses; 0 where GPUs talk over NVLink."""
    custom_max_bytes: float = 8 * 1024 * 1024
    """Largest message the engine sends through the custom all-reduce (vLLM: 8 MiB);
    an engine setting, not a fitted one."""
    pcie_custom_max_gpus: float = 2
    """Most GPUs the engine runs the custom all-reduce across without NVLink (vLLM: 2);
    an engine setting."""

    _fractions = ("custom_link_eff", "ring_link_eff")

    def __post_init__(self) -> None:
        self._check()


def allreduce_time(nbytes, num_gpus, gpu: GPUSpec, p: CollectiveParams):
    """Seconds of one all-reduce of `nbytes` per GPU over `num_gpus` GPUs (0 for one)."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n = np.asarray(num_gpus, dtype=np.float64)
    link = gpu.interconnect_gbps * 1e9
    moved = 2.0 * (n - 1) / np.maximum(n, 1)       # bus bytes per message byte
    ring_bw = link * p.ring_link_eff
    if gpu.nvlink_gbps is None and p.fabric_gbps:
        ring_bw = np.where(n > p.pcie_custom_max_gpus,
                           np.minimum(ring_bw, p.fabric_gbps * 1e9 / np.maximum(n - 1, 1)), ring_bw)
    custom_bw = link * p.custom_link_eff
    sync = p.custom_latency_s + (n - 1) * p.hop_s
    one_shot = sync + nbytes * (n - 1) / custom_bw
    two_shot = sync + p.two_shot_s + nbytes * moved / custom_bw
    custom = np.minimum(one_shot, two_shot)
    ring = p.ring_latency_s + (n - 1) * p.hop_s + nbytes * moved / ring_bw
    use_custom = nbytes <= p.custom_max_bytes
    if gpu.nvlink_gbps is None:
        use_custom = use_custom & (n <= p.pcie_custom_max_gpus)
    t = np.where(use_custom, custom, ring)
    return np.where((n > 1) & (nbytes > 0), t, 0.0)


@dataclass(frozen=True, slots=True)
class AllToAllParams(_Params):
    """NCCL all-to-all inside one node: what expert parallelism's dispatch and combine use.

    Each GPU sends 1/n of its buffer to every GPU of the group (itself included), so
    (n-1)/n of it crosses its link (nccl-tests' bus-bandwidth convention for alltoall,
    its PERFORMANCE.md). Without NVLink every GPU's share crosses the host's PCIe fabric
    at once, which `fabric_gbps` caps."""

    latency_s: float = 0.0
    """Fixed seconds of one all-to-all (launch, channel setup)."""
    hop_s: float = 0.0
    """Extra seconds per additional GPU (one more peer to exchange with)."""
    link_eff: float = 1.0
    """Bus bandwidth as a fraction of the per-direction link figure."""
    fabric_gbps: float = 0.0
    """GB/s of the shared host fabric all GPUs' traffic crosses without NVLink; 0 where
    GPUs talk over NVLink."""
    pcie_direct_max_gpus: float = 2
    """Most GPUs that exchange peer to peer under one PCIe switch without crossing the host
    fabric (the pair, as for `CollectiveParams.pcie_custom_max_gpus`); a topology setting."""

    _fractions = ("link_eff",)

    def __post_init__(self) -> None:
        self._check()


def alltoall_time(nbytes, num_gpus, gpu: GPUSpec, p: AllToAllParams):
    """Seconds of one all-to-all of `nbytes` per GPU (its whole send buffer) over
    `num_gpus` GPUs (0 for one GPU or no bytes).

    Expert-parallel dispatch sends each token's hidden state to the GPUs of its top-k
    experts and combine sends the results back: with balanced routing about
    tokens_per_gpu x top-k x hidden x bytes each way."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n = np.asarray(num_gpus, dtype=np.float64)
    moved = nbytes * (n - 1) / np.maximum(n, 1)
    t = moved / (gpu.interconnect_gbps * 1e9 * p.link_eff)
    if gpu.nvlink_gbps is None and p.fabric_gbps:
        t = np.where(n > p.pcie_direct_max_gpus,
                     np.maximum(t, n * moved / (p.fabric_gbps * 1e9)), t)
    t = p.latency_s + (n - 1) * p.hop_s + t
    return np.where((n > 1) & (nbytes > 0), t, 0.0)


# ----------------------------------------------------------------------------- host link


@dataclass(frozen=True, slots=True)
class HostLinkParams(_Params):
    """Copies between GPU memory and pinned host memory (swap, a CPU prefix-cache tier)."""

    latency_s: float = 0.0
    """Fixed seconds of one batched copy (launch, DMA setup)."""
    link_eff: float = 1.0
    """Fraction of per-direction PCIe bandwidth a pinned copy of KV blocks reaches."""

    _fractions = ("link_eff",)

    def __post_init__(self) -> None:
        self._check()


def host_copy_time(nbytes, gpu: GPUSpec, p: HostLinkParams):
    nbytes = np.asarray(nbytes, dtype=np.float64)
    return np.where(nbytes > 0, p.latency_s + nbytes / (gpu.pcie_gbps * 1e9 * p.link_eff), 0.0)
