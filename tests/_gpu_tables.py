"""Measured-kernel tables for tests: synthetic ones in the real layouts, and the real ones.

The writers copy the schemas of `../shared/gpu-measurements/` exactly (aiconfigurator
Parquet columns in their order and types, Vidur's CSV headers), so the loader sees what it
sees in the field; a test passes only the columns it cares about and the rest get the
values the real files hold.
"""
from __future__ import annotations

import csv
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import SHARED

MEASUREMENTS = SHARED / "gpu-measurements"
H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"

_S, _I, _F = pa.string(), pa.int64(), pa.float64()
_ATTENTION = [("framework", _S), ("version", _S), ("device", _S), ("op_name", _S),
              ("kernel_source", _S), ("batch_size", _I), ("isl", _I), ("num_heads", _I),
              ("num_key_value_heads", _I), ("head_dim", _I), ("beam_width", _I),
              ("attn_dtype", _S), ("kv_cache_dtype", _S), ("step", _I), ("latency", _F)]
AIC_SCHEMAS = {
    "gemm_perf": [("framework", _S), ("version", _S), ("device", _S), ("op_name", _S),
                  ("kernel_source", _S), ("gemm_dtype", _S), ("m", _I), ("n", _I), ("k", _I),
                  ("latency", _F)],
    "context_attention_perf": _ATTENTION,
    "generation_attention_perf": _ATTENTION,
    "custom_allreduce_perf": [("framework", _S), ("version", _S), ("device", _S), ("op_name", _S),
                              ("kernel_source", _S), ("allreduce_dtype", _S), ("num_gpus", _I),
                              ("message_size", _I), ("latency", _F), ("backend", _S)],
}
_AIC_DEFAULTS = {
    "gemm_perf": {"op_name": "gemm", "kernel_source": "vllm_default", "gemm_dtype": "bfloat16"},
    "context_attention_perf": {"op_name": "context_attention", "kernel_source": "vllm_flash_attn",
                               "beam_width": 1, "attn_dtype": "bfloat16", "step": 0,
                               "kv_cache_dtype": "bfloat16", "head_dim": 128},
    "generation_attention_perf": {"op_name": "generation_attention", "isl": 1,
                                  "kernel_source": "vllm_flash_attn", "beam_width": 1,
                                  "attn_dtype": "bfloat16", "kv_cache_dtype": "bfloat16",
                                  "head_dim": 128},
    "custom_allreduce_perf": {"op_name": "all_reduce", "kernel_source": "vLLM_custom_graph",
                              "allreduce_dtype": "bfloat16", "backend": "vllm_graph"},
}


def write_aic(path: Path, rows: list[dict], device: str = H100, drop: tuple[str, ...] = ()
              ) -> Path:
    """An aiconfigurator table named by `path`'s stem (e.g. .../gemm_perf.parquet); each row
    gives some columns, the others take the real files' values; `drop` leaves columns out."""
    name = path.name[:-len(".parquet")]
    schema = [(c, t) for c, t in AIC_SCHEMAS[name] if c not in drop]
    base = {"framework": "VLLM", "version": "0.14.0", "device": device, **_AIC_DEFAULTS[name]}
    full = [{**base, **row} for row in rows]
    table = pa.table({c: pa.array([r.get(c) for r in full], type=t) for c, t in schema})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


VIDUR_OP_ORDER = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
                  "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
VIDUR_SHAPE = {"n_head": 32, "n_kv_head": 32, "n_embd": 4096, "n_expanded_embd": 11008,
               "vocab_size": 32768, "use_gated_mlp": "True"}


def write_vidur_ops(path: Path, rows: list[dict], drop: tuple[str, ...] = ()) -> Path:
    """A Vidur `<model>.mlp.csv`: each row gives num_tokens, num_tensor_parallel_workers and
    optionally per-op medians in ms (default 0.1 ms) or raw cells under the real names."""
    header = [f"time_stats.{op}.{s}" for op in VIDUR_OP_ORDER
              for s in ("min", "max", "mean", "median", "std")]
    header += [*VIDUR_SHAPE, "num_tokens", "num_tensor_parallel_workers"]
    header = [c for c in header if c not in drop]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            cells = dict(VIDUR_SHAPE)
            for op in VIDUR_OP_ORDER:
                median = row.get(op, 0.1)
                cells.update({f"time_stats.{op}.min": median, f"time_stats.{op}.max": median,
                              f"time_stats.{op}.mean": median, f"time_stats.{op}.median": median,
                              f"time_stats.{op}.std": 0.0})
            cells.update({k: v for k, v in row.items() if k not in VIDUR_OP_ORDER})
            w.writerow([cells[c] for c in header])
    return path


def write_vidur_allreduce(path: Path, rows: list[dict]) -> Path:
    """A Vidur `<gpu>_dgx.all_reduce.csv`: rows give num_workers, size (bytes), median (ms)
    and optionally devices_per_node (default 8)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["", "time_stats.all_reduce.min", "time_stats.all_reduce.max",
                    "time_stats.all_reduce.mean", "time_stats.all_reduce.median",
                    "time_stats.all_reduce.std", "rank", "num_workers", "size", "collective",
                    "devices_per_node", "max_devices_per_node"])
        for i, r in enumerate(rows):
            med = r["median"]
            w.writerow([i, med, med, med, med, 0.0, 0, r["num_workers"], r["size"], "all_reduce",
                        r.get("devices_per_node", 8), 8])
    return path


def real_measurements() -> Path:
    if not MEASUREMENTS.is_dir():
        raise FileNotFoundError(f"shared GPU measurements not found at {MEASUREMENTS}; "
                                f"set SERVELAB_SHARED")
    return MEASUREMENTS
