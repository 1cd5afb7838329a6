"""Roofline step-time model: what one engine step costs on a GPU.

A step runs the layer stack once over every scheduled token (prefill chunks and decode
tokens together, flattened without padding). Each op is priced at

    max(FLOPs / (peak · eff_compute), bytes / (bandwidth · eff_memory))

and the step time is a fixed overhead plus the sum over ops. Shapes are per GPU under
tensor parallelism (heads, intermediate and vocab split tp ways; KV heads replicated when
tp exceeds them, as engines do). Weights are read once per step, which is why decode is
bandwidth-bound until the batch is large.

Ops and their classes (each class has its own efficiencies, see `calibration.Efficiencies`):

    qkv_proj, o_proj, mlp_gate_up, mlp_down, lm_head    gemm
    attn_prefill   causal attention of prefill chunks     attn_prefill
    attn_decode    one query token over a cached context  attn_decode
    elementwise    norms, SiLU·mul, rotary, embedding     elementwise (memory only)
    collective     2 all-reduces per layer + logits gather under TP   collective (link)
    swap           KV blocks over PCIe                    swap (link)
    block_copy     copy-on-write block copies in HBM      elementwise (memory only)

Simplifications, stated once: activations are BF16 whatever the weight dtype; under FP8
weights the LM head and embeddings stay BF16 (as FP8 checkpoints ship them); attention
computes at the BF16 peak; the LM head runs for every sequence in the batch (BatchShape
does not say which prefill chunks complete); flash attention's re-reads of K/V per query
tile are ignored (prefill attention is compute-bound where they would matter); sliding
windows are ignored.

Cost. `step_time` is the hot path (called once per simulated step): every per-model
constant is folded in `__init__`, so a call is one bisection and ~30 float operations, with
no allocation. `breakdown` and `features` build the same sum op by op, for reports and
fitting. Runs of decode steps are priced in closed form (`decode_run_duration`). Per-GPU
shapes, weight bytes and the KV capacity an engine would derive live in `footprint.py`.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servelab.models import ModelSpec, load_model_spec
from servelab.outputs import BatchShape
from servelab.simulator.calibration import (
    DEFAULT_STEP_OVERHEAD_S, CalibrationProfile, Efficiencies, coefficients,
    default_efficiencies)
from servelab.simulator.footprint import ACT_BYTES, ShardedShapes
from servelab.simulator.footprint import kv_capacity_blocks
from servelab.simulator.gpus import GPUSpec, get_gpu

__all__ = ["CostModel", "OpCost", "kv_capacity_blocks"]

_CLASS_EFF = {  # op class -> (compute efficiency field, memory efficiency field, memory feature)
    "gemm": ("gemm_compute", "gemm_memory", "gemm.memory"),
    "attn_prefill": ("attn_prefill_compute", "attn_prefill_memory", "attn_prefill.memory"),
    "attn_decode": ("attn_decode_compute", "attn_decode_memory", "attn_decode.memory"),
    "elementwise": (None, "elementwise_memory", "elementwise.memory"),
    "collective": (None, "collective_link", "collective.link"),
    "swap": (None, "swap_link", "swap.link"),
}


@dataclass(frozen=True, slots=True)
class OpCost:
    """One op of one step. `bound` says which roofline side set `time_s`: "compute",
    "memory" (bytes over HBM, NVLink or PCIe), or "fixed" (the step overhead)."""

    flops: float
    bytes: float
    time_s: float
    bound: str
    op_class: str


@dataclass(frozen=True, slots=True)
class _Term:
    """An op at efficiency 1: the raw roofline terms `features` exposes to a fitter."""

    name: str
    op_class: str
    flops: float
    bytes: float
    compute_s: float     # flops / peak
    memory_s: float      # bytes / bandwidth of the link the op is bound by
    per_seq_s: float = 0.0   # decode attention: one token of KV per sequence, / bandwidth
    latency_count: float = 0.0   # collective launches


class CostModel:
    """Prices `BatchShape`s for one (model, GPU, tp, dtypes) setup.

    `model` and `gpu` take a spec or a catalog name. `block_size` (tokens per KV block)
    prices swaps and block copies. Efficiencies default to the device's published anchors
    (`calibration.default_efficiencies`).
    """

    def __init__(self, model: ModelSpec | str, gpu: GPUSpec | str, tp: int = 1,
                 weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                 efficiencies: Efficiencies | None = None,
                 step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S, block_size: int = 16) -> None:
        self.model = load_model_spec(model) if isinstance(model, str) else model
        self.gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.shapes = ShardedShapes.of(self.model, tp, weight_dtype, kv_dtype)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if isinstance(step_overhead_s, bool) or not isinstance(step_overhead_s, (int, float)) \
                or not 0 <= step_overhead_s < math.inf:
            raise ValueError(f"step_overhead_s must be a finite number >= 0, got {step_overhead_s!r}")
        self.tp, self.weight_dtype, self.kv_dtype = tp, weight_dtype, kv_dtype
        self.block_size = block_size
        self.efficiencies = efficiencies if efficiencies is not None else default_efficiencies(self.gpu.name)
        self.step_overhead_s = float(step_overhead_s)
        self._fold_constants()

    # --- construction helpers ---------------------------------------------------------------

    @classmethod
    def from_calibration(cls, profile: CalibrationProfile | str | Path,
                         block_size: int = 16) -> "CostModel":
        """The setup a profile describes (device, model, tp, dtypes) with its parameters."""
        if not isinstance(profile, CalibrationProfile):
            profile = CalibrationProfile.load(profile)
        gpu = get_gpu(profile.device)
        if profile.gpu_overrides:
            gpu = gpu.with_overrides(**profile.gpu_overrides)
        return cls(profile.model, gpu, tp=profile.tp, weight_dtype=profile.weight_dtype,
                   kv_dtype=profile.kv_dtype, efficiencies=profile.efficiencies,
                   step_overhead_s=profile.step_overhead_s, block_size=block_size)

    def with_calibration(self, profile: CalibrationProfile | str | Path) -> "CostModel":
        """This setup with a profile's efficiencies, overhead and device overrides.

        The profile must be for this device (efficiencies are fractions of *its* peaks);
        another model, tp or dtype is allowed: efficiencies transfer approximately.
        """
        if not isinstance(profile, CalibrationProfile):
            profile = CalibrationProfile.load(profile)
        if profile.device != self.gpu.name:
            raise ValueError(f"calibration profile is for device {profile.device!r}, "
                             f"this cost model prices {self.gpu.name!r}")
        gpu = self.gpu.with_overrides(**profile.gpu_overrides) if profile.gpu_overrides else self.gpu
        return CostModel(self.model, gpu, self.tp, self.weight_dtype, self.kv_dtype,
                         profile.efficiencies, profile.step_overhead_s, self.block_size)

    def with_efficiencies(self, efficiencies: Efficiencies,
                          step_overhead_s: float | None = None) -> "CostModel":
        overhead = self.step_overhead_s if step_overhead_s is None else step_overhead_s
        return CostModel(self.model, self.gpu, self.tp, self.weight_dtype, self.kv_dtype,
                         efficiencies, overhead, self.block_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block on one GPU."""
        return self.block_size * self.shapes.kv_bytes_per_token

    # --- the hot path ----------------------------------------------------------------------

    def _fold_constants(self) -> None:
        """Fold shapes, peaks and efficiencies into per-token seconds for `step_time`."""
        s, g, e = self.shapes, self.gpu, self.efficiencies
        bw = g.hbm_bandwidth_gbps * 1e9
        gemm_c = g.peak_flops(self.weight_dtype) * e.gemm_compute
        lm_c = g.peak_flops("bf16") * e.gemm_compute
        gemm_m = bw * e.gemm_memory
        # Per GEMM: (FLOP-seconds per token, weight-read seconds, activation seconds per token).
        gemms = [(2 * gm.weight_elems * gm.repeat / (lm_c if gm.name == "lm_head" else gemm_c),
                  gm.weight_bytes * gm.repeat / gemm_m,
                  gm.act_elems_per_token * ACT_BYTES * gm.repeat / gemm_m) for gm in s.gemms]
        self._lm_head = gemms[-1]
        self._layer_gemms = _PiecewiseGemms(gemms[:-1])
        self._elem = s.elementwise_bytes_per_token / (bw * e.elementwise_memory)
        attn_c = g.peak_flops("bf16")
        kv_layer = s.kv_bytes_per_token / s.num_layers          # one token, one layer, K and V
        q_bytes = 2 * s.q_dim * ACT_BYTES                       # read Q, write O
        pm = bw * e.attn_prefill_memory
        self._pa_c = s.attn_flops_per_pair / (attn_c * e.attn_prefill_compute)
        self._pa_ctx = s.num_layers * kv_layer / pm
        self._pa_tok = s.num_layers * (2 * kv_layer + q_bytes) / pm   # read own K/V, write it
        dm = bw * e.attn_decode_memory
        self._da_c = s.attn_flops_per_pair / (attn_c * e.attn_decode_compute)
        self._da_kv = s.num_layers * kv_layer / dm
        self._da_seq = s.num_layers * (kv_layer + q_bytes) / dm       # write new K/V, Q and O
        self._da_half = e.attn_decode_context_half
        link = g.interconnect_gbps * 1e9 * e.collective_link
        self._col_tok = s.allreduce_bytes_per_token / link
        self._col_lm = s.gather_bytes_per_seq / link
        self._col_fixed = s.num_collectives * e.collective_latency_s
        self._swap = self.block_bytes / (g.pcie_gbps * 1e9 * e.swap_link)
        self._copy = 2 * self.block_bytes / (bw * e.elementwise_memory)
        # One flat tuple, unpacked once per call: the cheapest way to read ~30 constants.
        self._k = (self.step_overhead_s, self._layer_gemms.breaks, self._layer_gemms.pieces,
                   *self._lm_head, self._elem,
                   self.tp > 1, self._col_tok, self._col_lm, self._col_fixed, self._pa_c, self._pa_ctx,
                   self._pa_tok, self._da_c, self._da_kv, self._da_seq, self._da_half,
                   self._swap, self._copy)

    def step_time(self, shape: BatchShape) -> float:
        """Modelled seconds of one engine step of composition `shape`."""
        (overhead, breaks, pieces, c4, w4, a4, elem,
         multi_gpu, col_tok, col_lm, col_fixed, pa_c, pa_ctx, pa_tok, da_c, da_kv, da_seq, da_half,
         swap, copy) = self._k
        t = overhead
        npt = shape.num_prefill_tokens
        nds = shape.num_decode_seqs
        n_tok = npt + nds
        if n_tok:
            n_seq = shape.num_prefill_seqs + nds
            slope, intercept = pieces[bisect_left(breaks, n_tok)]   # layer GEMMs
            t += n_tok * slope + intercept
            x = n_seq * c4                          # LM head: one row per sequence
            y = w4 + n_seq * a4
            t += x if x > y else y
            t += n_tok * elem
            if multi_gpu:
                t += n_tok * col_tok + n_seq * col_lm + col_fixed
            if npt:
                pairs = shape.prefill_q_context_sum + 0.5 * (shape.prefill_q_sq_sum + npt)
                x = pairs * pa_c
                y = shape.prefill_context_sum * pa_ctx + npt * pa_tok
                t += x if x > y else y
            if nds:
                ctx = shape.decode_context_sum
                x = ctx * da_c
                y = (ctx + nds * da_half) * da_kv + nds * da_seq
                t += x if x > y else y
        if shape.num_swap_blocks:
            t += shape.num_swap_blocks * swap
        if shape.num_copy_blocks:
            t += shape.num_copy_blocks * copy
        return t

    # --- fast-forward over runs of decode steps --------------------------------------------

    def _run_lines(self, shape: BatchShape) -> tuple[float, float, float, float, float]:
        """Step j of a run costs fixed + max(a + b·j, c + d·j) (compute vs memory line)."""
        n, ctx = shape.num_decode_seqs, shape.decode_context_sum
        if not n:   # nothing grows: every step is the same
            return self.step_time(shape), 0.0, 0.0, 0.0, 0.0
        a, b = ctx * self._da_c, n * self._da_c
        c = (ctx + n * self._da_half) * self._da_kv + n * self._da_seq
        # Everything but decode attention is constant over the run: subtracting the decode
        # term step_time added recovers it to within a rounding or two.
        fixed = self.step_time(shape) - max(a, c)
        return fixed, a, b, c, n * self._da_kv

    @staticmethod
    def _run_total(fixed: float, a: float, b: float, c: float, d: float, k: int) -> float:
        """Σ_{j<k} fixed + max(a + b·j, c + d·j), in closed form."""
        if k <= 0:
            return 0.0
        split, (lo_a, lo_b), (hi_a, hi_b) = _split_lines(a, b, c, d)
        split = min(split, k)
        total = k * fixed
        if split > 0:
            total += _line_sum(lo_a, lo_b, 0, split)
        if split < k:
            total += _line_sum(hi_a, hi_b, split, k)
        return total

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

    def decode_run_steps_within(self, shape: BatchShape, budget_s: float,
                                max_steps: int | None = None) -> int:
        """The most whole steps of a decode run (see `decode_run_duration`) that end within
        `budget_s`, capped at `max_steps`; O(1): a quadratic solve and a ±1 correction."""
        if not budget_s >= 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s!r}")
        if max_steps is not None and (isinstance(max_steps, bool) or max_steps < 0):
            raise ValueError(f"max_steps must be an integer >= 0, got {max_steps!r}")
        return self._steps_within(self._run_lines(shape), budget_s, max_steps)

    def decode_run_until(self, shape: BatchShape, max_steps: int, budget_s: float,
                         ) -> tuple[int, float]:
        """(k, seconds) of the decode run (see `decode_run_duration`) of at most `max_steps`
        steps that start before `budget_s`: those that end within it, and the one under
        way at `budget_s` if it starts strictly before. What a simulator engine can run
        before an arrival at `budget_s` could change the batch. One pricing of `shape`."""
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"max_steps must be an integer >= 0, got {max_steps!r}")
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
        lines = self._run_lines(shape)
        k = self._steps_within(lines, budget_s, max_steps)
        total = self._run_total(*lines, k)
        if k < max_steps and total < budget_s:
            k += 1
            total = self._run_total(*lines, k)
        return k, total

    def _steps_within(self, lines: tuple[float, float, float, float, float], budget_s: float,
                      max_steps: int | None) -> int:
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
        split, (lo_a, lo_b), (hi_a, hi_b) = _split_lines(a, b, c, d)
        total = self._run_total
        if split >= cap or total(fixed, a, b, c, d, split) > budget_s:
            k = _steps_in_budget(fixed + lo_a, lo_b, budget_s)
        else:    # the first piece fits whole: solve the rest on the second line
            rest = budget_s - total(fixed, a, b, c, d, split)
            k = split + _steps_in_budget(fixed + hi_a + hi_b * split, hi_b, rest)
        k = min(cap, max(0, k))
        while k < cap and total(fixed, a, b, c, d, k + 1) <= budget_s:   # float rounding
            k += 1
        while k > 0 and total(fixed, a, b, c, d, k) > budget_s:
            k -= 1
        return k

    # --- slow paths: per-op view and the fitting design row -------------------------------

    def _terms(self, shape: BatchShape) -> list[_Term]:
        _check_shape(shape)
        s, g = self.shapes, self.gpu
        bw = g.hbm_bandwidth_gbps * 1e9
        terms: list[_Term] = []
        npt, nds = shape.num_prefill_tokens, shape.num_decode_seqs
        n_tok, n_seq = npt + nds, shape.num_prefill_seqs + nds
        if n_tok:
            for gm in s.gemms:
                rows = n_seq if gm.name == "lm_head" else n_tok
                peak = g.peak_flops("bf16" if gm.name == "lm_head" else self.weight_dtype)
                flops = 2.0 * gm.weight_elems * rows * gm.repeat
                nbytes = (gm.weight_bytes + rows * gm.act_elems_per_token * ACT_BYTES) * gm.repeat
                terms.append(_Term(gm.name, "gemm", flops, nbytes, flops / peak, nbytes / bw))
            nbytes = n_tok * s.elementwise_bytes_per_token
            terms.append(_Term("elementwise", "elementwise", 0.0, nbytes, 0.0, nbytes / bw))
            if self.tp > 1:
                nbytes = n_tok * s.allreduce_bytes_per_token + n_seq * s.gather_bytes_per_seq
                terms.append(_Term("collective", "collective", 0.0, nbytes, 0.0,
                                   nbytes / (g.interconnect_gbps * 1e9),
                                   latency_count=s.num_collectives))
        kv_layer = s.kv_bytes_per_token / s.num_layers
        q_bytes = 2 * s.q_dim * ACT_BYTES
        if npt:
            pairs = shape.prefill_q_context_sum + 0.5 * (shape.prefill_q_sq_sum + npt)
            flops = pairs * s.attn_flops_per_pair
            nbytes = s.num_layers * (shape.prefill_context_sum * kv_layer
                                     + npt * (2 * kv_layer + q_bytes))
            terms.append(_Term("attn_prefill", "attn_prefill", flops, nbytes,
                               flops / g.peak_flops("bf16"), nbytes / bw))
        if nds:
            ctx = shape.decode_context_sum
            flops = ctx * s.attn_flops_per_pair
            nbytes = s.num_layers * (ctx * kv_layer + nds * (kv_layer + q_bytes))
            terms.append(_Term("attn_decode", "attn_decode", flops, nbytes,
                               flops / g.peak_flops("bf16"), nbytes / bw,
                               per_seq_s=nds * s.num_layers * kv_layer / bw))
        if shape.num_swap_blocks:
            nbytes = shape.num_swap_blocks * self.block_bytes
            terms.append(_Term("swap", "swap", 0.0, nbytes, 0.0, nbytes / (g.pcie_gbps * 1e9)))
        if shape.num_copy_blocks:
            nbytes = 2 * shape.num_copy_blocks * self.block_bytes
            terms.append(_Term("block_copy", "elementwise", 0.0, nbytes, 0.0, nbytes / bw))
        return terms

    def _priced(self, term: _Term) -> tuple[float, float, float]:
        """(compute seconds, memory seconds, fixed seconds) of a term at our efficiencies."""
        e = self.efficiencies
        c_field, m_field, _ = _CLASS_EFF[term.op_class]
        compute = term.compute_s / getattr(e, c_field) if c_field else 0.0
        per_seq = term.per_seq_s * e.attn_decode_context_half
        memory = (term.memory_s + per_seq) / getattr(e, m_field)
        return compute, memory, term.latency_count * e.collective_latency_s

    def breakdown(self, shape: BatchShape) -> dict[str, OpCost]:
        """Every op of the step (plus "step_overhead"); the times sum to `step_time`."""
        out = {"step_overhead": OpCost(0.0, 0.0, self.step_overhead_s, "fixed", "overhead")}
        for term in self._terms(shape):
            compute, memory, fixed = self._priced(term)
            bound = "compute" if compute > memory else "memory"
            out[term.name] = OpCost(term.flops, term.bytes, max(compute, memory) + fixed,
                                    bound, term.op_class)
        return out

    def features(self, shape: BatchShape) -> dict[str, float]:
        """The design row of a step: step_time == Σ coefficients()[k] · features[k].

        Each op contributes its efficiency-1 compute seconds to "<class>.compute" or its
        memory seconds to "<class>.memory" ("collective.link", "swap.link"), whichever side
        bounds it at the current efficiencies; decode attention adds its per-sequence
        term to "attn_decode.memory_per_seq"; "collective.latency" counts launches and
        "overhead" is 1. Refitting coefficients with the bounds held fixed is then linear.
        """
        row = dict.fromkeys(coefficients(self.efficiencies, 0.0), 0.0)
        row["overhead"] = 1.0
        for term in self._terms(shape):
            compute, memory, _ = self._priced(term)
            _, _, mem_feature = _CLASS_EFF[term.op_class]
            if compute > memory:
                row[f"{term.op_class}.compute"] += term.compute_s
            else:
                row[mem_feature] += term.memory_s
                if term.op_class == "attn_decode":
                    row["attn_decode.memory_per_seq"] += term.per_seq_s
            row["collective.latency"] += term.latency_count
        return row

    def coefficients(self) -> dict[str, float]:
        return coefficients(self.efficiencies, self.step_overhead_s)


class _PiecewiseGemms:
    """Σ_i max(n·c_i, w_i + n·a_i) over GEMMs as a convex piecewise-linear function of n.

    GEMM i turns compute-bound above n = w_i / (c_i − a_i) tokens. With those breakpoints
    sorted, the sum over all GEMMs is `n · slope + intercept` of the piece that n falls in:
    one bisection instead of a max per GEMM on the hot path.
    """

    def __init__(self, gemms: list[tuple[float, float, float]]) -> None:
        points = sorted(((w / (c - a) if c > a else math.inf), c, w, a) for c, w, a in gemms)
        self.breaks = tuple(p[0] for p in points)
        # Piece k: GEMMs 0..k-1 (in break order) are compute-bound, the rest memory-bound.
        self.pieces = tuple(
            (sum(p[1] for p in points[:k]) + sum(p[3] for p in points[k:]),
             sum(p[2] for p in points[k:]))
            for k in range(len(points) + 1))


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
