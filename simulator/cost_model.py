"""Step-time model: what one engine step costs on a GPU.

A step runs the layer stack once over every scheduled token (prefill chunks and decode
tokens together, flattened without padding). Each kernel of the stack is priced by its own
analytic model (`kernels.py`: a roofline with a time floor, partial overlap of compute and
memory traffic, and shape-dependent efficiency), with parameters from a calibration
profile (`calibration.py`; by default the GPU's packaged profile fitted to measured kernel
times). The step time is

    step_overhead + Σ_class scale[class] · Σ_kernels-of-class calls · kernel_time

Kernels and their classes, per layer unless marked once:

    qkv_proj, o_proj, mlp_gate_up, mlp_down; lm_head (once, one row per sequence)   gemm
    attn_prefill   causal attention of the prefill chunks                          attn_prefill
    attn_decode    one query token per decoding sequence over its cached context   attn_decode
    input_norm, rotary, kv_cache_write, post_attention_norm, silu_mul;
        embedding, final_norm, sampler (once)                                      elementwise
    allreduce (2 per layer under TP); logits all-gather (once)                     collective
    swap           KV blocks over PCIe                                             host_link
    kv_offload     prefix blocks evicted to the CPU tier, over PCIe                host_link
    kv_load        prefix hits loaded from the CPU tier, over PCIe                 host_link
    block_copy     copy-on-write block copies in HBM                               elementwise

A two-matrix MLP (OPT: `ModelSpec.gated_mlp` false) has mlp_fc1, mlp_fc2 (gemm) and its
activation, e.g. relu (elementwise), in place of mlp_gate_up, mlp_down and silu_mul;
learned positions replace rotary with position_embedding and position_add (elementwise,
once); biases ride with their GEMM as bytes streamed (`footprint._build_shapes`).

Shapes are per GPU under tensor parallelism (`footprint.py`). Weights are read once per
step, which is why decode is bandwidth-bound until the batch is large. Simplifications,
stated once: activations are BF16 whatever the weight dtype (FP8 weights run W8A8 at the
FP8 peak where the GPU has one, weight-only otherwise); the LM head and embeddings stay
BF16; the LM head runs for every sequence in the batch (BatchShape does not say which
prefill chunks complete); sliding windows are ignored. Host-link copies (swaps, CPU-tier
offloads and loads) overlap nothing: each kind is one batched copy (the link's latency
plus its bytes at the link bandwidth) added to the step, which is what an engine that
waits for them before computing pays; offloads and loads are not overlapped with each
other either, although PCIe could carry them in opposite directions at once.

Mixture-of-experts and MLA models (`footprint.ShardedShapes` lays them out) add, per layer:

    moe_router, shared_gate_up, shared_down (MoE layers); mlp_* (dense layers only)  gemm
    moe_experts    fused experts over the step's tokens (`kernels.moe`)              gemm
    ep_dispatch, ep_combine   expert-parallel token exchange (dp > 1)                collective
    qkv_a_proj, q_b_proj, o_proj (MLA); attention: the MLA kernels       gemm, attn_prefill/decode

The fused experts run at the expert load of `expert_load` (balanced, or aiconfigurator's
power law) on the most loaded GPU, in FP8 (W8A8, the `moe_fp8` fit) for FP8 weights where
the GPU has FP8 tensor cores. Under expert parallelism wider than tp, a replica is one of
dp = ep / tp data-parallel attention ranks (vLLM's DP + EP): each rank schedules its own
batch, and every MoE layer runs over the tokens of all dp ranks, which vLLM gathers before
the experts and reduce-scatters after them (its default `allgather_reducescatter`
all2all backend; each moves dp × tokens × hidden activations, priced with the fitted
all-to-all link model). `step_time` prices one rank's step as if the other dp - 1 ranks
carried as many tokens as it does (a balanced deployment: what `servelab cost` shows). A
simulation steps the ranks in lock-step as vLLM does (`simulator/data_parallel.py`): each
rank's price is corrected to the MoE layers and exchange over the tokens the ranks
actually carry (`lockstep_correction`), a rank with nothing scheduled runs vLLM's one-token
dummy forward (`dummy_step_time`), and the step lasts as long as the slowest rank's. An
MLA cache holds 1-byte latents under `kv_dtype="fp8"`.

Cost. `step_time` is the hot path (called once per simulated step). Everything that
depends only on the number of tokens (GEMMs, element-wise kernels, all-reduces) or of
sequences (LM head, sampler, logits gather) is tabulated per count the first time a count
is seen — the kernel models are evaluated once per count, not once per step — and decode
attention's coefficients per batch size. A call is then two list lookups and a dozen float
operations. Runs of decode steps are priced in closed form (`decode_run_duration`). A
MoE layer's cost depends on the step's token count only (the expert load is a pure
function of it), so it lives in the per-token table and is constant over a run of decode
steps; MLA decode is linear in the context sum for a fixed batch: the closed form holds
for these models as it is.
`breakdown` and `class_times` build the same sum kernel by kernel, for reports and fitting.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servelab._validate import check_bounded
from servelab.models import ModelSpec, load_model_spec
from servelab.outputs import BatchShape
from servelab.simulator import kernels as K
from servelab.simulator.calibration import OP_CLASSES, CalibrationProfile, resolve
from servelab.simulator.footprint import ACT_BYTES, ShardedShapes, stage_shapes
from servelab.simulator.footprint import kv_capacity_blocks
from servelab.simulator.gpus import DTYPE_BYTES, GPUSpec, get_gpu

__all__ = ["CostModel", "OpCost", "kv_capacity_blocks"]

_TABLE_CHUNK = 1024
_BF16_GEMMS = frozenset({"lm_head", "moe_router"})
"""GEMMs that stay BF16 under FP8 weights (FP8 checkpoints quantise the blocks' linear
layers; vLLM builds the router unquantised)."""


@dataclass(frozen=True, slots=True)
class OpCost:
    """One kernel of one step. `time_s` is for all `calls` of it, scaled; `bound` says
    which side of its roofline dominates: "compute", "memory" (bytes over HBM, NVLink or
    PCIe), "floor" (the kernel's time floor or fixed latency) or "fixed" (step overhead)."""

    op_class: str
    calls: int
    flops: float
    bytes: float
    time_s: float
    bound: str
    per_layer: bool = False


class CostModel:
    """Prices `BatchShape`s for one (model, GPU, tp, dtypes) setup.

    `model` and `gpu` take a spec or a catalog name. `calibration` is a profile, a profile
    file, a packaged profile name or "none" (the bare roofline); by default the GPU's own
    packaged profile (`GPUSpec.calibration`). `block_size` (tokens per KV block) prices
    swaps and block copies. `step_overhead_s` overrides the profile's. `ep` (expert
    parallelism) and `expert_load` ("balanced" or "power-law:ALPHA") apply to
    mixture-of-experts models (see the module docstring). `first_stage` and `last_stage`
    False price one pipeline stage (`simulator/pipeline.py`): `model` is then the stage's
    layers (`footprint.stage_model`), and the once-per-step kernels of the other ends are
    left out (`footprint.stage_shapes`); both True (the default) is the whole model.
    """

    def __init__(self, model: ModelSpec | str, gpu: GPUSpec | str, tp: int = 1,
                 weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                 calibration: CalibrationProfile | str | Path | None = None,
                 block_size: int = 16, step_overhead_s: float | None = None, *,
                 ep: int = 1, expert_load: str = "balanced", first_stage: bool = True,
                 last_stage: bool = True) -> None:
        self.model = load_model_spec(model) if isinstance(model, str) else model
        self.catalog_gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.profile = resolve(self.catalog_gpu, calibration)
        overrides = self.profile.gpu_overrides
        self.gpu = self.catalog_gpu.with_overrides(**overrides) if overrides else self.catalog_gpu
        self.shapes = ShardedShapes.of(self.model, tp, weight_dtype, kv_dtype, ep=ep)
        self.first_stage, self.last_stage = first_stage, last_stage
        if not (first_stage and last_stage):   # one pipeline stage (simulator/pipeline.py)
            self.shapes = stage_shapes(self.shapes, first_stage, last_stage)
        self.ep, self.expert_load = ep, expert_load
        check_bounded("block_size", block_size, 1, integer=True, noun="an integer")
        overhead = self.profile.step_overhead_s if step_overhead_s is None else step_overhead_s
        check_bounded("step_overhead_s", overhead, 0)
        self.tp, self.weight_dtype, self.kv_dtype = tp, weight_dtype, kv_dtype
        self._check_experts()
        self._check_mla_kv()
        self.block_size = block_size
        self.kernels = self.profile.kernels
        self.step_overhead_s = float(overhead)
        self.scales = {c: self.profile.scale(c) for c in OP_CLASSES}
        self._fold_constants()

    # --- construction helpers ---------------------------------------------------------------

    @classmethod
    def from_calibration(cls, profile: CalibrationProfile | str | Path,
                         block_size: int = 16) -> "CostModel":
        """The setup a run-fitted profile describes (device, model, tp, dtypes)."""
        if not isinstance(profile, CalibrationProfile):
            profile = CalibrationProfile.load(profile)
        if profile.model is None:
            raise ValueError("this calibration profile describes a GPU, not a setup: "
                             "build CostModel(model, gpu, calibration=profile)")
        return cls(profile.model, profile.device, tp=profile.tp, weight_dtype=profile.weight_dtype,
                   kv_dtype=profile.kv_dtype, calibration=profile, block_size=block_size)

    def with_calibration(self, profile: CalibrationProfile | str | Path) -> "CostModel":
        """This setup priced with another profile (which must be for this GPU)."""
        return CostModel(self.model, self.catalog_gpu, self.tp, self.weight_dtype,
                         self.kv_dtype, profile, self.block_size, ep=self.ep,
                         expert_load=self.expert_load, first_stage=self.first_stage,
                         last_stage=self.last_stage)

    def _check_mla_kv(self) -> None:
        """One line refusing an FP8 KV cache vLLM cannot run for this MLA model on this GPU."""
        if self.shapes.mla is not None and self.kv_dtype == "fp8" \
                and K.mla.runs_triton_mla(self.gpu):
            raise ValueError(f"{self.model.name}: " + K.mla.triton_fp8_kv_refusal(self.gpu.name))

    def _check_experts(self) -> None:
        """One-line errors for an expert setup the fused-MoE kernel cannot price."""
        kind, _ = K.parse_expert_load(self.expert_load)
        if self.shapes.experts is None:
            if kind != "balanced":
                raise ValueError(f"expert load {self.expert_load!r} applies to mixture-of-experts "
                                 f"models; {self.model.name} has no experts")
            return
        if self.weight_dtype not in ("bf16", "fp16", "fp8"):
            raise ValueError(f"{self.model.name}: the fused-MoE kernel is priced for bf16 and fp8 "
                             f"weights, not {self.weight_dtype}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block on one GPU."""
        return self.block_size * self.shapes.kv_bytes_per_token

    # --- the kernels of the stack ---------------------------------------------------------

    def _gemm_setup(self, name: str) -> tuple[str, K.GemmParams, float, float]:
        """(dtype the GEMM computes in, its parameters, weight bytes, input bytes)."""
        bf16 = name in _BF16_GEMMS
        if bf16 or self.weight_dtype != "fp8":
            wb = DTYPE_BYTES[self.weight_dtype] if not bf16 else ACT_BYTES
            return ("bf16" if self.weight_dtype != "fp32" or bf16 else "fp32",
                    self.kernels.gemm, wb, ACT_BYTES)
        if self.gpu.fp8_tflops is not None:          # W8A8 on FP8 tensor cores
            return "fp8", self.kernels.gemm_fp8, 1.0, 1.0
        return "bf16", self.kernels.gemm, 1.0, ACT_BYTES   # weight-only FP8

    def _gemm_time(self, gm, rows) -> np.ndarray:
        """Seconds of one call of GEMM `gm` at each (integer) row count, from a per-GEMM
        table built once per count. The table is kept non-decreasing: a library's menu can
        make one more row a hair cheaper (a better tile fits), but it could always have
        run the smaller problem padded, so more rows never cost less."""
        rows = np.asarray(rows, dtype=np.int64)
        table = self._gemm_tables.get(gm.name)
        top = int(rows.max(initial=0))
        if table is None or top >= len(table):
            start = 0 if table is None else len(table)
            stop = max(top + 1, 2 * start, _TABLE_CHUNK)
            counts = np.arange(start, stop, dtype=np.float64)
            dtype, params, wb, ib = self._gemm_setup(gm.name)
            t = K.gemm_time(counts, gm.n, gm.k, self.gpu, params, dtype, wb, ib, ACT_BYTES)
            if gm.weight_bytes > gm.weight_elems * wb:          # attention bias
                t = t + (gm.weight_bytes - gm.weight_elems * wb) / (self.gpu.hbm_bandwidth_gbps * 1e9)
            t = np.where(counts > 0, t, 0.0)
            if table is not None:
                t = np.maximum(t, table[-1])
                t = np.concatenate([table, np.maximum.accumulate(t)])
            else:
                t = np.maximum.accumulate(t)
            self._gemm_tables[gm.name] = table = t
        return table[rows]

    def _row_ops(self, rows: np.ndarray, per_seq: bool) -> list[tuple[str, str, int, np.ndarray]]:
        """(name, class, calls per step, seconds per call) of every kernel whose cost
        depends only on the step's token count (per_seq False) or sequence count."""
        s, g, kp = self.shapes, self.gpu, self.kernels
        rows = np.asarray(rows, dtype=np.float64)
        ops = []
        for gm in s.gemms:
            if (gm.name == "lm_head") == per_seq:
                ops.append((gm.name, "gemm", gm.repeat, self._gemm_time(gm, rows)))
        for ew in s.elementwise:
            if ew.per_seq == per_seq:
                ops.append((ew.name, "elementwise", ew.repeat,
                            K.elementwise_time(rows * ew.bytes_per_row, g, kp.elementwise)))
        if self.tp > 1:
            if per_seq:
                # an all-gather moves half an all-reduce's bus traffic for the same bytes
                ops.append(("logits_gather", "collective", 1, K.allreduce_time(
                    rows * s.gather_bytes_per_seq / 2, self.tp, g, kp.collective)))
            else:
                ops.append(("allreduce", "collective", 2 * s.num_layers, K.allreduce_time(
                    rows * s.allreduce_bytes_per_token, self.tp, g, kp.collective)))
        if s.experts is not None and not per_seq:
            ops.extend(self._expert_ops(rows))
        return ops

    def _expert_ops(self, rows: np.ndarray) -> list[tuple[str, str, int, np.ndarray]]:
        """The MoE layers' kernels for `rows` tokens of this rank, whose data-parallel
        peers carry as many (`_group_expert_ops` over dp × rows tokens; the module
        docstring says when that holds)."""
        return self._group_expert_ops(rows * self.shapes.experts.dp)

    def _group_expert_ops(self, tokens: np.ndarray) -> list[tuple[str, str, int, np.ndarray]]:
        """The fused experts of every MoE layer over `tokens` tokens of the data-parallel
        group, and under data-parallel attention the gather of all ranks' tokens before
        them and the reduce-scatter after."""
        x, g = self.shapes.experts, self.gpu
        dtype = "fp8" if self.weight_dtype == "fp8" else "bf16"
        stats = K.expert_load(tokens, x.experts, x.topk, x.ep, self.expert_load)
        t = K.fused_moe_time(tokens, x.hidden, x.width, x.experts, x.topk, x.ep, stats, g,
                             self.kernels.moe_for(dtype, g, x.default_routing, x.ep), dtype)
        ops = [("moe_experts", "gemm", x.num_layers, t)]
        if x.dp > 1:
            exchange = K.alltoall_time(tokens * x.hidden * ACT_BYTES, x.dp, g, self.kernels.alltoall)
            ops += [("ep_dispatch", "collective", x.num_layers, exchange),
                    ("ep_combine", "collective", x.num_layers, exchange)]
        return ops

    def _scaled_rows(self, rows: np.ndarray, per_seq: bool) -> np.ndarray:
        total = np.zeros(len(rows))
        for _, op_class, calls, t in self._row_ops(rows, per_seq):
            total += self.scales[op_class] * calls * t
        return total

    def _decode_coefficients(self, batch: np.ndarray) -> list[tuple[float, float, float, float]]:
        """Every layer's decode attention of each batch size as two lines in the context
        sum C, (f0, f1, a, b): it costs max(f0 + f1·C, a + b·C). MHA/GQA: a floor (f1 = 0)
        and the context line; MLA: its one-read line and its HBM line (`mla_decode_lines`)."""
        s, sc = self.shapes, self.scales["attn_decode"] * self.shapes.num_layers
        if s.mla is not None:
            lines = (v.tolist() for v in self._mla_decode_lines(batch))
            return [(sc * a, sc * b, sc * c, sc * d) for a, b, c, d in zip(*lines)]
        floor, intercept, slope = K.decode_attention_lines(
            batch, s.heads, s.kv_heads, s.head_dim, self.gpu, self.kernels.attn_decode,
            s.kv_elem_bytes)
        floor = np.broadcast_to(floor, batch.shape)
        intercept = np.broadcast_to(intercept, batch.shape)
        slope = np.broadcast_to(slope, batch.shape)
        return [(sc * f, 0.0, sc * a, sc * b) for f, a, b in zip(floor.tolist(), intercept.tolist(),
                                                                 slope.tolist())]

    def _mla_dims(self) -> dict[str, int]:
        m = self.shapes.mla
        return {"kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim,
                "qk_nope_head_dim": m.qk_nope_head_dim, "v_head_dim": m.v_head_dim}

    def _mla_decode_lines(self, batch) -> tuple[np.ndarray, ...]:
        s = self.shapes
        lines = K.mla_decode_lines(batch, s.heads, self.gpu, self.kernels.mla_decode,
                                   s.kv_elem_bytes, **self._mla_dims())
        return tuple(np.broadcast_to(v, np.shape(batch)) for v in lines)

    def _prefill_coefficients(self, params=None) -> tuple[float, ...]:
        """One layer's prefill attention as (floor, per pair, per chunk, per key of the
        longest chunk, per new token, per cached token): MHA/GQA or MLA."""
        s = self.shapes
        if s.mla is not None:
            return tuple(float(c) for c in K.mla_prefill_coefficients(
                s.heads, self.gpu, params or self.kernels.mla_prefill, s.kv_elem_bytes,
                **self._mla_dims()))
        return K.prefill_attention_coefficients(s.heads, s.kv_heads, s.head_dim, self.gpu,
                                                params or self.kernels.attn_prefill,
                                                s.kv_elem_bytes)

    # --- the hot path ----------------------------------------------------------------------

    def _fold_constants(self) -> None:
        s, g, kp, sc = self.shapes, self.gpu, self.kernels, self.scales
        self._gemm_tables: dict[str, np.ndarray] = {}
        self._group_moe: list[float] = []
        """MoE layers and EP exchange over a lock-step group's tokens (filled on first use)."""
        self._tok: list[float] = []
        self._seq: list[float] = []
        self._dec: list[tuple[float, float, float, float]] = []
        self._grow("_tok", _TABLE_CHUNK)
        self._grow("_seq", _TABLE_CHUNK)
        self._grow("_dec", _TABLE_CHUNK)
        L = s.num_layers * sc["attn_prefill"]
        self._pa = tuple(L * c for c in self._prefill_coefficients())
        h, e = kp.host_link, kp.elementwise
        self._swap = (sc["host_link"] * h.latency_s,
                      sc["host_link"] * self.block_bytes / (g.pcie_gbps * 1e9 * h.link_eff))
        self._copy = (sc["elementwise"] * e.floor_s,
                      sc["elementwise"] * 2 * self.block_bytes
                      / (g.hbm_bandwidth_gbps * 1e9 * e.memory_eff))

    def _grow(self, table: str, upto: int) -> list:
        """Extend a per-count table to cover index `upto` (doubling: amortised O(1))."""
        values = getattr(self, table)
        start = len(values)
        stop = max(upto + 1, 2 * start, _TABLE_CHUNK)
        counts = np.arange(start, stop, dtype=np.float64)
        if table == "_dec":
            values.extend(self._decode_coefficients(counts))
            return values
        values.extend(self._scaled_rows(counts, per_seq=table == "_seq").tolist())
        return values

    def step_time(self, shape: BatchShape) -> float:
        """Modelled seconds of one engine step of composition `shape`."""
        t = self.step_overhead_s
        npt = shape.num_prefill_tokens
        nds = shape.num_decode_seqs
        n_tok = npt + nds
        if n_tok:
            tok = self._tok
            if n_tok >= len(tok):
                tok = self._grow("_tok", n_tok)
            n_seq = shape.num_prefill_seqs + nds
            seq = self._seq
            if n_seq >= len(seq):
                seq = self._grow("_seq", n_seq)
            t += tok[n_tok] + seq[n_seq]
            if npt:
                floor, pair, per_seq, per_key, per_tok, per_ctx = self._pa
                qc, qq = shape.prefill_q_context_sum, shape.prefill_q_sq_sum
                keys = (qq + qc) / npt
                if shape.prefill_max_keys > keys:
                    keys = shape.prefill_max_keys
                t += (floor + (qc + 0.5 * (qq + npt)) * pair + shape.num_prefill_seqs * per_seq
                      + keys * per_key + npt * per_tok + shape.prefill_context_sum * per_ctx)
            if nds:
                dec = self._dec
                if nds >= len(dec):
                    dec = self._grow("_dec", nds)
                f0, f1, a, b = dec[nds]
                ctx = shape.decode_context_sum
                x, y = a + b * ctx, f0 + f1 * ctx
                t += x if x > y else y
        if shape.num_swap_blocks:
            t += self._swap[0] + shape.num_swap_blocks * self._swap[1]
        if shape.num_offload_blocks:
            t += self._swap[0] + shape.num_offload_blocks * self._swap[1]
        if shape.num_load_blocks:
            t += self._swap[0] + shape.num_load_blocks * self._swap[1]
        if shape.num_copy_blocks:
            t += self._copy[0] + shape.num_copy_blocks * self._copy[1]
        return t

    def expert_width_note(self) -> str | None:
        """One line when this layout leaves the routed experts a width per GPU that is not a
        multiple of 16, which the fused-MoE fit prices slower (`MoEParams.misaligned_slowdown`);
        None otherwise."""
        x = self.shapes.experts
        if x is None or not K.moe.misaligned_width(x.hidden, x.width):
            return None
        dtype = "fp8" if self.weight_dtype == "fp8" else "bf16"
        slowdown = self.kernels.moe_for(dtype, self.gpu, x.default_routing, x.ep).misaligned_slowdown
        return (f"{self.model.name} at this layout: {K.moe.misaligned_note(x.width, slowdown)} "
                "(docs/moe-mla.md)")

    # --- data-parallel ranks in lock-step (`simulator/data_parallel.py`) -------------------

    @property
    def data_parallel_ranks(self) -> int:
        """dp: the data-parallel attention ranks whose tokens every MoE layer runs over
        together (ep / tp under expert parallelism wider than tp), 1 for every other setup."""
        return 1 if self.shapes.experts is None else self.shapes.experts.dp

    def lockstep_correction(self, rank_tokens: int, group_tokens: int) -> float:
        """Seconds to add to a data-parallel rank's `step_time` of `rank_tokens` tokens
        when the ranks of its group carry `group_tokens` together: `step_time` runs the
        MoE layers and the EP exchange over dp × rank_tokens tokens (peers as busy as
        this rank), a lock-step group over the tokens its ranks actually carry. 0 when
        every rank carries as many. O(1) once a count has been tabulated."""
        dp = self.data_parallel_ranks
        if dp == 1:
            raise ValueError(f"lock-step pricing is for the data-parallel ranks of a mixture-of-"
                             f"experts model with ep above tp; {self.model.name} at tp={self.tp}, "
                             f"ep={self.ep} has none")
        if isinstance(rank_tokens, bool) or not 0 <= rank_tokens <= group_tokens:
            raise ValueError(f"rank_tokens must be an integer in [0, group_tokens={group_tokens}], "
                             f"got {rank_tokens!r}")
        table = self._group_moe
        top = max(group_tokens, dp * rank_tokens)
        if top >= len(table):
            stop = max(top + 1, 2 * len(table), _TABLE_CHUNK)
            counts = np.arange(len(table), stop, dtype=np.float64)
            total = np.zeros(len(counts))
            for _, op_class, calls, t in self._group_expert_ops(counts):
                total += self.scales[op_class] * calls * t
            table.extend(np.where(counts > 0, total, 0.0).tolist())
        return table[group_tokens] - table[dp * rank_tokens]

    def dummy_step_time(self, group_tokens: int) -> float:
        """An idle rank's step in a lock-step group: vLLM's dummy batch, one token through
        every layer (`Worker.execute_dummy_batch` runs `GPUModelRunner._dummy_run(1)`:
        hidden states only, no LM head or sampler, no KV read), its MoE layers over the
        group's `group_tokens` (which include that one token). The step overhead is
        charged as for any step."""
        return self.step_overhead_s + self._tok[1] + self.lockstep_correction(1, group_tokens)

    # --- fast-forward over runs of decode steps --------------------------------------------

    def _run_lines(self, shape: BatchShape) -> tuple[float, float, float, float, float]:
        """Step j of a run costs fixed + max(a + b·j, c + d·j): decode attention's two lines
        (`_decode_coefficients`; for MHA/GQA its floor, b = 0, against its context line),
        every decoding sequence adding a token to the context each step."""
        n, ctx = shape.num_decode_seqs, shape.decode_context_sum
        if not n:   # nothing grows: every step is the same
            return self.step_time(shape), 0.0, 0.0, 0.0, 0.0
        if n >= len(self._dec):
            self._grow("_dec", n)
        f0, f1, a, b = self._dec[n]
        y, c = f0 + f1 * ctx, a + b * ctx
        # Everything but decode attention is constant over the run: subtracting the decode
        # term step_time added recovers it to within a rounding or two.
        fixed = self.step_time(shape) - max(y, c)
        return fixed, y, f1 * n, c, b * n

    def decode_run_lines(self, shape: BatchShape) -> tuple[float, float, float, float, float]:
        """(fixed, a, b, c, d): step j of a decode run from `shape` (see
        `decode_run_duration`) costs fixed + max(a + b·j, c + d·j)."""
        _check_shape(shape)
        return self._run_lines(shape)

    @staticmethod
    def _run_total(fixed: float, a: float, b: float, c: float, d: float, k: int) -> float:
        """Σ_{j<k} fixed + max(a + b·j, c + d·j), in closed form."""
        return _split_total(fixed, _split_lines(a, b, c, d), k)

    def decode_run_duration(self, shape: BatchShape, num_steps: int,
                            end_times: bool = False) -> tuple[float, np.ndarray | None]:
        """Seconds of `num_steps` identical decode steps in which only decode context grows.

        Step j (0-based) has `shape`'s composition with decode_context_sum increased by
        j·num_decode_seqs (every decoding sequence gains one token per step). The total is
        in closed form, equal to summing `step_time` step by step up to float rounding.
        With `end_times`, also the end time of every step relative to the run's start
        (a numpy cumulative sum, O(num_steps) memory).
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
            raise ValueError(f"num_steps must be an integer >= 0, got {num_steps!r}")
        fixed, a, b, c, d = self._run_lines(shape)
        total = self._run_total(fixed, a, b, c, d, int(num_steps))
        if not end_times:
            return total, None
        j = np.arange(num_steps, dtype=np.float64)
        return total, np.cumsum(fixed + np.maximum(a + b * j, c + d * j))

    @property
    def host_copy(self) -> tuple[float, float]:
        """(seconds per batched copy, seconds per block) of KV blocks over the host link:
        what a step's swaps, or its offloads or loads of the CPU tier, each add."""
        return self._swap

    def decode_run_steps_within(self, shape: BatchShape, budget_s: float,
                                max_steps: int | None = None, extra=None) -> int:
        """The most whole steps of a decode run (see `decode_run_duration`) that end within
        `budget_s`, capped at `max_steps`; O(1): a quadratic solve and a ±1 correction.
        `extra(k)`: seconds the first k steps take besides their kernels (non-decreasing
        in k, e.g. host-tier copies); then O(log steps)."""
        if not budget_s >= 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s!r}")
        if max_steps is not None and (isinstance(max_steps, bool) or max_steps < 0):
            raise ValueError(f"max_steps must be an integer >= 0, got {max_steps!r}")
        lines = self._run_lines(shape)
        pieces = _split_lines(*lines[1:])
        return self._steps_within_extra(lines, budget_s, max_steps, pieces, extra)

    def decode_run_until(self, shape: BatchShape, max_steps: int, budget_s: float,
                         extra=None) -> tuple[int, float]:
        """(k, seconds) of the decode run (see `decode_run_duration`) of at most `max_steps`
        steps that start before `budget_s`: those that end within it, and the one under
        way at `budget_s` if it starts strictly before. What a simulator engine can run
        before an arrival at `budget_s` could change the batch. One pricing of `shape`.
        `extra` as for `decode_run_steps_within`, and in the seconds."""
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"max_steps must be an integer >= 0, got {max_steps!r}")
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
        lines = self._run_lines(shape)
        pieces = _split_lines(*lines[1:])
        k = self._steps_within_extra(lines, budget_s, max_steps, pieces, extra)
        total = _extra_total(lines[0], pieces, k, extra)
        if k < max_steps and total < budget_s:
            k += 1
            total = _extra_total(lines[0], pieces, k, extra)
        return k, total

    def _steps_within_extra(self, lines: tuple[float, float, float, float, float],
                            budget_s: float, max_steps: int | None, pieces: tuple, extra) -> int:
        """`_steps_within` with `extra(k)` seconds added to the first k steps: the steps
        within the budget without it bound the answer, a bisection below finds it."""
        k = self._steps_within(lines, budget_s, max_steps, pieces)
        if extra is None:
            return k
        lo = 0
        while lo < k:
            mid = (lo + k + 1) // 2
            if _extra_total(lines[0], pieces, mid, extra) <= budget_s:
                lo = mid
            else:
                k = mid - 1
        return lo

    def _steps_within(self, lines: tuple[float, float, float, float, float], budget_s: float,
                      max_steps: int | None, pieces: tuple) -> int:
        """`decode_run_steps_within` on the run's lines and their `_split_lines`."""
        fixed, a, b, c, d = lines
        first = fixed + max(a, c)
        if first <= 0 or budget_s == math.inf:
            if max_steps is None:
                raise ValueError("this decode run is unbounded (free steps or an infinite "
                                 "budget): pass max_steps")
            return max_steps
        # per-step times never fall, so k <= budget/first; +1 absorbs the division's
        # rounding, and the exact totals below settle the answer
        cap = math.floor(budget_s / first) + 1
        if max_steps is not None:
            cap = min(cap, max_steps)
        split, (lo_a, lo_b), (hi_a, hi_b) = pieces
        if split >= cap or _split_total(fixed, pieces, split) > budget_s:
            k = _steps_in_budget(fixed + lo_a, lo_b, budget_s)
        else:    # the first piece fits whole: solve the rest on the second line
            rest = budget_s - _split_total(fixed, pieces, split)
            k = split + _steps_in_budget(fixed + hi_a + hi_b * split, hi_b, rest)
        k = min(cap, max(0, k))
        while k < cap and _split_total(fixed, pieces, k + 1) <= budget_s:   # float rounding
            k += 1
        while k > 0 and _split_total(fixed, pieces, k) > budget_s:
            k -= 1
        return k

    # --- slow paths: per-kernel view and the fitting design row ---------------------------

    def breakdown(self, shape: BatchShape) -> dict[str, OpCost]:
        """Every kernel of the step (plus "step_overhead"); the times sum to `step_time`."""
        _check_shape(shape)
        s, g, kp, sc = self.shapes, self.gpu, self.kernels, self.scales
        out = {"step_overhead": OpCost("overhead", 1, 0.0, 0.0, self.step_overhead_s, "fixed")}
        npt, nds = shape.num_prefill_tokens, shape.num_decode_seqs
        n_tok, n_seq = npt + nds, shape.num_prefill_seqs + nds
        L = s.num_layers
        for rows, per_seq in ((n_tok, False), (n_seq, True)):
            if not rows:
                continue
            for name, op_class, calls, t in self._row_ops(np.array([rows], float), per_seq):
                flops, nbytes, bound = self._row_op_physics(name, rows)
                out[name] = OpCost(op_class, calls, flops * calls, nbytes * calls,
                                   sc[op_class] * calls * float(t[0]), bound, calls % L == 0)
        if npt and s.mla is not None:
            out["attn_prefill"] = self._mla_prefill_cost(shape)
        elif npt:
            t = K.prefill_attention_time(
                shape.num_prefill_seqs, npt, shape.prefill_q_context_sum, shape.prefill_q_sq_sum,
                shape.prefill_context_sum, s.heads, s.kv_heads, s.head_dim, g, kp.attn_prefill,
                s.kv_elem_bytes, max_keys=shape.prefill_max_keys)
            bare = K.prefill_attention_coefficients(s.heads, s.kv_heads, s.head_dim, g,
                                                    K.PrefillAttentionParams(), s.kv_elem_bytes)
            qc, qq = shape.prefill_q_context_sum, shape.prefill_q_sq_sum
            flops = 4.0 * s.head_dim * s.heads * (qc + 0.5 * (qq + npt))
            nbytes = (npt * bare[4] + shape.prefill_context_sum * bare[5]) * g.hbm_bandwidth_gbps * 1e9
            p = kp.attn_prefill
            bound = _bound(flops / (g.peak_flops("bf16") * p.compute_eff),
                           nbytes / (g.hbm_bandwidth_gbps * 1e9 * p.memory_eff), p.floor_s)
            out["attn_prefill"] = OpCost("attn_prefill", L, L * flops, L * nbytes,
                                         sc["attn_prefill"] * L * float(t), bound, True)
        if nds and s.mla is not None:
            out["attn_decode"] = self._mla_decode_cost(shape)
        elif nds:
            ctx = shape.decode_context_sum
            t = K.decode_attention_time(nds, ctx, s.heads, s.kv_heads, s.head_dim, g,
                                        kp.attn_decode, s.kv_elem_bytes)
            floor, a, b = (float(v) for v in K.decode_attention_lines(
                nds, s.heads, s.kv_heads, s.head_dim, g, kp.attn_decode, s.kv_elem_bytes))
            nbytes = ctx * 2.0 * s.kv_heads * s.head_dim * s.kv_elem_bytes
            out["attn_decode"] = OpCost("attn_decode", L, L * 4.0 * s.head_dim * s.heads * ctx,
                                        L * nbytes, sc["attn_decode"] * L * float(t),
                                        "floor" if floor >= a + b * ctx else "memory", True)
        for name, blocks in (("swap", shape.num_swap_blocks),
                             ("kv_offload", shape.num_offload_blocks),
                             ("kv_load", shape.num_load_blocks)):
            if blocks:
                nbytes = blocks * self.block_bytes
                out[name] = OpCost("host_link", 1, 0.0, nbytes, sc["host_link"] * float(
                    K.host_copy_time(nbytes, g, kp.host_link)), "memory")
        if shape.num_copy_blocks:
            nbytes = 2 * shape.num_copy_blocks * self.block_bytes
            out["block_copy"] = OpCost("elementwise", 1, 0.0, nbytes, sc["elementwise"] * float(
                K.elementwise_time(nbytes, g, kp.elementwise)), "memory")
        return out

    def _row_op_physics(self, name: str, rows: int) -> tuple[float, float, str]:
        """(FLOPs, bytes, bound) of one call of a token- or sequence-count kernel."""
        s, g, kp = self.shapes, self.gpu, self.kernels
        for gm in s.gemms:
            if gm.name == name:
                dtype, params, wb, ib = self._gemm_setup(name)
                flops = 2.0 * gm.weight_elems * rows
                nbytes = gm.weight_bytes + rows * (gm.k * ib + gm.n * ACT_BYTES)
                compute = flops / (g.peak_flops(dtype) * params.compute_eff)
                memory = nbytes / (g.hbm_bandwidth_gbps * 1e9 * params.memory_eff)
                return flops, nbytes, _bound(compute, memory, params.floor_s)
        for ew in s.elementwise:
            if ew.name == name:
                nbytes = rows * ew.bytes_per_row
                memory = nbytes / (g.hbm_bandwidth_gbps * 1e9 * kp.elementwise.memory_eff)
                return 0.0, nbytes, _bound(0.0, memory, kp.elementwise.floor_s)
        x = s.experts
        if name == "moe_experts":
            tokens = rows * x.dp
            active, pairs = (float(v[0]) for v in K.expert_load([tokens], x.experts, x.topk, x.ep,
                                                                 self.expert_load)[:2])
            dtype = "fp8" if self.weight_dtype == "fp8" else "bf16"
            p = kp.moe_for(dtype, g, x.default_routing, x.ep)
            w8a8 = K.moe.kernel_dtype(dtype, g) == "fp8"
            per_expert = 3.0 * x.hidden * x.width
            flops = 2.0 * pairs * per_expert
            nbytes = (active * per_expert * DTYPE_BYTES[dtype]
                      + pairs * (2 * x.hidden + 3 * x.width) * (1 if w8a8 else ACT_BYTES))
            eff = float(K.moe.layer_compute_eff(p, g, dtype, x.experts, x.ep, x.width))
            compute = flops / (g.peak_flops("fp8" if w8a8 else "bf16") * eff)
            memory = nbytes / (g.hbm_bandwidth_gbps * 1e9 * p.memory_eff)
            return flops, nbytes, _bound(compute, memory, p.floor_s)
        if name in ("ep_dispatch", "ep_combine"):
            return 0.0, rows * x.dp * x.hidden * ACT_BYTES, "memory"
        per_row = s.gather_bytes_per_seq if name == "logits_gather" else s.allreduce_bytes_per_token
        return 0.0, rows * per_row, "memory"

    def _mla_prefill_cost(self, shape: BatchShape) -> OpCost:
        """Every layer's MLA prefill (`breakdown`), summed as `step_time` sums it."""
        s, g, m, L = self.shapes, self.gpu, self.shapes.mla, self.shapes.num_layers
        npt, qc, qq = shape.num_prefill_tokens, shape.prefill_q_context_sum, shape.prefill_q_sq_sum
        ctx = shape.prefill_context_sum
        floor, pair, per_seq, per_key, per_tok, per_ctx = self._prefill_coefficients()
        pairs = qc + 0.5 * (qq + npt)
        keys = max(shape.prefill_max_keys, (qq + qc) / npt)
        t = (floor + pairs * pair + shape.num_prefill_seqs * per_seq + keys * per_key
             + npt * per_tok + ctx * per_ctx)
        qk, latent, nv = m.qk_head_dim, m.cached_values, m.qk_nope_head_dim + m.v_head_dim
        flops = (pairs * s.heads * 2.0 * (qk + m.v_head_dim)
                 + 2.0 * (npt + ctx) * m.kv_lora_rank * s.heads * nv)
        kvb = s.kv_elem_bytes
        nbytes = (npt * (s.heads * (qk + m.v_head_dim) * 2 + latent * (2 + kvb))
                  + (npt + ctx) * s.heads * nv * 4 + ctx * latent * kvb)
        p = self.kernels.mla_prefill
        bound = _bound(flops / (g.peak_flops("bf16") * p.compute_eff),
                       nbytes / (g.hbm_bandwidth_gbps * 1e9 * p.memory_eff), p.floor_s)
        return OpCost("attn_prefill", L, L * flops, L * nbytes,
                      self.scales["attn_prefill"] * L * t, bound, True)

    def _mla_decode_cost(self, shape: BatchShape) -> OpCost:
        """Every layer's MLA decode (`breakdown`)."""
        s, g, m, L = self.shapes, self.gpu, self.shapes.mla, self.shapes.num_layers
        nds, ctx = shape.num_decode_seqs, shape.decode_context_sum
        a, b, c, d = (float(v[0]) for v in self._mla_decode_lines(np.array([float(nds)])))
        latent = m.cached_values
        flops = 2.0 * s.heads * ctx * (latent + m.kv_lora_rank)
        p = self.kernels.mla_decode
        reads = float(K.mla.mla_latent_reads(nds, ctx, s.heads, g, p, s.kv_elem_bytes,
                                             m.kv_lora_rank, m.qk_rope_head_dim))
        nbytes = reads * ctx * latent * s.kv_elem_bytes
        one_read, every_block = a + b * ctx, c + d * ctx
        if every_block > one_read:   # blocks of heads re-reading latents L2 no longer holds
            bound = "memory"
        else:
            compute = flops / (g.peak_flops("bf16") * p.compute_eff)
            memory = nbytes / (g.hbm_bandwidth_gbps * 1e9 * p.memory_eff)
            bound = "floor" if a >= b * ctx else ("compute" if compute > memory else "memory")
        return OpCost("attn_decode", L, L * flops, L * nbytes,
                      self.scales["attn_decode"] * L * max(one_read, every_block), bound, True)

    def class_times(self, shape: BatchShape) -> dict[str, float]:
        """Seconds per op class at scale 1 (`OP_CLASSES`): step_time == overhead +
        Σ scale[class] · class_times[class]."""
        times = dict.fromkeys(OP_CLASSES, 0.0)
        for name, op in self.breakdown(shape).items():
            if name != "step_overhead":
                times[op.op_class] += op.time_s / self.scales[op.op_class]
        return times

    def features(self, shape: BatchShape) -> dict[str, float]:
        """The design row of a step for `validation.fit`: "overhead" (1) and each op class's
        seconds at scale 1; step_time == Σ coefficients()[k] · features[k]."""
        return {"overhead": 1.0, **self.class_times(shape)}

    def coefficients(self) -> dict[str, float]:
        return {"overhead": self.step_overhead_s, **self.scales}


def _bound(compute: float, memory: float, floor: float) -> str:
    if floor > max(compute, memory):
        return "floor"
    return "compute" if compute > memory else "memory"


def _split_lines(a: float, b: float, c: float, d: float
                 ) -> tuple[float, tuple[float, float], tuple[float, float]]:
    """Where max(a + b·j, c + d·j) switches lines: (split, line on j < split, line on
    j >= split), each line as (intercept, slope); split is an int >= 0 or math.inf."""
    # The (a, b) line wins where (a - c) + (b - d)·j > 0: a prefix or a suffix of j >= 0.
    if b > d:
        cross = (c - a) / (b - d)
        split = 0 if cross < 0 else (math.inf if cross == math.inf else math.floor(cross) + 1)
        return split, (c, d), (a, b)
    if b < d:
        cross = (a - c) / (d - b)
        split = 0 if cross <= 0 else (math.inf if cross == math.inf else math.ceil(cross))
        return split, (a, b), (c, d)
    return math.inf, ((a, b) if a > c else (c, d)), (0.0, 0.0)


def _extra_total(fixed: float, split_lines: tuple, k: int, extra) -> float:
    """`_split_total` plus `extra(k)`, the run's seconds besides its kernels (None: none)."""
    total = _split_total(fixed, split_lines, k)
    return total + extra(k) if extra is not None else total


def _split_total(fixed: float, split_lines: tuple, k: int) -> float:
    """Σ_{j<k} fixed + (the winning line at j), the lines as `_split_lines` gives them."""
    if k <= 0:
        return 0.0
    split, (lo_a, lo_b), (hi_a, hi_b) = split_lines
    split = min(split, k)
    total = k * fixed
    if split > 0:
        total += _line_sum(lo_a, lo_b, 0, split)
    if split < k:
        total += _line_sum(hi_a, hi_b, split, k)
    return total


def _line_sum(p: float, q: float, j0: int, j1: int) -> float:
    """Σ_{j0 <= j < j1} (p + q·j)."""
    m = j1 - j0
    return m * p + q * m * (j0 + j1 - 1) / 2


def _steps_in_budget(t0: float, g: float, budget: float) -> int:
    """Largest m with Σ_{j<m} (t0 + g·j) <= budget (t0 > 0, g >= 0), up to float rounding:
    the root of g/2·m² + (t0 − g/2)·m − budget, in its cancellation-free form."""
    if g == 0:
        return math.floor(budget / t0)
    half = t0 - g / 2
    root = math.sqrt(half * half + 2 * g * budget)
    m = 2 * budget / (half + root) if half > 0 else (root - half) / g
    return math.floor(m)


def _check_shape(shape: BatchShape) -> None:
    for name in BatchShape.__slots__:
        value = getattr(shape, name)
        if value < 0:
            raise ValueError(f"BatchShape.{name} must be >= 0, got {value!r}")
    if shape.num_prefill_tokens and not shape.num_prefill_seqs:
        raise ValueError("BatchShape has prefill tokens but num_prefill_seqs == 0")
