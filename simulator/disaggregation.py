"""Disaggregated prefill/decode: the config of a prefill pool and a decode pool, and its flags.

    servelab simulate --prefill-replicas 2 --decode-replicas 2 --prefill-tp 2 --kv-link ib-400g ...

A `SimulationConfig` with `disaggregation` set runs a prefill pool and a decode pool
(`simulator/disaggregated_cluster.py`, built by `simulator/disaggregated_run.py`) instead
of `replicas` co-located replicas. Each pool has its replica count, GPU, tensor
parallelism and KV capacity (None: the run's); everything else — model, dtypes, block
size, scheduler, policy, block manager — is the run's, for both pools (the prefix cache
and its CPU tier serve the prefill pool only: a decode replica receives computed prompts).

The KV cache moves block for block, without conversion: pools whose model, KV dtype or
block size differ are refused in one line. Background and sources: DistServe
(arXiv:2401.09670), Splitwise (arXiv:2311.18677), and docs/disaggregation.md.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from servelab._validate import check_choice, check_int, check_known_keys
from servelab.simulator.links import KV_TRANSFER_MODES, get_link

_OWNER = "DisaggregationConfig"
DEFAULT_KV_LINK = "ib-400g"
"""Prefill and decode nodes joined by a 400 Gb/s NIC per GPU: the layout of the production
deployments (vLLM's NIXL connector over RDMA, NVIDIA Dynamo, llm-d)."""


@dataclass(frozen=True)
class PoolConfig:
    """One pool's layout. None fields take the run's value (SimulationConfig's)."""

    replicas: int = 1
    gpu: str | None = None
    tp: int | None = None
    kv_blocks: int | None = None
    """KV capacity per replica in blocks; None: the run's kv_blocks, or derived from the
    pool's GPU memory."""
    model: str | None = None
    kv_dtype: str | None = None
    block_size: int | None = None
    """model, kv_dtype and block_size may only restate the run's (checked in
    `check_disaggregation`): KV moves between pools without conversion."""

    def __post_init__(self) -> None:
        o = f"{_OWNER}.pool"
        check_int(o, "replicas", self.replicas, 1)
        for name in ("tp", "kv_blocks", "block_size"):
            if getattr(self, name) is not None:
                check_int(o, name, getattr(self, name), 1)
        for name in ("gpu", "model", "kv_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{o}.{name} must be a non-empty string or None, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "PoolConfig":
        if not isinstance(data, dict):
            raise ValueError(f"'{where}' must be an object, got {data!r}")
        check_known_keys(data, {f.name for f in fields(cls)}, f"unknown {where} key(s)")
        return cls(**data)


@dataclass(frozen=True)
class DisaggregationConfig:
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    kv_link: str = DEFAULT_KV_LINK
    """A link of the catalog (`simulator/links.py`)."""
    kv_transfer: str = "after-prefill"
    """'after-prefill' (default: vLLM's NIXL connector, the decode side reading the
    finished prompt's blocks; DistServe's pull) or 'layerwise' (sent while computed)."""

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if not isinstance(getattr(self, name), PoolConfig):
                raise ValueError(f"{_OWNER}.{name} must be a PoolConfig, got {getattr(self, name)!r}")
        get_link(self.kv_link)
        check_choice(_OWNER, "kv_transfer", self.kv_transfer, KV_TRANSFER_MODES)

    @property
    def pools(self) -> tuple[tuple[str, PoolConfig], ...]:
        return (("prefill", self.prefill), ("decode", self.decode))

    def to_dict(self) -> dict[str, Any]:
        return {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict(),
                "kv_link": self.kv_link, "kv_transfer": self.kv_transfer}

    @classmethod
    def from_dict(cls, data: Any) -> "DisaggregationConfig":
        if not isinstance(data, dict):
            raise ValueError(f"'disaggregation' must be an object, got {data!r}")
        check_known_keys(data, {f.name for f in fields(cls)}, "unknown disaggregation key(s)")
        values = dict(data)
        for name in ("prefill", "decode"):
            if name in values:
                values[name] = PoolConfig.from_dict(values[name], name)
        return cls(**values)


def check_disaggregation(config) -> None:
    """ValueError, in one line, for a SimulationConfig whose disaggregation the simulator
    cannot run: features it does not model with two pools, or pools that could not share
    KV without converting it."""
    c, d = config, config.disaggregation
    if not isinstance(d, DisaggregationConfig):
        raise ValueError(f"SimulationConfig.disaggregation must be a DisaggregationConfig or None, got {d!r}")
    if c.ep != 1:   # first: --ep above --tp also sets replicas (its data-parallel ranks)
        raise ValueError("disaggregated prefill/decode is not modelled with expert parallelism (--ep)")
    if c.replicas != 1:
        raise ValueError(f"SimulationConfig.replicas={c.replicas}: a disaggregated run sizes its pools "
                         "with --prefill-replicas and --decode-replicas instead")
    if c.scheduler.speculative.enabled:
        raise ValueError("disaggregated prefill/decode is not modelled with speculative decoding")
    for name, run_value in (("model", c.model), ("kv_dtype", c.kv_dtype), ("block_size", c.block_size)):
        prefill = getattr(d.prefill, name) or run_value
        decode = getattr(d.decode, name) or run_value
        if prefill != decode:
            what = "a decode replica can only import KV its own model computed" if name == "model" \
                else "KV blocks move between pools as they are, without conversion"
            raise ValueError(f"the prefill pool has {name} {prefill} and the decode pool {decode}: {what}")
        if prefill != run_value:
            raise ValueError(f"both pools have {name} {prefill} but the run has {run_value}: "
                             f"give it as the run's --{name.replace('_', '-')}")


# --------------------------------------------------------------------------- command line
SIMULATED_POOLS = ("a prefill pool and a decode pool joined by a KV link (both --prefill-replicas "
                   "and --decode-replicas turn it on); unset pool flags take --tp, --gpu and "
                   "--kv-blocks")
"""What the group's flags describe in `servelab simulate` (`servelab run` says its own)."""


def add_disaggregation_arguments(parser: argparse.ArgumentParser,
                                 description: str = SIMULATED_POOLS,
                                 simulated_only_hidden: bool = False) -> None:
    """The `servelab simulate` flags of a disaggregated run, in their own group.
    `simulated_only_hidden`: the pool TP, GPU, link and transfer flags are parsed (to be
    refused in one line) but left out of --help (`servelab run`, which has no --tp or
    --gpu for them to default to)."""
    from servelab.options import positive_int
    from servelab.simulator.links import link_names

    def shown(text: str) -> str:
        return argparse.SUPPRESS if simulated_only_hidden else text

    g = parser.add_argument_group("disaggregated prefill/decode", description)
    g.add_argument("--prefill-replicas", type=positive_int, metavar="N", help="prefill replicas")
    g.add_argument("--decode-replicas", type=positive_int, metavar="M", help="decode replicas")
    for pool in ("prefill", "decode"):
        g.add_argument(f"--{pool}-tp", type=positive_int, metavar="N",
                       help=shown(f"tensor-parallel GPUs per {pool} replica (default --tp)"))
        g.add_argument(f"--{pool}-gpu", metavar="G",
                       help=shown(f"GPU of the {pool} pool (default --gpu)"))
        g.add_argument(f"--{pool}-kv-blocks", type=positive_int, metavar="N",
                       help=f"KV blocks per {pool} replica (default --kv-blocks, or derived from "
                            "its GPU memory)")
    g.add_argument("--kv-link", metavar="NAME", default=None,
                   help=shown(f"link a prompt's KV crosses, from the catalog: "
                              f"{', '.join(link_names())} (default {DEFAULT_KV_LINK}; see "
                              f"docs/disaggregation.md)"))
    g.add_argument("--kv-transfer", choices=KV_TRANSFER_MODES, default=None,
                   help=shown("send the KV once the prefill ends (default: as vLLM's NIXL "
                              "connector does), or layer by layer while it is computed"))


def disaggregation_from_args(args: argparse.Namespace) -> DisaggregationConfig | None:
    """The DisaggregationConfig the flags describe, None when they ask for none; a pool
    flag without both replica counts is a ValueError."""
    p, d = getattr(args, "prefill_replicas", None), getattr(args, "decode_replicas", None)
    pool_flags = [name for name in ("prefill_tp", "decode_tp", "prefill_gpu", "decode_gpu",
                                    "prefill_kv_blocks", "decode_kv_blocks", "kv_link", "kv_transfer")
                  if getattr(args, name, None) is not None]
    if p is None and d is None:
        if pool_flags:
            raise ValueError(f"--{pool_flags[0].replace('_', '-')} applies to a disaggregated run: "
                             "give --prefill-replicas and --decode-replicas")
        return None
    if p is None or d is None:
        raise ValueError("a disaggregated run needs both --prefill-replicas and --decode-replicas")
    if (getattr(args, "dp", None) or 1) > 1:     # --ep: check_disaggregation says it
        raise ValueError("--dp is not modelled with disaggregated pools: a disaggregated run "
                         "sizes its pools with --prefill-replicas and --decode-replicas")
    return DisaggregationConfig(
        prefill=PoolConfig(p, args.prefill_gpu, args.prefill_tp, args.prefill_kv_blocks),
        decode=PoolConfig(d, args.decode_gpu, args.decode_tp, args.decode_kv_blocks),
        kv_link=args.kv_link or DEFAULT_KV_LINK, kv_transfer=args.kv_transfer or "after-prefill")
