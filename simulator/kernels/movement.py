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


MIB = 1024 * 1024

CUSTOM_ONE_STAGE_BELOW = {4: 512 * 1024, 8: 256 * 1024}
"""vLLM's custom all-reduce runs its one-stage kernel (every GPU reads every peer's whole
buffer) below these message sizes for groups of up to 4 and up to 8 GPUs, and for any size
between 2 GPUs; its two-stage kernel (reduce-scatter, then all-gather) otherwise
(`csrc/custom_all_reduce.cuh`, `allreduce()`: the same thresholds in every copy of the
file read, old and new)."""

CUSTOM_MAX_WITH_SYMM_MEM = {
    "9.0": {2: 64 * MIB, 4: 32 * MIB, 6: MIB // 2, 8: MIB // 4},
    "10.0": {2: 2 * MIB, 4: 2 * MIB, 6: MIB, 8: MIB},
    "10.3": {2: 4 * MIB, 4: 4 * MIB, 6: 8 * MIB, 8: 4 * MIB},
}
"""Largest message (exclusive) vLLM sends through its custom all-reduce, by compute
capability and group size, when PyTorch symmetric memory is on; never above the custom
all-reduce's own 8 MiB buffer (`CollectiveParams.custom_max_bytes`). vLLM's
`distributed/device_communicators/all_reduce_utils.py`, `CUSTOM_ALL_REDUCE_MAX_SIZES` (the
"10.3" row from its 2026 main branch)."""

SYMM_MEM_MAX = {
    "9.0": {2: 64 * MIB, 4: 32 * MIB, 6: 64 * MIB, 8: 64 * MIB},
    "10.0": {2: 8 * MIB, 4: 32 * MIB, 6: 128 * MIB, 8: 128 * MIB},
    "10.3": {2: 4 * MIB, 4: 32 * MIB, 6: 32 * MIB, 8: 64 * MIB},
}
"""Largest message (inclusive: vllm#42993, 2026-05-18; exclusive before) that goes through
PyTorch symmetric memory after the custom all-reduce declines it; larger ones go to NCCL.
Same file, `SYMM_MEM_ALL_REDUCE_MAX_SIZES`; a GPU whose capability is not listed (A100,
L40S, RTX PRO 6000) never takes this path."""

CUSTOM_GROUPS = (2, 4, 6, 8)
"""Group sizes vLLM's custom all-reduce supports (`custom_all_reduce.py`)."""


@dataclass(frozen=True, slots=True)
class CollectiveParams(_Params):
    """All-reduce across the tensor-parallel GPUs of one node, routed as vLLM routes it
    (`CudaCommunicator.all_reduce`), first path that takes the message:

    1. its custom all-reduce, below `custom_max_bytes` (8 MiB; lower with symmetric memory
       on, `CUSTOM_MAX_WITH_SYMM_MEM`) and, without NVLink, only between
       `pcie_custom_max_gpus` GPUs (the pair a PCIe switch connects peer to peer): one-stage
       (each GPU reads all its peers' whole buffers: (n-1) x the message, one barrier) or
       two-stage (reduce-scatter then all-gather: 2(n-1)/n of it, a second barrier) by
       vLLM's size thresholds (`CUSTOM_ONE_STAGE_BELOW`);
    2. with `symm_mem` on and an NVSwitch (multicast), PyTorch symmetric memory up to
       `SYMM_MEM_MAX`: its multicast kernel (`multimem_all_reduce_`, where the switch
       reduces and each GPU's link carries the message once each way) for the group sizes
       vLLM lists (`symm_mem.py`, `_WORLD_SIZES_MULTIMEM`: 4, 6, 8 on Hopper; 6, 8 on
       Blackwell), its two-shot kernel for the others. Both are priced as one message per
       GPU at one bandwidth: measured, the two-shot kernel does not pay the 2(n-1)/n a
       reduce-scatter plus all-gather moves (B200 under vLLM 0.24: 250 GB/s of message at
       2 GPUs, 332 at 4, 302 for the multicast kernel at 8; H100: 223 at 2, 182 and 202
       for the multicast kernel at 4 and 8);
    3. an NCCL ring, moving 2(n-1)/n of the message per GPU. Without NVLink a group larger
       than a switch's pair sends every GPU's share across the host's fabric, which
       `fabric_gbps` caps."""

    custom_latency_s: float = 0.0
    """Seconds of a small custom all-reduce: launch plus a barrier over the peers."""
    two_shot_s: float = 0.0
    """Extra seconds of the two-stage custom kernel (its second barrier)."""
    two_shot_hop_s: float = 0.0
    """Extra seconds of the two-stage kernel per additional GPU: its barriers wait on every
    peer's flag twice (measured: its fixed cost over the one-stage kernel's is about twice
    as large at 8 GPUs as at 4, on A100, H100 and B200)."""
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
    symm_latency_s: float = 0.0
    """Fixed seconds of a symmetric-memory all-reduce (the copy into its buffer, launch,
    barrier)."""
    symm_link_eff: float = 1.0
    """Fraction of per-direction link bandwidth the symmetric-memory kernels move data at."""
    custom_max_bytes: float = 8 * 1024 * 1024
    """Largest message (exclusive) the engine sends through the custom all-reduce (vLLM:
    8 MiB, its buffer); an engine setting, not a fitted one."""
    pcie_custom_max_gpus: float = 2
    """Most GPUs the engine runs the custom all-reduce across without NVLink (vLLM: 2);
    an engine setting."""
    symm_mem: float = 0.0
    """1: the engine sends mid-size all-reduces through PyTorch symmetric memory (vLLM's
    `VLLM_ALLREDUCE_USE_SYMM_MEM`: off by default from vllm#26925, 2025-10-15, on again
    by 0.24); 0: custom all-reduce, then NCCL. An engine setting, which the fit reads
    from the tables (`validation.kernel_families`: it tries both)."""

    _fractions = ("custom_link_eff", "ring_link_eff", "symm_link_eff")
    _added = ("two_shot_hop_s", "symm_latency_s", "symm_link_eff", "symm_mem")

    def __post_init__(self) -> None:
        self._check()
        if self.symm_mem not in (0.0, 1.0):
            raise ValueError(f"CollectiveParams.symm_mem must be 0 or 1, got {self.symm_mem!r}")


def _by_group(table: dict, gpu: GPUSpec, n: np.ndarray, default: float) -> np.ndarray:
    """`table[compute capability][group size]` for each group size in `n`; `default` where
    the GPU's capability or the group size is not listed."""
    row = table.get(gpu.compute_capability)
    if row is None:
        return np.full(np.shape(n), default)
    return np.select([n == k for k in row], list(row.values()), default)


ONE_STAGE, TWO_STAGE, SYMM_MEM, RING = 0, 1, 2, 3
"""The paths `allreduce_route` names: vLLM's custom kernel in its two flavours, PyTorch
symmetric memory, an NCCL ring."""


def allreduce_route(nbytes, num_gpus, gpu: GPUSpec, p: CollectiveParams) -> np.ndarray:
    """Which path the engine sends each all-reduce down (`CollectiveParams` says how it
    chooses): `ONE_STAGE`, `TWO_STAGE`, `SYMM_MEM` or `RING` per message."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n = np.asarray(num_gpus, dtype=np.float64)
    nvlink = gpu.nvlink_gbps is not None
    custom_max = p.custom_max_bytes
    if p.symm_mem:
        custom_max = np.minimum(custom_max,
                                _by_group(CUSTOM_MAX_WITH_SYMM_MEM, gpu, n, custom_max))
    custom = np.isin(n, CUSTOM_GROUPS) & (nbytes < custom_max)
    if not nvlink:
        custom = custom & (n <= p.pcie_custom_max_gpus)
    one_stage = (n == 2) | ((n <= 4) & (nbytes < CUSTOM_ONE_STAGE_BELOW[4])) \
        | ((n <= 8) & (nbytes < CUSTOM_ONE_STAGE_BELOW[8]))
    route = np.full(np.broadcast(nbytes, n).shape, RING)
    if p.symm_mem and nvlink:
        route = np.where(nbytes <= _by_group(SYMM_MEM_MAX, gpu, n, 0.0), SYMM_MEM, route)
    return np.where(custom, np.where(one_stage, ONE_STAGE, TWO_STAGE), route)


def allreduce_time(nbytes, num_gpus, gpu: GPUSpec, p: CollectiveParams):
    """Seconds of one all-reduce of `nbytes` per GPU over `num_gpus` GPUs (0 for one)."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n = np.asarray(num_gpus, dtype=np.float64)
    link = gpu.interconnect_gbps * 1e9
    moved = 2.0 * (n - 1) / np.maximum(n, 1)       # bus bytes per message byte
    hops = (n - 1) * p.hop_s
    custom_bw = link * p.custom_link_eff
    one_stage = p.custom_latency_s + hops + nbytes * (n - 1) / custom_bw
    two_stage = p.custom_latency_s + hops + p.two_shot_s + (n - 1) * p.two_shot_hop_s \
        + nbytes * moved / custom_bw
    symm = p.symm_latency_s + hops + nbytes / (link * p.symm_link_eff)
    ring_bw = link * p.ring_link_eff
    if gpu.nvlink_gbps is None and p.fabric_gbps:
        ring_bw = np.where(n > p.pcie_custom_max_gpus,
                           np.minimum(ring_bw, p.fabric_gbps * 1e9 / np.maximum(n - 1, 1)), ring_bw)
    ring = p.ring_latency_s + hops + nbytes * moved / ring_bw
    route = allreduce_route(nbytes, n, gpu, p)
    t = np.select([route == ONE_STAGE, route == TWO_STAGE, route == SYMM_MEM],
                  [one_stage, two_stage, symm], ring)
    return np.where((n > 1) & (nbytes > 0), t, 0.0)


@dataclass(frozen=True, slots=True)
class AllToAllParams(_Params):
    """NCCL all-to-all inside one node: what expert parallelism's dispatch and combine use.

    Each GPU sends 1/n of its buffer to every GPU of the group (itself included), so
    (n-1)/n of it crosses its link (nccl-tests' bus-bandwidth convention for alltoall,
    its PERFORMANCE.md). NCCL moves it with one of three protocols — LL, LL128 and Simple,
    from lowest latency to highest bandwidth — and picks, by its own cost model of a
    latency plus size / bandwidth per protocol, the fastest for the size (NCCL's
    `src/graph/tuning.cc`); so the time is the least of three lines, concave in the size:
    measured on A100 and H100 the cost per byte falls by a third between 1 and 64 MiB.
    Every GPU also reads its whole send buffer and writes its receive buffer
    (`copy_gbps`), whatever the group size. Without NVLink every GPU's share crosses the
    host's PCIe fabric at once, which `fabric_gbps` caps."""

    latency_s: float = 0.0
    """Fixed seconds of one all-to-all with the lowest-latency protocol (LL)."""
    hop_s: float = 0.0
    """Extra seconds per additional GPU (one more peer to exchange with)."""
    link_eff: float = 1.0
    """Bus bandwidth of the LL protocol as a fraction of the per-direction link figure."""
    fabric_gbps: float = 0.0
    """GB/s of the shared host fabric all GPUs' traffic crosses without NVLink; 0 where
    GPUs talk over NVLink."""
    pcie_direct_max_gpus: float = 2
    """Most GPUs that exchange peer to peer under one PCIe switch without crossing the host
    fabric (the pair, as for `CollectiveParams.pcie_custom_max_gpus`); a topology setting."""
    ll128_latency_s: float = 0.0
    """Fixed seconds with the LL128 protocol (0 with `ll128_link_eff` 0: not modelled)."""
    ll128_link_eff: float = 0.0
    """Bus bandwidth of LL128 as a fraction of the link figure; 0: the protocol is not
    modelled (a profile from before it)."""
    simple_latency_s: float = 0.0
    """Fixed seconds with the Simple protocol."""
    simple_link_eff: float = 0.0
    """Bus bandwidth of Simple as a fraction of the link figure; 0: not modelled."""
    copy_gbps: float = 0.0
    """GB/s at which each GPU reads its send buffer and writes its receive buffer (the
    whole message, whatever the group); 0: not modelled."""

    _fractions = ("link_eff",)
    _added = ("ll128_latency_s", "ll128_link_eff", "simple_latency_s", "simple_link_eff",
              "copy_gbps")

    def __post_init__(self) -> None:
        self._check()
        for name in ("ll128_link_eff", "simple_link_eff"):
            if getattr(self, name) > 1:
                raise ValueError(f"AllToAllParams.{name} must be a fraction of the link in "
                                 f"(0, 1], or 0 for a protocol not modelled, "
                                 f"got {getattr(self, name)!r}")


def alltoall_time(nbytes, num_gpus, gpu: GPUSpec, p: AllToAllParams):
    """Seconds of one all-to-all of `nbytes` per GPU (its whole send buffer) over
    `num_gpus` GPUs (0 for one GPU or no bytes).

    Expert-parallel dispatch sends each token's hidden state to the GPUs of its top-k
    experts and combine sends the results back: with balanced routing about
    tokens_per_gpu x top-k x hidden x bytes each way."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    n = np.asarray(num_gpus, dtype=np.float64)
    moved = nbytes * (n - 1) / np.maximum(n, 1)
    wire = moved / (gpu.interconnect_gbps * 1e9)
    fabric = 0.0
    if gpu.nvlink_gbps is None and p.fabric_gbps:
        fabric = np.where(n > p.pcie_direct_max_gpus, n * moved / (p.fabric_gbps * 1e9), 0.0)
    protocols = [(p.ll128_latency_s, p.ll128_link_eff), (p.simple_latency_s, p.simple_link_eff)]
    protocols = [(latency, eff) for latency, eff in protocols if eff]
    if protocols:      # every protocol moves its payload at its fraction of link and fabric
        raw = np.maximum(wire, fabric)
        t = p.latency_s + raw / p.link_eff
        for latency, eff in protocols:
            t = np.minimum(t, latency + raw / eff)
    else:              # one line, with the fabric's own rate (profiles from before protocols)
        t = p.latency_s + np.maximum(wire / p.link_eff, fabric)
    t = t + (n - 1) * p.hop_s
    if p.copy_gbps:
        t = t + nbytes / (p.copy_gbps * 1e9)
    return np.where((n > 1) & (nbytes > 0), t, 0.0)


def alltoall_from_ring(ring: CollectiveParams, pcie_direct_max_gpus: float = 2.0
                      ) -> AllToAllParams:
    """The EP exchange's link, for a GPU measured without all-to-all tables, taken from its
    own fitted NCCL ring all-reduce (`ring`): its ring latency, per-GPU hop, bus-bandwidth
    fraction and host-fabric figure, as one protocol line (no LL128/Simple split, no
    buffer copy).

    Why the ring: vLLM's default EP exchange (the `allgather_reducescatter` all-to-all
    backend) is an NCCL all-gather before the experts and a reduce-scatter after, and NCCL
    runs both over the same rings as an all-reduce, each moving (n-1)/n of the gathered
    buffer per GPU where a ring all-reduce moves 2(n-1)/n (nccl-tests' bus-bandwidth
    convention, its PERFORMANCE.md) — what `alltoall_time` charges for `nbytes` of
    the gathered activations. Checked where both were measured (aiconfigurator's vLLM 0.14
    `nccl_perf` tables, messages >= 8 MiB, the median error of this line from each GPU's
    own all-reduce fit, docs/moe-mla.md): L40S over PCIe, 2 GPUs, all-gather +1.9% and
    reduce-scatter -2.5% (its own all-to-all fit: -11.9% and -14.9%); over NVLink the line
    is faster than measured, A100 and H100 2 GPUs -8% to -27%, 8 GPUs -3% to -6%; over
    PCIe's host fabric (L40S, 4 and 8 GPUs) from -24% to +65%, as crude as the fabric
    figure itself. A GPU with all-to-all tables of its own keeps its fit."""
    return AllToAllParams(latency_s=ring.ring_latency_s, hop_s=ring.hop_s,
                          link_eff=ring.ring_link_eff, fabric_gbps=ring.fabric_gbps,
                          pcie_direct_max_gpus=pcie_direct_max_gpus)


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
