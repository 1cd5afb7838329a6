"""KV links: what moves a prompt's KV cache from a prefill replica to a decode replica.

One JSON file per link in `simulator/data/links/<name>.json` is the whole entry (as for
GPUs): a per-direction bandwidth in GB/s (10^9 bytes per second, the datasheet's unit;
NVLink is quoted as a bidirectional total, so the file holds half of it) and a fixed cost
per transfer in µs. The bandwidths are datasheet line rates; the latencies are
order-of-magnitude setup costs of one transfer (an RDMA read, a copy launch), which each
file says. Achieved bandwidth is below line rate (NIXL over UCX reaches roughly 80-95 % of
it on large reads), so a priced transfer is a lower bound on the real one.

A replica's KV is sharded over its tensor-parallel GPUs, and each GPU has its own link
(DGX H100: one 400 Gb/s NIC per GPU; NVLink and PCIe are per GPU), so a transfer between
a tp=a and a tp=b replica runs over min(a, b) links at once (`lanes`).

    seconds = latency + bytes / (bandwidth × lanes)                    # after the prefill
    seconds = latency + max(bytes / layers, bytes − overlap) / (bandwidth × lanes)   # layerwise

where, layer by layer, the link carries each layer's KV while the next layers compute:
what is left when the prefill ends is the last layer's share, or more when the link is
slower than the prefill (`overlap` = bandwidth × lanes × the prefill's compute window).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources

from servelab._validate import check_bounded, check_known_keys

KV_TRANSFER_MODES = ("after-prefill", "layerwise")
"""When a prompt's KV moves: once its prefill has ended (the default: what vLLM's NIXL
connector does, the decode side reading the finished blocks), or layer by layer while it
is computed (LMCache's layerwise mode, vLLM's P2P NCCL connector, Splitwise)."""


@dataclass(frozen=True, slots=True)
class LinkSpec:
    name: str
    bandwidth_gbps: float | None
    """Per-direction bandwidth of one GPU's link, GB/s; None: unlimited (the `ideal` link)."""
    latency_us: float
    """Fixed cost of one transfer, µs."""
    description: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if self.bandwidth_gbps is not None:     # None: unlimited
            check_bounded(f"link {self.name}: bandwidth_gbps", self.bandwidth_gbps, 0, lo_open=True)
        check_bounded(f"link {self.name}: latency_us", self.latency_us, 0)

    def seconds(self, nbytes: float, lanes: int) -> float:
        """Time to move `nbytes` over `lanes` links of this kind at once, latency included."""
        return self.latency_us * 1e-6 + self._wire(nbytes, lanes)

    def layerwise_seconds(self, nbytes: float, lanes: int, num_layers: int,
                          overlap_s: float) -> float:
        """Time left after the prefill ends when the KV was sent layer by layer during an
        `overlap_s` window of computing it: the last layer's share at least, more when the
        link could not keep up. O(1)."""
        wire = self._wire(nbytes, lanes)
        return self.latency_us * 1e-6 + max(wire / num_layers, wire - max(overlap_s, 0.0))

    def _wire(self, nbytes: float, lanes: int) -> float:
        if self.bandwidth_gbps is None:
            return 0.0
        return nbytes / (self.bandwidth_gbps * 1e9 * lanes)

    @classmethod
    def from_dict(cls, data: dict, source: str) -> "LinkSpec":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        check_known_keys(data, {f.name for f in fields(cls)}, f"{source}: unknown field(s)")
        missing = sorted({"name", "bandwidth_gbps", "latency_us"} - set(data))
        if missing:
            raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
        return cls(**data)


@cache
def _catalog() -> dict[str, LinkSpec]:
    """Every packaged link file, read once."""
    folder = resources.files("servelab.simulator") / "data" / "links"
    links: dict[str, LinkSpec] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        spec = LinkSpec.from_dict(json.loads(entry.read_text()), source=f"links/{entry.name}")
        if spec.name != entry.name[:-len(".json")]:
            raise ValueError(f"links/{entry.name}: 'name' must match the file name, got {spec.name!r}")
        links[spec.name] = spec
    return links


def link_names() -> list[str]:
    return sorted(_catalog())


def get_link(name: str) -> LinkSpec:
    """The catalog link `name`; an unknown name lists the known ones."""
    catalog = _catalog()
    if isinstance(name, str) and name in catalog:
        return catalog[name]
    raise ValueError(f"unknown KV link {name!r}; the catalog has {', '.join(link_names())}")
