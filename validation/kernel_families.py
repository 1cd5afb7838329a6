"""Kernel families: which measurements each kernel model is fitted to, with which
parameters and bounds, how a measured row is predicted, and the size bands it is judged in.

A family is data, not code paths: `kernel_fit.fit_family` fits any of them the same way,
and a new kernel model is one more `Family` here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from servelab.simulator import kernels as K
from servelab.simulator.gpus import GPUSpec
from servelab.simulator.kernels.movement import SYMM_MEM_MAX
from servelab.validation.measurements import Table



@dataclass(frozen=True)
class Family:
    """How one kernel family is fitted and judged."""

    name: str
    """The `KernelParams` field it fills."""
    table: str
    select: Callable[[Table], np.ndarray]
    """Which rows of the table this family is fitted to."""
    fitted: dict[str, tuple[float, float, float]]
    """Parameter -> (lower bound, upper bound, starting value)."""
    predict: Callable[[Table, GPUSpec, object], np.ndarray]
    band: Callable[[Table], np.ndarray]
    """A label per row for the per-band figures."""
    band_order: tuple[str, ...]
    fixed: Callable[[GPUSpec], dict] = lambda gpu: {}
    """Parameters set, not fitted, on a GPU (a kernel property such as which attention
    kernel its architecture runs); a fixed name is dropped from `fitted`."""
    alternatives: Callable[[GPUSpec], tuple[dict, ...]] = lambda gpu: ()
    """Other kernel paths an engine may run on this GPU, each a whole set of `fixed` values
    used instead of the default one; each is fitted too and the lowest loss on the training rows wins (which
    kernel a GPU runs depends on the engine version as well as the architecture)."""
    untold: Callable[[Table], dict] = lambda table: {}
    """Parameters a table cannot tell, set to their neutral value rather than fitted (how
    decode's per-item cost grows with head_dim, where the table measures one head_dim):
    fitted, they would wander without changing a prediction."""
    starts: tuple[dict, ...] = ({},)
    """Starting points to try (each overrides some starting values); the best fit wins."""
    size_axes: tuple[str, ...] = ()
    """Columns along which a larger value is strictly more work (for `glitches`)."""
    prepare: Callable[[Table], Table] = lambda table: table
    """Columns derived once per table that `predict` reads (e.g. the expected expert load
    of a fused-MoE row, too costly to redo at every step of a fit)."""
    canonical: Callable[[object], object] = lambda params: params
    """The fitted parameters in their one canonical form, for models with equivalent
    forms (the all-to-all's three protocol lines, whichever order the fit found them in)."""


def _band(values: np.ndarray, edges: tuple[float, ...], labels: tuple[str, ...]) -> np.ndarray:
    return np.array(labels, dtype=object)[np.searchsorted(edges, values, side="left")]


M_BANDS = ("m 1-32", "m 33-512", "m 513-4096", "m > 4096")
PREFILL_BANDS = ("tokens <= 512", "tokens 513-4096", "tokens 4097-32768", "tokens > 32768")
DECODE_BANDS = tuple(f"batch {b}, context {c}" for b in ("1-8", "9-64", "> 64")
                     for c in ("<= 1k", "1k-16k", "> 16k"))
ALLREDUCE_BANDS = tuple(f"{n} GPUs, {s}" for n in (2, 4, 8) for s in ("<= 64 KiB", "64 KiB-8 MiB", "> 8 MiB"))
TOKEN_BANDS = ("tokens 1-32", "tokens 33-512", "tokens > 512")


def _gemm_predict(t: Table, gpu: GPUSpec, p, dtype: str) -> np.ndarray:
    # as measured: an isolated GEMM replayed with its weights (warm L2)
    if dtype == "fp8":
        return K.gemm_time(t["m"], t["n"], t["k"], gpu, p, "fp8", 1.0, 1.0, 2.0, warm_l2=True)
    return K.gemm_time(t["m"], t["n"], t["k"], gpu, p, "bf16", 2.0, 2.0, 2.0, warm_l2=True)


_GEMM_FITTED = {
    "floor_s": (5e-7, 4e-5, 2.5e-6), "compute_eff": (0.3, 1.0, 0.9), "memory_eff": (0.3, 1.0, 0.85),
    "overlap": (1.0, 12.0, 3.0), "epilogue_overlap": (1.0, 12.0, 1.5),
    "cta_overlap": (1.0, 12.0, 3.0), "k_step_s": (1e-12, 2e-8, 2e-9),
    "sm_feed_gbps": (10.0, 3000.0, 150.0), "split_k_min": (32.0, 65536.0, 500.0),
    "split_k_s": (1e-8, 1e-5, 1e-6), "write_penalty": (0.5, 4.0, 1.2),
    "gemv_k_step_s": (1e-12, 2e-8, 5e-10), "wave_quantization": (1e-3, 1.0, 0.5),
    "l2_fraction": (0.05, 2.0, 0.7), "l2_gain": (1.0, 20.0, 2.0),
    "quant_elem_s": (1e-14, 2e-10, 1e-11), "quant_row_s": (1e-13, 1e-7, 1e-9)}


def _gemm_starts(n: int) -> tuple[dict, ...]:
    """The generic start, then `n - 1` seeded log-normal perturbations of it: the menu's
    minimum makes the loss surface ragged, and a few starts find its floor reliably."""
    rng = np.random.default_rng(1)
    starts = [{}]
    for _ in range(n - 1):
        # quant_row_s came later and keeps its generic start, so the other parameters'
        # draws stay those the packaged profiles were fitted from
        start = {k: v[2] * float(np.exp(rng.normal(0, 0.4))) for k, v in _GEMM_FITTED.items()
                 if k != "quant_row_s"}
        for name in ("compute_eff", "memory_eff", "wave_quantization"):
            start[name] = min(start[name], 0.99)
        starts.append(start)
    return tuple(starts)


def _kv_bytes(t: Table) -> np.ndarray:
    return np.where(t["kv_dtype"] == "fp8", 1.0, 2.0)


def _prefill_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    # batch b sequences of s new tokens each, nothing cached before them, as measured:
    # one layer replayed (warm L2); the timed call writes the cache or not as its engine
    # version and kernel do (`measurements.forward_writes_cache`)
    b, s = t["batch"].astype(float), t["tokens"].astype(float)
    writes = t["writes_cache"] if "writes_cache" in t.columns else True
    return K.prefill_attention_time(b, b * s, 0.0, b * s * s, 0.0, t["heads"], t["kv_heads"],
                                    t["head_dim"], gpu, p, _kv_bytes(t), warm_l2=True,
                                    cache_write=writes)


def _decode_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    b = t["batch"].astype(float)
    return K.decode_attention_time(b, b * t["context"], t["heads"], t["kv_heads"], t["head_dim"],
                                   gpu, p, _kv_bytes(t), warm_l2=True, seq_context=t["context"])


FA3_ARCHITECTURES = ("hopper",)
"""GPUs whose engines run FlashAttention 3 (query-head packing, split-KV decode for every
head layout); the others run FlashAttention 2 (vLLM 0.14)."""


def _collective_fixed(gpu: GPUSpec) -> dict:
    return {"fabric_gbps": 0.0} if gpu.nvlink_gbps is not None else {}


_NO_SYMM_MEM = {"symm_mem": 0.0, "symm_latency_s": 0.0, "symm_link_eff": 1.0}


def _allreduce_fixed(gpu: GPUSpec) -> dict:
    """The engine's all-reduce without PyTorch symmetric memory (custom, then NCCL). Without
    NVLink the custom all-reduce runs between two GPUs only, always one-stage: nothing
    measures the two-stage kernel."""
    no_two_stage = {} if gpu.nvlink_gbps is not None else {"two_shot_s": 0.0,
                                                            "two_shot_hop_s": 0.0}
    return {**_collective_fixed(gpu), **_NO_SYMM_MEM, **no_two_stage}


def _allreduce_alternatives(gpu: GPUSpec) -> tuple[dict, ...]:
    """With symmetric memory on, where the GPU could take that path (an NVSwitch, a listed
    compute capability): whether the measured engine had it on is a default that moved
    between versions, so the tables decide."""
    if gpu.nvlink_gbps is None or gpu.compute_capability not in SYMM_MEM_MAX:
        return ()
    return ({**_collective_fixed(gpu), "symm_mem": 1.0},)


def _prefill_fixed(gpu: GPUSpec) -> dict:
    return {"packs_gqa": 1.0 if gpu.architecture in FA3_ARCHITECTURES else 0.0}


_ONE_SPLIT_KV_PATH = {"split_floor_s": 0.0, "mha_block_gbps": 0.0, "gqa_copy_s": 0.0}
"""FlashAttention 3's decode: one split-KV kernel path for every head layout, the query
groups packed by the kernel."""


def _decode_fixed(gpu: GPUSpec) -> dict:
    if gpu.architecture in FA3_ARCHITECTURES:
        return dict(_ONE_SPLIT_KV_PATH)
    return {"batch_saturation": 1.0}


def _mla_decode_fixed(gpu: GPUSpec) -> dict:
    """The Triton MLA kernel's blocks of 16 heads and 4 KV splits (`MLADecodeParams.head_block`),
    its split results passed through L2 where they fit; elsewhere one read for every head,
    and neither L2 share to fit."""
    if K.mla.runs_triton_mla(gpu):
        return {"head_block": 16.0, "kv_splits": 4.0}
    return {"head_block": 0.0, "reread_l2_fraction": 0.0, "reread_seqs": 0.0,
            "partials_l2_fraction": 0.0, "partials_l2_gain": 1.0}


def _prefill_alternatives(gpu: GPUSpec) -> tuple[dict, ...]:
    """Newer engines run kernels that pack query heads on other GPUs too (vLLM 0.24 on
    B200: FlashInfer's TRT-LLM kernels)."""
    return () if gpu.architecture in FA3_ARCHITECTURES else ({"packs_gqa": 1.0},)


def _decode_alternatives(gpu: GPUSpec) -> tuple[dict, ...]:
    """As for prefill: FlashAttention 3's one split-KV path for every head layout (TRT-LLM
    decode on B200)."""
    return () if gpu.architecture in FA3_ARCHITECTURES else (dict(_ONE_SPLIT_KV_PATH),)


def _attention_rows(t: Table) -> np.ndarray:
    """BF16-KV rows; 1-token prefills are excluded (they take the decode kernel's path)."""
    keep = t["kv_dtype"] == "bf16"
    return keep & (t["tokens"] > 1) if "tokens" in t.columns else keep


def _allreduce_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    return K.allreduce_time(t["nbytes"], t["num_gpus"], gpu, p)


def _elementwise_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    return K.elementwise_time(t["nbytes"], gpu, p)


# -------------------------------------------------------------------- MoE, MLA, all-to-all


MOE_BANDS = tuple(f"tokens {t}, experts {e}, EP {p}"
                  for t in ("1-32", "33-512", "513-4096", "> 4096")
                  for e in ("<= 16", "17-160", "> 160") for p in ("1", "2-8", "> 8"))
ALLTOALL_BANDS = tuple(f"{n} GPUs, {s}" for n in (2, 4, 8)
                       for s in ("<= 1 MiB", "1-64 MiB", "> 64 MiB"))


def moe_load_columns(t: Table) -> Table:
    """The table with each row's expected expert load (`kernels.expert_load`: active
    experts, pairs, tiles per tile height) added, computed once per routing shape."""
    if not len(t) or "load_active" in t.columns:
        return t
    stats = np.zeros((2 + len(K.moe.TILE_ROWS), len(t)))
    keys = list(zip(t["experts"].tolist(), t["topk"].tolist(), t["ep"].tolist(),
                    t["load"].tolist(), t["top_up"].tolist()))
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    for (experts, topk, ep, load, top_up), rows in groups.items():
        stats[:, rows] = K.expert_load(t["tokens"][rows], experts, topk, ep, load, top_up)
    cols = dict(t.columns)
    cols["load_active"], cols["load_pairs"] = stats[0], stats[1]
    cols["load_tiles"] = stats[2:].T
    return Table(t.family, cols, list(t.origin))


def _moe_predict(t: Table, gpu: GPUSpec, p, dtype: str) -> np.ndarray:
    stats = np.concatenate([t["load_active"][None], t["load_pairs"][None], t["load_tiles"].T])
    return K.moe.fused_moe_time(t["tokens"], t["hidden"], t["inter"] / t["tp"], t["experts"],
                                t["topk"], t["ep"], stats, gpu, p, dtype, warm_l2=True,
                                gated=t["gated"])


def _moe_band(t: Table) -> np.ndarray:
    tok = _band(t["tokens"], (32, 512, 4096), ("1-32", "33-512", "513-4096", "> 4096"))
    exp = _band(t["experts"], (16, 160), ("<= 16", "17-160", "> 160"))
    ep = _band(t["ep"], (1, 8), ("1", "2-8", "> 8"))
    return np.array([f"tokens {a}, experts {b}, EP {c}" for a, b, c in zip(tok, exp, ep)],
                    dtype=object)


TRITON_MOE = {"small_tile_rows": 16.0, "large_tile_rows": 64.0, "naive_sparsity": 4.0,
              "small_stream_rows": 16.0, "large_stream_rows": 512.0}
"""vLLM's Triton fused MoE: the default config's 16-row tiles while tokens <= the local
experts (experts / EP: the layer holds only its own) and 64-row ones above
(`get_default_config`, before vllm-project/vllm#34846), grouped GROUP_SIZE_M = 1 and 8 (so
an expert's weights are read once per 16 and per 512 of its pairs), and the small-batch
path that gives every pair its own tile when tokens x top-k x 4 <= experts without EP
(SPARSITY_FACTOR, vllm-project/vllm#29354 and #39016)."""
GROUPED_GEMM_MOE = {"small_tile_rows": 128.0, "large_tile_rows": 128.0, "naive_sparsity": 0.0,
                    "small_stream_rows": 0.0, "large_stream_rows": 0.0, "large_memory_eff": 1.0}
"""A grouped-GEMM library (FlashInfer's CUTLASS or TRT-LLM kernels, which vLLM 0.24 runs on
Hopper and Blackwell for some dtypes): fixed 128-row tiles, no small-batch path, no
switch of tile config with the batch, each expert's weights read once (persistent
kernels)."""

_MOE_FITTED = {"floor_s": (1e-6, 1e-3, 2e-5), "compute_eff": (0.03, 1.0, 0.4),
               "small_tile_eff": (0.05, 1.0, 0.5), "memory_eff": (0.2, 1.0, 0.8),
               "overlap": (1.0, 20.0, 3.0), "combine_traffic": (1e-3, 50.0, 1.0),
               "quant_elem_s": (1e-15, 1e-9, 1e-11), "l2_fraction": (0.05, 2.0, 0.5),
               "l2_gain": (1.0, 20.0, 2.0), "tuned_compute_eff": (0.03, 1.0, 0.6),
               "width_knee": (256.0, 1e6, 16384.0), "expert_s": (1e-9, 2e-5, 5e-7),
               "k_depth_s": (1e-13, 1e-7, 4e-9), "large_memory_eff": (0.1, 1.0, 0.8),
               "remote_pair_share": (0.01, 6.0, 0.5), "misaligned_slowdown": (1.0, 4.0, 1.3),
               "combine_l2_fraction": (0.05, 4.0, 1.0), "combine_l2_gain": (1.0, 20.0, 2.0)}


def _block_fp8_rows(t: Table) -> np.ndarray:
    block = t["dtype"] == "fp8_block"
    return block if block.any() else t["dtype"] == "fp8"


def _ep_kernel_split(t: Table) -> np.ndarray:
    """The FP8 rows (`_block_fp8_rows`) with EP above 1 where those ran another kernel than
    the rows without EP, on every row of each side (vLLM 0.24 on H100: FlashInfer's CUTLASS
    kernel under EP, 9,234 rows, and Triton without, 5,988): else none."""
    rows = _block_fp8_rows(t)
    if "kernel" not in t.columns or not rows.any():
        return np.zeros(len(t), dtype=bool)
    ep = rows & (t["ep"] > 1)
    with_ep, without = set(t["kernel"][ep].tolist()), set(t["kernel"][rows & ~ep].tolist())
    split = len(with_ep) == 1 and len(without) == 1 and with_ep != without
    return ep if split else np.zeros(len(t), dtype=bool)


def _fp8_moe_rows(t: Table) -> np.ndarray:
    """The FP8 fused-MoE rows the `moe_fp8` family is fitted to: block-scaled ones
    (`fp8_block`, 128 x 128 weight scales) where the table has any, else per-tensor ones.
    The catalog's FP8 MoE checkpoints are block-scaled (DeepSeek-V3's and Qwen3's -FP8:
    `quantization_config.weight_block_size` [128, 128]), and the two scalings run different
    kernels: under vLLM 0.24 on H100 the per-tensor rows are ModelOpt checkpoints on
    FlashInfer's CUTLASS kernel, 2-4x the block rows' times (Triton without EP, CUTLASS with
    it); on B200 TRT-LLM's block kernel runs about 30% slower than its per-tensor one.
    Where the rows under EP ran another kernel than the rows without, those are the
    `moe_fp8_ep` family's (`_ep_kernel_split`)."""
    return _block_fp8_rows(t) & ~_ep_kernel_split(t)


def _flashinfer_cutlass(t: Table) -> np.ndarray:
    if "kernel" not in t.columns:
        return np.zeros(len(t), dtype=bool)
    return np.array(["flashinfer_cutlass" in str(k) for k in t["kernel"]], dtype=bool)


def _bf16_moe_rows(t: Table) -> np.ndarray:
    """The BF16 fused-MoE rows of the engine's default kernel, which the `moe` family is
    fitted to: every BF16 row, but where a table measured FlashInfer's CUTLASS kernel
    beside another (vLLM 0.24 on B200: TRT-LLM's, 12,424 rows against CUTLASS's 1,944 on
    two layer shapes, priced 30-60% fast by one fit of both) those rows are the
    `moe_cutlass` family's: another kernel, which the engine runs only for a routing its
    default one does not take (`KernelParams.moe_cutlass`)."""
    bf16 = t["dtype"] == "bf16"
    default = bf16 & ~_flashinfer_cutlass(t)
    return default if default.any() else bf16


def _cutlass_moe_rows(t: Table) -> np.ndarray:
    """FlashInfer CUTLASS BF16 rows beside another BF16 kernel's (`_bf16_moe_rows`)."""
    bf16 = t["dtype"] == "bf16"
    cutlass = bf16 & _flashinfer_cutlass(t)
    return cutlass if (bf16 & ~cutlass).any() else np.zeros(len(t), dtype=bool)


def _moe_untold(t: Table) -> dict:
    """No misaligned-width term where the table has no layer of such a width."""
    widths = t["inter"] / t["tp"]
    return {} if K.moe.misaligned_width(t["hidden"], widths).any() else {"misaligned_slowdown": 1.0}


def _moe_family(name: str, dtype: str, rows: Callable[[Table], np.ndarray] | None = None,
                grouped_gemm: bool = False) -> Family:
    """A fused-MoE family; `grouped_gemm`: its rows are FlashInfer's CUTLASS kernel, priced
    with the grouped-GEMM library's settings only (no Triton tiles or tuned configs)."""
    fixed = dict(TRITON_MOE, **({"quant_elem_s": 0.0} if dtype == "bf16" else {}))
    # the grouped-GEMM libraries do not read vLLM's tuned Triton configs
    other = dict(GROUPED_GEMM_MOE, tuned_compute_eff=0.0,
                 **({"quant_elem_s": 0.0} if dtype == "bf16" else {}))

    def triton(gpu: GPUSpec) -> dict:
        """The Triton kernel's settings; no tuned-config efficiency where vLLM has none."""
        tuned = K.moe.VLLM_TUNED_MOE.get((gpu.name, dtype))
        return dict(fixed, **({} if tuned else {"tuned_compute_eff": 0.0}))

    return Family(
        name, "moe", rows or (_fp8_moe_rows if dtype == "fp8" else _bf16_moe_rows), _MOE_FITTED,
        lambda t, g, p: _moe_predict(t, g, p, dtype), _moe_band, MOE_BANDS,
        fixed=(lambda gpu: dict(other)) if grouped_gemm else triton,
        alternatives=(lambda gpu: ()) if grouped_gemm else (lambda gpu: (dict(other),)),
        # the third start: a low floor, the rest of it in the K loops (`k_depth_s`), near
        # where the H100 fits end; from the first two the fit keeps a floor twice the
        # fastest narrow layers' times and k_depth_s near 0
        starts=({}, {"compute_eff": 0.7, "small_tile_eff": 0.9, "overlap": 1.5},
                {"floor_s": 1.2e-5, "k_depth_s": 4e-9, "compute_eff": 0.3, "overlap": 1.4,
                 "combine_traffic": 1.9, "l2_fraction": 0.45, "l2_gain": 19.0}),
        size_axes=("tokens",), prepare=moe_load_columns, untold=_moe_untold)


def _mla_prefill_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    return K.mla_prefill_time(t["batch"], t["tokens"], t["heads"], gpu, p,
                              kv_bytes=_kv_bytes(t), eager=True)


def _mla_decode_predict(t: Table, gpu: GPUSpec, p) -> np.ndarray:
    b = t["batch"].astype(float)
    return K.mla_decode_time(b, b * t["context"], t["heads"], gpu, p, kv_bytes=_kv_bytes(t),
                             eager=True)


_EAGER = {"eager_floor_s": (1e-5, 1e-3, 2e-4), "overlap": (1.0, 30.0, 6.0)}
"""The vLLM 0.14 MLA tables were timed eagerly: a call takes the larger of the host's
launch time and the GPU's (`kernels.mla`), and `floor_s` is the GPU's own floor. Under
the eager floor the tables cannot show it, so it is bounded below by 5 µs: the cache
write, the absorption or up-projection GEMMs and the attention are at least four kernels,
even replayed in a CUDA graph, and the GEMM floors fitted on these GPUs are 2-3 µs each."""
_EAGER_STARTS = ({}, {"overlap": 2.0}, {"overlap": 15.0, "floor_s": 6e-6})


def _alltoall_band(t: Table) -> np.ndarray:
    s = _band(t["nbytes"], (1 << 20, 64 << 20), ("<= 1 MiB", "1-64 MiB", "> 64 MiB"))
    return np.array([f"{n} GPUs, {x}" for n, x in zip(t["num_gpus"], s)], dtype=object)


def _protocols_in_order(p: K.AllToAllParams) -> K.AllToAllParams:
    """The three protocol lines named by bandwidth, lowest first (LL, LL128, Simple): the
    time is their minimum, so the order a fit finds them in is arbitrary."""
    lines = sorted([(p.link_eff, p.latency_s), (p.ll128_link_eff, p.ll128_latency_s),
                    (p.simple_link_eff, p.simple_latency_s)])
    if any(eff == 0 for eff, _ in lines):
        return p
    (e1, l1), (e2, l2), (e3, l3) = lines
    return replace(p, link_eff=e1, latency_s=l1, ll128_link_eff=e2, ll128_latency_s=l2,
                   simple_link_eff=e3, simple_latency_s=l3)


_ALLTOALL_STARTS = tuple(
    {"latency_s": ll, "ll128_latency_s": ll128, "simple_latency_s": simple}
    for ll, ll128, simple in ((5e-6, 1e-5, 3e-5), (1e-5, 2e-5, 5e-5), (1e-5, 3e-5, 1e-4)))
"""Three protocol lines (LL, LL128, Simple: `kernels.AllToAllParams`) make the loss
surface ragged: a few orderings of their latencies find its floor reliably."""

FRACTION = (0.05, 1.0)
FAMILIES: dict[str, Family] = {
    "gemm": Family(
        "gemm", "gemm", lambda t: t["dtype"] == "bf16", _GEMM_FITTED,
        lambda t, g, p: _gemm_predict(t, g, p, "bf16"),
        lambda t: _band(t["m"], (32, 512, 4096), M_BANDS), M_BANDS, size_axes=("m", "n", "k"),
        fixed=lambda gpu: {"quant_elem_s": 0.0, "quant_row_s": 0.0}, starts=_gemm_starts(3)),
    "gemm_fp8": Family(
        "gemm_fp8", "gemm", lambda t: t["dtype"] == "fp8", _GEMM_FITTED,
        lambda t, g, p: _gemm_predict(t, g, p, "fp8"),
        lambda t: _band(t["m"], (32, 512, 4096), M_BANDS), M_BANDS, size_axes=("m", "n", "k"),
        starts=_gemm_starts(3)),
    "attn_prefill": Family(
        "attn_prefill", "attn_prefill", _attention_rows,
        {"floor_s": (1e-7, 1e-3, 1e-5), "compute_eff": (*FRACTION, 0.55),
         "memory_eff": (0.01, 1.0, 0.5), "padded_tile_pairs": (1.0, 1e5, 5000.0),
         "critical_path": (1e-3, 5.0, 0.5), "l2_gain": (1.0, 4.0, 1.2),
         "pair_head_s": (1e-17, 1e-11, 1e-14)},
        _prefill_predict,
        lambda t: _band(t["batch"] * t["tokens"], (512, 4096, 32768), PREFILL_BANDS), PREFILL_BANDS,
        fixed=_prefill_fixed, alternatives=_prefill_alternatives, size_axes=("batch", "tokens")),
    "attn_decode": Family(
        "attn_decode", "attn_decode", _attention_rows,
        {"floor_s": (1e-7, 1e-3, 1e-5), "split_floor_s": (1e-8, 1e-4, 4e-6),
         "gqa_copy_s": (1e-8, 1e-4, 4e-6),
         "seq_head_s": (1e-12, 1e-6, 3e-9), "work_item_s": (1e-11, 1e-6, 2e-8),
         "q_head_s": (1e-13, 1e-7, 5e-10), "memory_eff": (*FRACTION, 0.8),
         "head_stream_gbps": (1.0, 1e4, 300.0), "batch_saturation": (1.0, 256.0, 8.0),
         "mha_block_gbps": (0.1, 1e3, 20.0), "l2_gain": (1.0, 4.0, 1.2),
         "item_dim_share": (1e-3, 1.0, 1e-3)},
        _decode_predict,
        lambda t: _decode_band(t), DECODE_BANDS, fixed=_decode_fixed,
        alternatives=_decode_alternatives, size_axes=("batch", "context"),
        untold=lambda t: {} if len(np.unique(t["head_dim"])) > 1 else {"item_dim_share": 0.0},
        starts=tuple({"head_stream_gbps": r, "batch_saturation": b}
                     for r in (300.0, 1000.0) for b in (1.5, 12.0))),
    "collective": Family(
        "collective", "allreduce", lambda t: t["backend"] == "vllm_graph",
        {"custom_latency_s": (1e-7, 1e-4, 5e-6), "two_shot_s": (1e-8, 1e-4, 3e-6),
         "two_shot_hop_s": (1e-9, 1e-4, 1e-6),
         "custom_link_eff": (0.01, 1.0, 0.5),
         "ring_latency_s": (1e-7, 1e-3, 1e-5), "ring_link_eff": (0.01, 1.0, 0.7),
         "hop_s": (1e-10, 1e-4, 3e-7), "fabric_gbps": (0.1, 1e3, 20.0),
         "symm_latency_s": (1e-7, 1e-4, 1e-5), "symm_link_eff": (0.01, 1.0, 0.5)},
        _allreduce_predict,
        lambda t: _allreduce_band(t), ALLREDUCE_BANDS, size_axes=("nbytes",),
        fixed=_allreduce_fixed, alternatives=_allreduce_alternatives),
    "elementwise": Family(
        "elementwise", "vidur_elementwise", lambda t: np.ones(len(t), dtype=bool),
        {"floor_s": (1e-7, 1e-4, 3e-6), "memory_eff": (0.01, 1.0, 0.5)},
        _elementwise_predict,
        lambda t: _band(t["num_tokens"], (32, 512), TOKEN_BANDS), TOKEN_BANDS,
        size_axes=("num_tokens",)),
    "moe": _moe_family("moe", "bf16"),
    "moe_fp8": _moe_family("moe_fp8", "fp8"),
    "moe_cutlass": _moe_family("moe_cutlass", "bf16", _cutlass_moe_rows, grouped_gemm=True),
    "moe_fp8_ep": _moe_family("moe_fp8_ep", "fp8", _ep_kernel_split, grouped_gemm=True),
    "mla_prefill": Family(
        "mla_prefill", "mla_prefill", _attention_rows,
        {"floor_s": (5e-6, 2e-4, 2e-5), "compute_eff": (*FRACTION, 0.5),
         "gemm_eff": (0.01, 1.0, 0.5), "memory_eff": (0.05, 1.0, 0.8),
         "padded_tile_pairs": (1.0, 1e5, 1000.0), "critical_path": (1e-3, 5.0, 0.5),
         **_EAGER},
        _mla_prefill_predict,
        lambda t: _band(t["batch"] * t["tokens"], (512, 4096, 32768), PREFILL_BANDS),
        PREFILL_BANDS, size_axes=("batch", "tokens"), starts=_EAGER_STARTS),
    "mla_decode": Family(
        "mla_decode", "mla_decode", _attention_rows,
        {"floor_s": (5e-6, 2e-4, 2e-5), "compute_eff": (*FRACTION, 0.5),
         "memory_eff": (*FRACTION, 0.8), "seq_stream_gbps": (1.0, 1e4, 100.0),
         "seq_s": (1e-11, 1e-5, 1e-7), "absorb_eff": (0.01, 1.0, 0.5),
         "seq_head_s": (1e-12, 1e-6, 1e-8), "one_head_stream_gbps": (1.0, 1e4, 20.0),
         "reread_l2_fraction": (0.01, 1.0, 0.5), "reread_seqs": (1.0, 1e4, 64.0),
         "partials_l2_fraction": (0.01, 4.0, 0.5), "partials_l2_gain": (1.0, 20.0, 2.0), **_EAGER},
        _mla_decode_predict, lambda t: _decode_band(t), DECODE_BANDS,
        size_axes=("batch", "context"), fixed=_mla_decode_fixed,
        starts=(*_EAGER_STARTS, {"compute_eff": 0.4, "reread_seqs": 100.0,
                                 "reread_l2_fraction": 0.3})),
    "alltoall": Family(
        "alltoall", "nccl", lambda t: t["op"] == "alltoall",
        {"latency_s": (1e-7, 1e-3, 1e-5), "hop_s": (1e-10, 1e-4, 1e-6),
         "link_eff": (0.01, 1.0, 0.1), "fabric_gbps": (0.1, 1e3, 20.0),
         "ll128_latency_s": (1e-7, 1e-3, 2e-5), "ll128_link_eff": (0.01, 1.0, 0.4),
         "simple_latency_s": (1e-7, 1e-3, 5e-5), "simple_link_eff": (0.01, 1.0, 0.9),
         "copy_gbps": (10.0, 1e5, 1000.0)},
        lambda t, g, p: K.alltoall_time(t["nbytes"], t["num_gpus"], g, p),
        _alltoall_band, ALLTOALL_BANDS, size_axes=("nbytes",),
        fixed=lambda gpu: {**_collective_fixed(gpu), "pcie_direct_max_gpus": 2.0},
        starts=_ALLTOALL_STARTS, canonical=_protocols_in_order),
}


def _decode_band(t: Table) -> np.ndarray:
    b = _band(t["batch"], (8, 64), ("batch 1-8", "batch 9-64", "batch > 64"))
    c = _band(t["context"], (1024, 16384), ("context <= 1k", "context 1k-16k", "context > 16k"))
    return np.array([f"{x}, {y}" for x, y in zip(b, c)], dtype=object)


def _allreduce_band(t: Table) -> np.ndarray:
    s = _band(t["nbytes"], (65536, 8 * 1024 * 1024), ("<= 64 KiB", "64 KiB-8 MiB", "> 8 MiB"))
    return np.array([f"{n} GPUs, {x}" for n, x in zip(t["num_gpus"], s)], dtype=object)


# ----------------------------------------------------------------- Vidur element-wise


def vidur_elementwise(ops: Table) -> Table:
    """Vidur's bandwidth-bound operators as one row each: (op, tokens, bytes, seconds).

    Bytes read + written per token of each operator as Vidur runs it (unfused, eager, fp16):
    RMSNorm reads and writes the hidden state; the residual add reads two and writes one;
    rotary reads and writes Q and K of this GPU's heads; SiLU·mul reads gate and up and
    writes one; the embedding reads a table row and writes it."""
    if not len(ops):
        return Table("vidur_elementwise", {}, [])
    h, inter = ops["n_embd"].astype(float), ops["n_expanded_embd"].astype(float)
    tp = ops["num_tensor_parallel_workers"].astype(float)
    heads, kv = ops["n_head"] / tp, np.maximum(ops["n_kv_head"] / tp, 1)
    hd = h / ops["n_head"]
    a = 2.0
    per_token = {"input_layernorm": 2 * h * a, "post_attention_layernorm": 2 * h * a,
                 "add": 3 * h * a, "attn_rope": 2 * (heads + kv) * hd * a,
                 "mlp_act": 3 * inter / tp * a, "emb": 2 * h * a}
    parts = []
    for op, per in per_token.items():
        tokens = ops["num_tokens"].astype(float)
        cols = {"op": np.array([op] * len(ops), dtype=object), "model": ops["model"],
                "num_tokens": ops["num_tokens"], "num_tensor_parallel_workers": tp.astype(int),
                "nbytes": tokens * per, "latency_s": ops[op]}
        parts.append(Table("vidur_elementwise", cols, [f"{o} ({op})" for o in ops.origin]))
    return Table.concat("vidur_elementwise", parts)
