"""Measured GPU kernel times, read from public tables into one canonical form.

Two layouts are recognised anywhere under the folders given (see
`../shared/gpu-measurements/README.md`):

- aiconfigurator (NVIDIA, per-kernel latencies measured inside vLLM): Parquet files
  `gemm_perf`, `context_attention_perf`, `generation_attention_perf`,
  `custom_allreduce_perf`, `moe_perf` (fused experts), `context_mla_perf` /
  `generation_mla_perf` (latent attention) and `nccl_perf` (its all-to-all rows) in one
  folder per GPU, latency in milliseconds, the GPU named in a `device` column (matched
  against the catalog's `device_names`; an `nccl_perf` without one by its folder, against
  the catalog's `aliases`);
- Vidur (Microsoft, eager PyTorch per-layer operator profiles): `compute/<gpu>/<model>.mlp.csv`
  and `network/<gpu>_dgx.all_reduce.csv`, milliseconds, the GPU named by the folder or file
  prefix (matched against the catalog's `aliases`).

Each family becomes a `Table`: named numpy columns (times in seconds), plus where every
row came from, so a bad row is reported as "FILE: row N: ...". Bad input — a missing
column, a latency that is not a positive number, an unknown dtype, the same point twice —
is an error naming the file and the row, unless `drop_bad_rows` is set: then bad rows are
dropped, repeated measurements of one point are merged into their median, and the counts
are reported (`MeasurementSet.dropped`). Sliding-window attention rows (a `window_size`
above 0, in the vLLM 0.24 tables) are always left out and counted: the model prices full
attention, and those rows share every other key column with the full-attention ones.
Rows measured inside a development build beside a release (B200's vLLM 0.24 `moe_perf`
holds a few `0.1.dev...` rows) are left out and counted too.

An `nccl_perf` table's `version` column is NCCL's, not the engine's: its engine version is
the `aiconfigurator-vllm-<version>` folder it sits in.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from servelab.simulator.calibration import ENGINE_VERSIONS
from servelab.simulator.gpus import GPUSpec, get_gpu

GEMM_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "fp16": "fp16", "bf16": "bf16",
               "fp8": "fp8", "fp8_block": "fp8_block"}
MOE_DTYPES = {**GEMM_DTYPES, "int4_wo": "int4_wo", "w4a16_mxfp4": "w4a16_mxfp4", "nvfp4": "nvfp4",
              "w4a8_mxfp4_mxfp8": "w4a8_mxfp4_mxfp8"}
NCCL_DTYPES = {"half": 2, "int8": 1, "float16": 2, "bfloat16": 2}
"""NCCL table dtypes and their bytes per element (message sizes are in elements)."""
KV_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
ALLREDUCE_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}

VIDUR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj", "mlp_act",
             "attn_rope", "input_layernorm", "post_attention_layernorm", "add", "emb")
"""Vidur's per-layer operators (emb: once per step)."""


class MeasurementError(ValueError):
    """A measurement file that cannot be used as it is (the message names file and row)."""


@dataclass
class Table:
    """One kernel family's measurements: equal-length numpy columns."""

    family: str
    columns: dict[str, np.ndarray]
    origin: list[str] = field(default_factory=list)
    """Per row: "FILE: row N" (N counts data rows from 1), for messages."""

    def __len__(self) -> int:
        return len(self.origin)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def select(self, mask: np.ndarray) -> "Table":
        return Table(self.family, {k: v[mask] for k, v in self.columns.items()},
                     [o for o, keep in zip(self.origin, mask) if keep])

    @staticmethod
    def concat(family: str, parts: list["Table"]) -> "Table":
        parts = [p for p in parts if len(p)]
        if not parts:
            return Table(family, {}, [])
        names = parts[0].columns
        return Table(family, {k: np.concatenate([p.columns[k] for p in parts]) for k in names},
                     [o for p in parts for o in p.origin])


@dataclass
class MeasurementSet:
    """Everything measured on one GPU, by family."""

    gpu: str
    tables: dict[str, Table]
    sources: dict[str, str]
    """Per family: which files and project the rows came from (for a profile's provenance)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Rows dropped or merged, by reason (only with drop_bad_rows)."""
    engine_version: str | None = None
    """The engine version the aiconfigurator tables were measured inside (one at most: they
    are never pooled); None where no table says (Vidur's tables)."""
    unread: tuple[str, ...] = ()
    """Table files found that no kernel family reads (e.g. aiconfigurator's MLA module
    tables, which time the whole attention module), by name."""

    def table(self, family: str) -> Table:
        return self.tables.get(family) or Table(family, {}, [])


# --------------------------------------------------------------------------- discovery


_AIC_FILES = {"gemm_perf": "gemm", "context_attention_perf": "attn_prefill",
              "generation_attention_perf": "attn_decode", "custom_allreduce_perf": "allreduce",
              "moe_perf": "moe", "context_mla_perf": "mla_prefill",
              "generation_mla_perf": "mla_decode", "nccl_perf": "nccl"}


def load_measurements(folders: list[str | Path], gpu: GPUSpec | str,
                      drop_bad_rows: bool = False,
                      engine_version: str | None = None) -> MeasurementSet:
    """Every recognised table for `gpu` under `folders` (searched recursively).

    aiconfigurator tables measured inside different engine versions are never pooled:
    the same kernel on the same GPU took 0.5 to 2.9 times as long in vLLM 0.24 as in 0.14
    at the tails (../shared/gpu-measurements/README.md). `engine_version` keeps one
    version's tables; None accepts the tables only while they are all of one version."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    parts: dict[str, list[Table]] = {}
    sources: dict[str, list[str]] = {}
    dropped: dict[str, int] = {}
    versions: dict[str, list[Path]] = {}
    unread: set[Path] = set()
    read_in: set[Path] = set()
    """Folders a table of this GPU was read from: the unread files beside them are noted."""
    unversioned: list[Path] = []
    """aiconfigurator tables without a version column: pooled only with their own kind."""
    skipped: set[str] = set()
    seen_any = False
    for folder in folders:
        root = Path(folder)
        if not root.is_dir():
            raise MeasurementError(f"{root}: not a folder of measurements")
        for path in sorted(root.rglob("*")):
            family, reader = _recognise(path)
            if family is None:
                if path.suffix.lower() in TABLE_SUFFIXES and path.is_file():
                    unread.add(path)
                continue
            seen_any = True
            version = _engine_version(path) if reader is _read_aiconfigurator else None
            if engine_version is not None and version not in (None, engine_version):
                skipped.add(version)
                continue
            table, project = reader(path, spec, drop_bad_rows, dropped)
            if table is None:
                continue
            _check_latency_unit(path, table)
            if version is not None:
                versions.setdefault(version, []).append(path.parent)
            elif reader is _read_aiconfigurator and path.name != "nccl_perf.parquet":
                unversioned.append(path)   # (NCCL's table is versioned by its folder, if at all)
            parts.setdefault(family, []).append(table)
            read_in.add(path.parent)
            where = Path(root.resolve().name) / path.relative_to(root)
            sources.setdefault(family, []).append(f"{project}: {where}")
    if len(versions) > 1:
        found = "; ".join(f"{v} ({', '.join(sorted({str(f) for f in where}))})"
                          for v, where in sorted(versions.items()))
        raise MeasurementError(f"{spec.name}: tables measured inside several engine versions "
                               f"({found}); they are never pooled: choose one with "
                               f"--engine-version (packaged profiles exist for "
                               f"{', '.join(ENGINE_VERSIONS)})")
    if versions and unversioned:
        raise MeasurementError(f"{unversioned[0]}: no version column, beside tables measured "
                               f"inside vLLM {', '.join(sorted(versions))}: tables of several "
                               "engine versions are never pooled; give it the version column of "
                               "the engine that measured it, or keep it in another folder")
    if not seen_any:
        raise MeasurementError(f"no measurement tables found under {', '.join(map(str, folders))} "
                               f"(expected aiconfigurator *_perf.parquet or Vidur *.mlp.csv / "
                               f"*.all_reduce.csv files)")
    tables = {fam: _dedupe(Table.concat(fam, ts), drop_bad_rows, dropped) for fam, ts in parts.items()}
    if engine_version is not None and not versions and skipped:
        raise MeasurementError(f"no tables measured inside engine version {engine_version!r} under "
                               f"{', '.join(map(str, folders))}; the versions there: "
                               f"{', '.join(sorted(skipped))}")
    if not any(len(t) for t in tables.values()):
        raise MeasurementError(f"no measurements for {spec.name} under "
                               f"{', '.join(map(str, folders))} (the tables found name other GPUs)")
    return MeasurementSet(spec.name, tables, {k: "; ".join(v) for k, v in sources.items()}, dropped,
                          next(iter(versions), None),
                          tuple(sorted(p.name for p in unread if p.parent in read_in)))


TABLE_SUFFIXES = (".parquet", ".csv")
"""What a measurement table file is named (aiconfigurator's Parquet, Vidur's CSV)."""
SLOWEST_MEDIAN_S = 1e-6
"""No table's median kernel time is under a microsecond (a launch alone takes a few: the
shared tables' medians are 6 µs and up, their fastest rows 1.7 µs)."""


def _check_latency_unit(path: Path, table: Table) -> None:
    """A table whose median time is below `SLOWEST_MEDIAN_S` holds another unit (seconds
    where the format says milliseconds): an error, not a fit 1,000x off."""
    if "latency_s" in table.columns and len(table) \
            and float(np.median(table["latency_s"])) < SLOWEST_MEDIAN_S:
        median_ms = float(np.median(table["latency_s"])) * 1e3
        raise MeasurementError(f"{path}: its median kernel time reads {median_ms:.3g} ms, below "
                               f"any kernel launch (~{SLOWEST_MEDIAN_S * 1e6:g} µs): the latency "
                               "column is in milliseconds (a table in seconds?)")


def _engine_version(path: Path) -> str | None:
    """The engine version an aiconfigurator table was measured in (its `version` column;
    None when it has none). A table of several versions is an error: it would pool them."""
    import pyarrow.parquet as pq

    if path.name == "nccl_perf.parquet":        # its version column is NCCL's
        match = re.search(r"vllm-(\d+\.\d+\.\d+)", str(path.parent.parent.name))
        return match.group(1) if match else None
    try:
        column = pq.read_table(path, columns=["version"]).column("version").unique().to_pylist()
    except Exception:            # no such column, or a damaged file: the reader says which
        return None
    releases = [str(v) for v in column if not _dev_build(v)]
    if len(releases) > 1 or (not releases and len(column) > 1):
        raise MeasurementError(f"{path}: rows measured inside several engine versions "
                               f"({', '.join(sorted(map(str, column)))}); split it by version")
    return releases[0] if releases else (str(column[0]) if column else None)


def _dev_build(version) -> bool:
    """A development build's version ("0.1.dev19262+gb6bbf29dd"), not a release's."""
    return ".dev" in str(version)


def _recognise(path: Path):
    name = path.name
    if name.endswith(".parquet") and name[:-len(".parquet")] in _AIC_FILES:
        return _AIC_FILES[name[:-len(".parquet")]], _read_aiconfigurator
    if name.endswith(".mlp.csv"):
        return "vidur_ops", _read_vidur_ops
    if name.endswith(".all_reduce.csv"):
        return "vidur_allreduce", _read_vidur_allreduce
    return None, None


# ---------------------------------------------------------------------- aiconfigurator


_AIC_COLUMNS = {
    "gemm": ("gemm_dtype", "m", "n", "k", "latency"),
    "attn_prefill": ("batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim",
                     "kv_cache_dtype", "latency"),
    "attn_decode": ("batch_size", "step", "num_heads", "num_key_value_heads", "head_dim",
                    "kv_cache_dtype", "latency"),
    "allreduce": ("allreduce_dtype", "num_gpus", "message_size", "backend", "latency"),
    "moe": ("moe_dtype", "num_tokens", "hidden_size", "inter_size", "num_experts", "topk",
            "moe_tp_size", "moe_ep_size", "distribution", "kernel_source", "latency"),
    "mla_prefill": ("batch_size", "isl", "num_heads", "tp_size", "kv_cache_dtype", "latency"),
    "mla_decode": ("batch_size", "step", "num_heads", "tp_size", "kv_cache_dtype", "latency"),
    "nccl": ("op_name", "nccl_dtype", "num_gpus", "message_size", "latency"),
}
MOE_TOP_UP = {"0.14.0": "smallest-first", "0.19.0": "round-robin", "0.24.0": "round-robin"}
"""How the power-law routing of an engine version's `moe_perf` tables topped its counts up
(`kernels.moe.SMALLEST_FIRST`, `ROUND_ROBIN`: the helper as written now, with each expert
capped at the batch); other versions: as aiconfigurator's helper was first written."""


NON_GATED_MOE = {(2688, 1856, 128, 6): "NVIDIA-Nemotron-3-Nano-30B-A3B",
                 (1024, 2688, 512, 22): "Nemotron-3 Super (512 experts, top-22, width 2688, "
                                        "at its latent width 1024)",
                 (2048, 5120, 512, 22): "Nemotron-3 Ultra (512 experts, top-22, width 5120, "
                                        "at its latent width)"}
"""(hidden, inter, experts, top-k) of the measured MoE layers whose model has experts
without a gate: NVIDIA's Nemotron-H models (aiconfigurator's
`collector/cases/models/NemotronHForCausalLM_cases.yaml` lists their MoE cases; their
config.json has `mlp_hidden_act: relu2`, squared ReLU on one up projection). Super and
Ultra route in a latent space (`moe_latent_size`: 1024 for Super), so their experts' input
is that width, not the model's hidden size (the older collector's rows of Super take its
hidden 4096)."""


def moe_rows_gated(kernel_source, hidden, inter, experts, topk) -> np.ndarray:
    """Whether each measured MoE row timed experts with a gate projection. aiconfigurator's
    first vLLM MoE collector (kernel_source `vllm_fused_moe`: the vLLM 0.14 and 0.19 tables)
    calls `fused_experts` with a gated w1 of 2 x inter rows for every shape; the one that
    names the quantisation method, backend and experts class (`vllm_unquantizedfusedmoe_...`,
    `vllm_modeloptfp8moe_...`: the 0.24 tables) builds each layer as its model has it, so
    the Nemotron-H layers (`NON_GATED_MOE`) have none. The times say so: priced as gated,
    those layers come out 20-40% slow (median) on both 0.24 tables (H100: Triton, B200:
    TRT-LLM, FP8 on H100: CUTLASS) and within 5% on the 0.14 and 0.19 ones; priced without
    a gate, within 10% on the 0.24 ones (docs/moe-mla.md)."""
    shapes = zip(np.asarray(hidden).tolist(), np.asarray(inter).tolist(),
                 np.asarray(experts).tolist(), np.asarray(topk).tolist())
    return np.array([str(k) == "vllm_fused_moe" or shape not in NON_GATED_MOE
                     for k, shape in zip(kernel_source, shapes)], dtype=bool)


def forward_writes_cache(version: str, kernel_source: str) -> bool:
    """Whether a measured attention call includes writing the new K and V into the paged
    cache. aiconfigurator's collector (`collector/vllm/collect_attn.py`) times the backend's
    `impl.forward` alone, and vLLM moved the cache write out of that `forward` into
    `do_kv_cache_update` (`forward_includes_kv_cache_update = False`): for FlashAttention
    in vllm-project/vllm#25954, merged in the week to 2026-01-30 (vLLM's weekly summary of
    that date, beside the v0.14.1 docs), so from 0.16; for FlashInfer, Triton and the
    others under tracking issue #32335, by 2026-03-06 (#36263 lists them as done), so by
    0.19. The vLLM 0.14 tables therefore time the write, the 0.19 and 0.24 ones do not;
    a FlashInfer or Triton row of 0.16-0.18, or a row of an unknown version or kernel, is
    taken to time it, as engines launched attention before the split. Serving pays the
    write either way (`kernels.prefill_attention_time`)."""
    kernel = kernel_source.lower()
    try:
        release = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return True
    if not kernel.startswith("vllm_") or len(release) < 2:
        return True
    if kernel.startswith("vllm_flash_attn"):
        return release < (0, 16)
    return release < (0, 19)


def _read_aiconfigurator(path: Path, spec: GPUSpec, drop: bool, dropped: dict):
    import pyarrow.parquet as pq

    family = _AIC_FILES[path.name[:-len(".parquet")]]
    try:
        data = pq.read_table(path).to_pydict()
    except Exception as exc:      # pyarrow raises several types for a damaged file
        raise MeasurementError(f"{path}: cannot read as Parquet ({exc})") from None
    named_by_folder = family == "nccl" and "device" not in data
    if named_by_folder:           # aiconfigurator's H100 nccl_perf has no device column
        if not spec.known_as(path.parent.name):
            return None, ""
        data["device"] = [path.parent.name] * len(data.get("latency", []))
    missing = [c for c in (*_AIC_COLUMNS[family], "device") if c not in data]
    if missing:
        raise MeasurementError(f"{path}: missing column(s) {', '.join(missing)}")
    mine = [i for i, d in enumerate(data["device"])
            if named_by_folder or spec.matches_device_name(str(d))]
    if not mine:
        return None, ""
    table_version = _engine_version(path) if family != "nccl" else None
    if table_version is not None and "version" in data:
        release = [i for i in mine if str(data["version"][i]) == table_version]
        if len(release) < len(mine):
            reason = "rows of an engine development build beside the release"
            dropped[reason] = dropped.get(reason, 0) + len(mine) - len(release)
        mine = release
    windows = data.get("window_size")
    if windows is not None:      # sliding-window attention reads only its window: not modelled
        full = [i for i in mine if not windows[i]]
        if len(full) < len(mine):
            reason = "sliding-window attention rows (window_size > 0; not modelled)"
            dropped[reason] = dropped.get(reason, 0) + len(mine) - len(full)
        mine = full
        if not mine:
            return None, ""
    if len(mine) < len(data["device"]):        # a file of several GPUs: only this one's rows
        data = {k: [v[i] for i in mine] for k, v in data.items()}
    version = _one(data.get("version"), "?")
    project = f"aiconfigurator ({_one(data.get('framework'), '?')} {version}, {_one(data['device'], '?')})"
    rows = _Rows(path, [i + 1 for i in mine], drop, dropped)
    lat = rows.latency(data["latency"], scale=1e-3)
    if family == "gemm":
        cols = {"dtype": rows.category(data["gemm_dtype"], GEMM_DTYPES, "gemm_dtype"),
                "m": rows.positive_int(data["m"], "m"), "n": rows.positive_int(data["n"], "n"),
                "k": rows.positive_int(data["k"], "k")}
    elif family in ("attn_prefill", "attn_decode"):
        length = "isl" if family == "attn_prefill" else "step"
        cols = {"batch": rows.positive_int(data["batch_size"], "batch_size"),
                "tokens" if family == "attn_prefill" else "context":
                    rows.positive_int(data[length], length),
                "heads": rows.positive_int(data["num_heads"], "num_heads"),
                "kv_heads": rows.positive_int(data["num_key_value_heads"], "num_key_value_heads"),
                "head_dim": rows.positive_int(data["head_dim"], "head_dim"),
                "kv_dtype": rows.category(data["kv_cache_dtype"], KV_DTYPES, "kv_cache_dtype")}
        rows.check(cols["heads"] % np.maximum(cols["kv_heads"], 1) == 0,
                   "num_heads is not a multiple of num_key_value_heads")
        if family == "attn_prefill":
            kernels = data.get("kernel_source", [""] * len(rows.numbers))
            cols["writes_cache"] = np.array([forward_writes_cache(version, str(k))
                                             for k in kernels], dtype=bool)
    elif family == "moe":
        cols = _moe_columns(rows, data, MOE_TOP_UP.get(version, "largest-first"))
    elif family in ("mla_prefill", "mla_decode"):
        length = "isl" if family == "mla_prefill" else "step"
        cols = {"batch": rows.positive_int(data["batch_size"], "batch_size"),
                "tokens" if family == "mla_prefill" else "context":
                    rows.positive_int(data[length], length),
                "heads": rows.positive_int(data["num_heads"], "num_heads"),
                "tp": rows.positive_int(data["tp_size"], "tp_size"),
                "kv_dtype": rows.category(data["kv_cache_dtype"], KV_DTYPES, "kv_cache_dtype")}
    elif family == "nccl":
        width = rows.category(data["nccl_dtype"], {k: str(v) for k, v in NCCL_DTYPES.items()},
                              "nccl_dtype")
        cols = {"op": np.array([str(o) for o in data["op_name"]], dtype=object),
                "dtype": np.array([str(d) for d in data["nccl_dtype"]], dtype=object),
                "num_gpus": rows.positive_int(data["num_gpus"], "num_gpus"),
                "nbytes": rows.positive_int(data["message_size"], "message_size")
                * np.array([float(w or 0) for w in width])}
    else:
        dtype = rows.category(data["allreduce_dtype"], ALLREDUCE_DTYPES, "allreduce_dtype")
        cols = {"num_gpus": rows.positive_int(data["num_gpus"], "num_gpus"),
                "nbytes": rows.positive_int(data["message_size"], "message_size") * 2.0,
                "backend": np.array([str(b) for b in data["backend"]], dtype=object),
                "dtype": dtype}
    cols["latency_s"] = lat
    return rows.table(family, cols), project


def _moe_columns(rows: "_Rows", data: dict, top_up: str) -> dict[str, np.ndarray]:
    from servelab.simulator.kernels.moe import parse_expert_load

    cols = {"dtype": rows.category(data["moe_dtype"], MOE_DTYPES, "moe_dtype"),
            "tokens": rows.positive_int(data["num_tokens"], "num_tokens"),
            "hidden": rows.positive_int(data["hidden_size"], "hidden_size"),
            "inter": rows.positive_int(data["inter_size"], "inter_size"),
            "experts": rows.positive_int(data["num_experts"], "num_experts"),
            "topk": rows.positive_int(data["topk"], "topk"),
            "tp": rows.positive_int(data["moe_tp_size"], "moe_tp_size"),
            "ep": rows.positive_int(data["moe_ep_size"], "moe_ep_size"),
            "kernel": np.array([str(k) for k in data["kernel_source"]], dtype=object)}
    load = np.empty(len(rows.numbers), dtype=object)
    for i, value in enumerate(data["distribution"]):
        try:
            kind, alpha = parse_expert_load(str(value))
            load[i] = "balanced" if kind == "balanced" else f"power-law:{alpha:g}"
        except ValueError:
            rows._fail(i, f"unknown distribution {value!r}", "unknown distribution")
    cols["load"] = load
    cols["top_up"] = np.array([top_up] * len(rows.numbers), dtype=object)
    cols["gated"] = moe_rows_gated(cols["kernel"], cols["hidden"], cols["inter"],
                                   cols["experts"], cols["topk"])
    rows.check(cols["experts"] % np.maximum(cols["ep"], 1) == 0,
               "num_experts is not a multiple of moe_ep_size")
    rows.check(cols["topk"] <= cols["experts"], "topk exceeds num_experts")
    return cols


# -------------------------------------------------------------------------------- Vidur


def _vidur_gpu(path: Path, spec: GPUSpec) -> bool:
    """Vidur names the GPU by folder (compute/a100/...) or file prefix (a100_dgx...)."""
    if path.name.endswith(".all_reduce.csv"):
        return spec.known_as(path.name.split("_")[0])
    return spec.known_as(path.parent.name)


def _read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    try:
        with path.open(newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            body = list(reader)
    except OSError as exc:
        raise MeasurementError(f"{path}: cannot read ({exc.strerror})") from None
    if not header:
        raise MeasurementError(f"{path}: empty file")
    return header, body


def _columns(path: Path, header: list[str], body: list[list[str]], names: list[str],
             drop: bool, dropped: dict) -> tuple[dict, list[int]]:
    """The named columns of a CSV body, and the (1-based) numbers of the rows kept; a row
    with the wrong number of cells is an error, or dropped and counted."""
    missing = [c for c in names if c not in header]
    if missing:
        raise MeasurementError(f"{path}: missing column(s) {', '.join(missing)}")
    idx = {c: header.index(c) for c in names}
    out = {c: [] for c in names}
    numbers = []
    for i, row in enumerate(body, start=1):
        if len(row) != len(header):
            if not drop:
                raise MeasurementError(f"{path}: row {i}: {len(row)} cells, the header has "
                                       f"{len(header)} (pass --drop-bad-rows to drop such rows "
                                       f"with a count)")
            dropped["ragged row"] = dropped.get("ragged row", 0) + 1
            continue
        numbers.append(i)
        for c, j in idx.items():
            out[c].append(row[j])
    return out, numbers


def _read_vidur_ops(path: Path, spec: GPUSpec, drop: bool, dropped: dict):
    if not _vidur_gpu(path, spec):
        return None, ""
    header, body = _read_csv(path)
    shape_cols = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size",
                  "num_tokens", "num_tensor_parallel_workers"]
    op_cols = [f"time_stats.{op}.median" for op in VIDUR_OPS]
    raw, numbers = _columns(path, header, body, shape_cols + op_cols, drop, dropped)
    rows = _Rows(path, numbers, drop, dropped)
    cols = {name: rows.positive_int(raw[name], name) for name in shape_cols}
    for op, col in zip(VIDUR_OPS, op_cols):
        cols[op] = rows.latency(raw[col], scale=1e-3, column=col)
    cols["model"] = np.array([path.name[:-len(".mlp.csv")]] * len(numbers), dtype=object)
    return rows.table("vidur_ops", cols), f"Vidur (eager PyTorch, fp16), {path.parent.name}"


def _read_vidur_allreduce(path: Path, spec: GPUSpec, drop: bool, dropped: dict):
    if not _vidur_gpu(path, spec):
        return None, ""
    header, body = _read_csv(path)
    raw, numbers = _columns(path, header, body, ["time_stats.all_reduce.median", "num_workers",
                                                 "size", "devices_per_node"], drop, dropped)
    rows = _Rows(path, numbers, drop, dropped)
    cols = {"num_gpus": rows.positive_int(raw["num_workers"], "num_workers"),
            "nbytes": rows.positive_int(raw["size"], "size").astype(np.float64),
            "devices_per_node": rows.positive_int(raw["devices_per_node"], "devices_per_node"),
            "latency_s": rows.latency(raw["time_stats.all_reduce.median"], scale=1e-3,
                                      column="time_stats.all_reduce.median")}
    table = rows.table("vidur_allreduce", cols)
    one_node = table["devices_per_node"] >= table["num_gpus"]
    return table.select(one_node), f"Vidur NCCL all-reduce (eager), {path.name}"


# ----------------------------------------------------------------------------- checking


class _Rows:
    """Row-wise checks of one file's columns; collects the rows to drop."""

    def __init__(self, path: Path, numbers: list[int], drop: bool, dropped: dict) -> None:
        """`numbers`: each value's row in the file (1-based data rows), for messages."""
        self.path, self.numbers, self.drop, self.dropped = path, numbers, drop, dropped
        self.n = len(numbers)
        self.bad = np.zeros(self.n, dtype=bool)

    def _fail(self, i: int, message: str, reason: str) -> None:
        if not self.drop:
            raise MeasurementError(f"{self.path}: row {self.numbers[i]}: {message} "
                                   f"(pass --drop-bad-rows to drop such rows with a count)")
        if not self.bad[i]:
            self.bad[i] = True
            self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def check(self, ok: np.ndarray, message: str) -> None:
        for i in np.flatnonzero(~ok & ~self.bad):
            self._fail(int(i), message, message)

    def latency(self, values, scale: float, column: str = "latency") -> np.ndarray:
        out = np.full(self.n, np.nan)
        for i, v in enumerate(values):
            try:
                x = float(v)
            except (TypeError, ValueError):
                x = float("nan")
            if not (x > 0 and x < float("inf")):
                self._fail(i, f"{column} must be a positive number of milliseconds, got {v!r}",
                           "non-positive or missing latency")
            out[i] = x * scale
        return out

    def positive_int(self, values, column: str) -> np.ndarray:
        out = np.zeros(self.n, dtype=np.int64)
        for i, v in enumerate(values):
            try:
                x = float(v)
                ok = x >= 1 and x.is_integer()
            except (TypeError, ValueError):
                ok = False
            if ok:
                out[i] = int(x)
            else:
                self._fail(i, f"{column} must be a positive integer, got {v!r}", f"bad {column}")
        return out

    def category(self, values, known: dict[str, str], column: str) -> np.ndarray:
        out = np.empty(self.n, dtype=object)
        for i, v in enumerate(values):
            name = known.get(str(v))
            if name is None:
                self._fail(i, f"unknown {column} {v!r} (known: {', '.join(sorted(known))})",
                           f"unknown {column}")
            out[i] = name
        return out

    def table(self, family: str, cols: dict[str, np.ndarray]) -> Table:
        origin = [f"{self.path}: row {number}" for number in self.numbers]
        return Table(family, cols, origin).select(~self.bad)


_KEYS = {"gemm": ("dtype", "m", "n", "k"),
         "attn_prefill": ("batch", "tokens", "heads", "kv_heads", "head_dim", "kv_dtype"),
         "attn_decode": ("batch", "context", "heads", "kv_heads", "head_dim", "kv_dtype"),
         "allreduce": ("backend", "dtype", "num_gpus", "nbytes"),
         "moe": ("dtype", "kernel", "load", "tokens", "hidden", "inter", "experts", "topk", "tp",
                 "ep"),
         "mla_prefill": ("kv_dtype", "batch", "tokens", "heads", "tp"),
         "mla_decode": ("kv_dtype", "batch", "context", "heads", "tp"),
         "nccl": ("op", "dtype", "num_gpus", "nbytes"),
         "vidur_ops": ("model", "num_tokens", "num_tensor_parallel_workers"),
         "vidur_elementwise": ("op", "model", "num_tokens", "num_tensor_parallel_workers"),
         "vidur_allreduce": ("num_gpus", "nbytes")}


def key_columns(family: str) -> tuple[str, ...]:
    """The columns that identify one measured point of a family."""
    return _KEYS[family]


def _dedupe(table: Table, drop: bool, dropped: dict) -> Table:
    """The same point measured twice: an error, or (drop) one row at the median."""
    if not len(table):
        return table
    keys = list(zip(*(table[c].tolist() for c in _KEYS[table.family])))
    first: dict[tuple, int] = {}
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        j = first.setdefault(key, i)
        if j != i:
            if not drop:
                raise MeasurementError(
                    f"{table.origin[i]}: the same point as {table.origin[j]} "
                    f"({', '.join(f'{c}={v}' for c, v in zip(_KEYS[table.family], key))}); "
                    f"pass --drop-bad-rows to merge repeated measurements into their median")
            groups.setdefault(j, [j]).append(i)
    if not groups:
        return table
    keep = np.ones(len(table), dtype=bool)
    timed = [c for c in table.columns if c == "latency_s" or c in VIDUR_OPS]
    for j, members in groups.items():
        for c in timed:
            table.columns[c][j] = float(np.median(table.columns[c][members]))
        keep[members[1:]] = False
        dropped["repeated measurements merged"] = dropped.get("repeated measurements merged", 0) \
            + len(members) - 1
    return table.select(keep)


def _one(values, default: str) -> str:
    if not values:
        return default
    distinct = sorted({str(v) for v in values})
    return distinct[0] if len(distinct) == 1 else "/".join(distinct)
