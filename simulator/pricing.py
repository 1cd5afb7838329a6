"""Pricing single kernels and whole steps for `servelab cost` (and anyone else asking).

`price(kind, options)` takes the options `servelab cost KIND` parses — a dict with the
flag names as keys — and returns a JSON-ready dict whose "predicted_ms" is the answer,
with the roofline terms behind it. `price_points` does the same for every row of a CSV.
Bad shapes are a ValueError with a one-line message.
"""
from __future__ import annotations

import csv
from pathlib import Path

from servelab._validate import check_bounded
from servelab.models import load_model_spec
from servelab.simulator import kernels as K
from servelab.simulator.calibration import carried_over, packaged_choice, resolve, version_key
from servelab.simulator.footprint import ACT_BYTES
from servelab.simulator.gpus import DTYPE_BYTES, get_gpu
from servelab.simulator.kernels.movement import ONE_STAGE, RING, SYMM_MEM, TWO_STAGE

_INT_FIELDS = {"m": 1, "n": 1, "k": 1, "batch": 1, "tokens": 1, "context": 0, "heads": 1,
               "kv_heads": 1, "head_dim": 1, "gpus": 1, "elements": 1, "tp": 1, "hidden": 1,
               "inter": 1, "experts": 1, "topk": 1, "ep": 1, "dp": 1, "pp": 1}
"""Integer options and their smallest allowed value."""
_CHOICES = {"kv_dtype": ("bf16", "fp16", "fp8"), "weight_dtype": ("bf16", "fp16", "fp8"),
            "phase": ("prefill", "decode"), "routing": ("renormalize", "softmax")}
_DTYPES = {"gemm": ("bf16", "fp16", "fp8"), "allreduce": ("bf16", "fp16", "fp32"),
           "moe": ("bf16", "fp8")}
"""The --dtype values each kind takes (the same as its flag's choices)."""
_KV_DTYPES = {"mla": ("bf16", "fp8")}
"""The --kv-dtype values a kind takes where they differ from `_CHOICES`."""
_REQUIRED = {"gemm": ("m", "n", "k"), "attention": ("phase", "batch", "heads", "kv_heads"),
             "allreduce": ("gpus", "elements"), "step": ("model",),
             "moe": ("tokens", "hidden", "inter", "experts", "topk"),
             "mla": ("phase", "batch", "heads")}


def ep_disagrees_with_dp(ep: int, dp: int, tp: int) -> str:
    """The one line for --ep given beside a --dp it does not match (`simulate`, `cost`)."""
    return (f"--ep {ep} disagrees with --dp {dp} x --tp {tp}: vLLM's expert-parallel group "
            f"is the TP x DP GPUs of a deployment (leave --ep out: --dp {dp} sets it to {dp * tp})")


def _setup(opts: dict):
    gpu = get_gpu(opts["gpu"])
    profile, label = _profile(gpu, opts)
    if profile.gpu_overrides:
        gpu = gpu.with_overrides(**profile.gpu_overrides)
    return gpu, profile, label


def _profile(gpu, opts: dict):
    """(profile, its name): the profile `--calibration` / `--engine-version` choose; with
    neither, the one `servelab simulate` prices the GPU with by default (its default
    engine's version: the same kernels the same flags mean)."""
    engine_version = opts.get("engine_version")
    if engine_version is None and opts.get("calibration") is None:
        from servelab.engines import DEFAULT_ENGINE, get_preset
        engine_version = get_preset(DEFAULT_ENGINE).engine_version
    profile = resolve(gpu, opts.get("calibration"), engine_version,
                      engine_flag="--engine-version {version}")
    name = opts.get("calibration") or (packaged_choice(gpu, engine_version)[0] if engine_version
                                       else gpu.calibration or "none")
    return profile, name


def carried_over_note(opts: dict) -> str | None:
    """A line for kernels priced inside another engine version than --engine-version asks
    for (the GPU has no profile measured inside it), as `simulate` says; None otherwise."""
    version = opts.get("engine_version")
    if version is None or opts.get("gpu") is None:
        return None
    gpu = get_gpu(opts["gpu"])
    if opts.get("calibration") is None:
        return packaged_choice(gpu, version)[1] if carried_over(gpu, version) else None
    if str(opts["calibration"]) == "none":
        return None
    profile = resolve(gpu, opts["calibration"], version, engine_flag="--engine-version {version}")
    if profile.engine_version and version_key(profile.engine_version) != version_key(version):
        return (f"{opts['calibration']} was fitted to kernels measured inside vLLM "
                f"{profile.engine_version}: carried over to vLLM {version}")
    return None


def _check(kind: str, opts: dict) -> None:
    missing = [f"--{name.replace('_', '-')}" for name in _REQUIRED[kind] if opts.get(name) is None]
    if missing:
        raise ValueError(f"cost {kind} needs {', '.join(missing)}")
    for name, low in _INT_FIELDS.items():
        if opts.get(name) is not None:
            check_bounded(f"--{name.replace('_', '-')}", opts[name], low, integer=True, noun="an integer")
    choices = {**_CHOICES, "dtype": _DTYPES.get(kind, ()),
               "kv_dtype": _KV_DTYPES.get(kind, _CHOICES["kv_dtype"])}
    for name, allowed in choices.items():
        if opts.get(name) is not None and opts[name] not in allowed:
            raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                             f"got {opts[name]!r}")


def price(kind: str, opts: dict) -> dict:
    """What the cost model charges; see the module docstring."""
    if kind not in _REQUIRED:
        raise ValueError(f"unknown cost kind {kind!r}; known: {', '.join(_REQUIRED)}")
    _check(kind, opts)
    return {"gemm": _gemm, "attention": _attention, "allreduce": _allreduce,
            "step": _step, "moe": _moe, "mla": _mla}[kind](opts)


def _ms(seconds) -> float:
    return round(float(seconds) * 1e3, 6)


def _gemm(opts: dict) -> dict:
    gpu, profile, label = _setup(opts)
    m, n, k, dtype = opts["m"], opts["n"], opts["k"], opts.get("dtype") or "bf16"
    if dtype == "fp8" and gpu.fp8_tflops is None:
        raise ValueError(f"{gpu.name} has no FP8 tensor cores: price its FP8 weights with "
                         f"`cost step --weight-dtype fp8` (weight-only, BF16 compute)")
    p = profile.kernels.gemm_for(dtype)
    in_bytes = 1.0 if dtype == "fp8" else DTYPE_BYTES[dtype]
    out_bytes = 2.0 if dtype == "fp8" else DTYPE_BYTES[dtype]
    flops = 2.0 * m * n * k
    traffic = k * n * in_bytes + m * (k * in_bytes + n * out_bytes)
    compute = flops / (gpu.peak_flops(dtype) * p.compute_eff)
    memory = traffic / (gpu.hbm_bandwidth_gbps * 1e9 * p.memory_eff)
    total = float(K.gemm_time(m, n, k, gpu, p, dtype, in_bytes, in_bytes, out_bytes))
    return {"kind": "gemm", "gpu": gpu.name, "calibration": label,
            "engine_version": profile.engine_version, "m": m, "n": n, "k": k,
            "dtype": dtype, "predicted_ms": _ms(total), "compute_ms": _ms(compute),
            "memory_ms": _ms(memory), "floor_ms": _ms(p.floor_s),
            "shape_ms": _ms(max(0.0, total - p.floor_s - max(compute, memory))),
            "bound": "compute" if compute > memory else "memory", "flops": flops,
            "bytes": traffic, "achieved_tflops": round(flops / total / 1e12, 3),
            "achieved_gbps": round(traffic / total / 1e9, 1)}


def _attention(opts: dict) -> dict:
    gpu, profile, label = _setup(opts)
    phase, b, heads, kv_heads = opts["phase"], opts["batch"], opts["heads"], opts["kv_heads"]
    d, c = opts.get("head_dim") or 128, opts.get("context") or 0
    kvb = DTYPE_BYTES[opts.get("kv_dtype") or "bf16"]
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    out = {"kind": "attention", "gpu": gpu.name, "calibration": label,
            "engine_version": profile.engine_version, "phase": phase,
           "batch": b, "context": c, "heads": heads, "kv_heads": kv_heads, "head_dim": d,
           "kv_dtype": opts.get("kv_dtype") or "bf16"}
    if phase == "prefill":
        t = opts.get("tokens")
        if t is None:
            raise ValueError("cost attention --phase prefill needs --tokens (new tokens per sequence)")
        total = K.prefill_attention_time(b, b * t, b * t * c, b * t * t, b * c, heads, kv_heads,
                                         d, gpu, profile.kernels.attn_prefill, kvb,
                                         max_keys=t + c)
        flops = 4.0 * d * heads * b * (t * c + 0.5 * (t * t + t))
        kv_bytes = float(b * (t + c) * 2 * kv_heads * d * kvb)
        out.update(tokens=t, flops=flops)
    else:
        if c < 1:
            raise ValueError("cost attention --phase decode needs --context >= 1 (cached tokens "
                             "each sequence attends to)")
        total = K.decode_attention_time(b, b * c, heads, kv_heads, d, gpu,
                                        profile.kernels.attn_decode, kvb, seq_context=c)
        flops = 4.0 * d * heads * b * c
        kv_bytes = float(b * c * 2 * kv_heads * d * kvb)
    compute = flops / gpu.peak_flops("bf16")   # attention maths runs in bf16 whatever the cache holds
    memory = kv_bytes / (gpu.hbm_bandwidth_gbps * 1e9)
    out.update(flops=flops, kv_bytes=kv_bytes, compute_ms=_ms(compute), memory_ms=_ms(memory),
               bound="compute" if compute > memory else "memory", predicted_ms=_ms(total),
               achieved_tflops=round(flops / total / 1e12, 3),
               achieved_gbps=round(kv_bytes / total / 1e9, 1))
    return out


_ALLREDUCE_PATHS = {ONE_STAGE: "custom one-stage", TWO_STAGE: "custom two-stage",
                    SYMM_MEM: "symmetric memory", RING: "ring"}
"""`servelab cost allreduce`'s name for each path `kernels.allreduce_route` picks."""


def _allreduce(opts: dict) -> dict:
    gpu, profile, label = _setup(opts)
    dtype = opts.get("dtype") or "bf16"
    nbytes = opts["elements"] * DTYPE_BYTES[dtype]
    total = K.allreduce_time(nbytes, opts["gpus"], gpu, profile.kernels.collective)
    algorithm = "none (one GPU)" if opts["gpus"] == 1 else _ALLREDUCE_PATHS[int(
        K.allreduce_route(nbytes, opts["gpus"], gpu, profile.kernels.collective))]
    # A ring all-reduce moves 2(n-1)/n of the message through each GPU's link (NCCL's "bus
    # bandwidth" convention, NCCL tests' PERFORMANCE.md).
    n = opts["gpus"]
    moved = 2.0 * (n - 1) / n * nbytes
    link = moved / (gpu.interconnect_gbps * 1e9) if n > 1 else 0.0
    return {"kind": "allreduce", "gpu": gpu.name, "calibration": label,
            "engine_version": profile.engine_version, "gpus": n,
            "elements": opts["elements"], "dtype": dtype, "bytes": nbytes,
            "algorithm": algorithm, "predicted_ms": _ms(total), "link_ms": _ms(link),
            "bus_gbps": round(moved / total / 1e9, 1) if n > 1 and total > 0 else None}


def _moe(opts: dict) -> dict:
    """One MoE layer on the most loaded GPU: router GEMM + fused experts (+ the EP
    all-to-all's dispatch and combine, priced separately)."""
    gpu, profile, label = _setup(opts)
    t, h, inter, e, k = (opts[n] for n in ("tokens", "hidden", "inter", "experts", "topk"))
    ep, tp = opts.get("ep") or 1, opts.get("tp") or 1
    dtype, load = opts.get("dtype") or "bf16", opts.get("expert_load") or "balanced"
    K.moe.check_moe_shape(e, k, ep)
    if inter % tp:
        raise ValueError(f"--inter ({inter}) must be divisible by --tp ({tp})")
    K.parse_expert_load(load)
    routing = opts.get("routing") or "renormalize"
    p = profile.kernels.moe_for(dtype, gpu, routing == "renormalize", ep)
    router = float(K.gemm_time(t, e, h, gpu, profile.kernels.gemm))
    experts = float(K.moe_experts_time(t, h, inter, e, k, gpu, p, ep, tp, dtype, load))
    active, pairs = (float(x) for x in K.expert_load(t, e, k, ep, load)[:2])
    kernel = K.moe.kernel_dtype(dtype, gpu)
    w8a8 = kernel == "fp8"
    per_expert = 3.0 * h * inter / tp
    weight_bytes = active * per_expert * (1.0 if dtype == "fp8" else 2.0)
    flops = 2.0 * pairs * per_expert
    compute = flops / gpu.peak_flops("fp8" if w8a8 else "bf16")
    memory = weight_bytes / (gpu.hbm_bandwidth_gbps * 1e9)
    # the EP exchange as the step prices it (`CostModel._group_expert_ops`): vLLM's default
    # all-gather of every token's hidden state before the experts, reduce-scatter after
    exchange = 2.0 * float(K.alltoall_time(t * h * ACT_BYTES, ep, gpu, profile.kernels.alltoall))
    tuned = bool(p.tuned_compute_eff and K.moe.vllm_tuned(gpu.name, kernel, e, ep, inter / tp))
    misaligned = bool(K.moe.misaligned_width(h, inter / tp))
    return {"kind": "moe", "gpu": gpu.name, "calibration": label,
            "engine_version": profile.engine_version, "tokens": t, "hidden": h, "inter": inter,
            "experts": e, "topk": k, "ep": ep, "tp": tp, "dtype": dtype,
            "kernel": ("W8A8 FP8" + (" (the engine's kernel under EP)"
                                     if p is profile.kernels.moe_fp8_ep else "") if w8a8 else "weight-only FP8 (Marlin), BF16 maths"
                       if dtype == "fp8" else "BF16" if p is profile.kernels.moe
                       else "BF16 (FlashInfer CUTLASS: this routing's kernel)"),
            "routing": routing,
            "expert_load": load, "predicted_ms": _ms(router + experts), "router_ms": _ms(router),
            "experts_ms": _ms(experts), "ep_exchange_ms": _ms(exchange),
            "active_experts": round(active, 2), "pairs": round(pairs, 2),
            "weight_bytes": weight_bytes, "flops": flops, "compute_ms": _ms(compute),
            "memory_ms": _ms(memory), "bound": "compute" if compute > memory else "memory",
            "vllm_tuned_config": tuned,
            "misaligned_width": misaligned,
            "misaligned_slowdown": round(p.misaligned_slowdown, 4) if misaligned else 1.0,
            "compute_eff": round(float(K.moe.layer_compute_eff(p, gpu, dtype, e, ep, inter / tp)), 4)}


def _misaligned_note(r: dict) -> str:
    """A line for a layer whose expert width per GPU is not a multiple of 16, else ''."""
    if not r["misaligned_width"]:
        return ""
    return "\n  " + K.moe.misaligned_note(r["inter"] // r["tp"], r["misaligned_slowdown"])


def _mla(opts: dict) -> dict:
    """One layer's MLA attention (DeepSeek dimensions) on one GPU of `--tp`."""
    gpu, profile, label = _setup(opts)
    phase, b, heads, tp = opts["phase"], opts["batch"], opts["heads"], opts.get("tp") or 1
    c, kv_dtype = opts.get("context") or 0, opts.get("kv_dtype") or "bf16"
    if heads % tp:
        raise ValueError(f"--heads ({heads}) must be divisible by --tp ({tp})")
    h = heads // tp
    kvb = DTYPE_BYTES[kv_dtype]
    if kv_dtype == "fp8" and K.mla.runs_triton_mla(gpu):   # the engine cannot serve it
        raise ValueError(K.mla.triton_fp8_kv_refusal(gpu.name))
    latent = K.mla.KV_LORA_RANK + K.mla.QK_ROPE_HEAD_DIM
    out = {"kind": "mla", "gpu": gpu.name, "calibration": label,
           "engine_version": profile.engine_version, "phase": phase, "batch": b, "context": c,
           "heads": heads, "tp": tp, "heads_per_gpu": h, "kv_dtype": kv_dtype}
    if phase == "prefill":
        t = opts.get("tokens")
        if t is None:
            raise ValueError("cost mla --phase prefill needs --tokens (new tokens per sequence)")
        total = K.mla_prefill_time(b, t, h, gpu, profile.kernels.mla_prefill, context=c,
                                   kv_bytes=kvb)
        qk_v = K.mla.QK_NOPE_HEAD_DIM + K.mla.QK_ROPE_HEAD_DIM + K.mla.V_HEAD_DIM
        flops = 2.0 * qk_v * h * b * (t * c + 0.5 * t * (t + 1))
        kv_bytes = float(b * (t + c) * latent * kvb)
        out.update(tokens=t)
    else:
        if c < 1:
            raise ValueError("cost mla --phase decode needs --context >= 1 (cached tokens each "
                             "sequence attends to)")
        p = profile.kernels.mla_decode
        total = K.mla_decode_time(b, b * c, h, gpu, p, kv_bytes=kvb)
        flops = 2.0 * h * b * c * (latent + K.mla.KV_LORA_RANK)
        kv_bytes = float(b * c * latent * kvb)
        reads = float(K.mla.mla_latent_reads(b, b * c, h, gpu, p, kv_bytes=kvb))
        out.update(latent_reads=round(reads, 2), head_block=int(p.head_block))
    compute = flops / gpu.peak_flops("bf16")
    memory = kv_bytes / (gpu.hbm_bandwidth_gbps * 1e9)
    out.update(flops=flops, kv_bytes=kv_bytes, compute_ms=_ms(compute), memory_ms=_ms(memory),
               bound="compute" if compute > memory else "memory", predicted_ms=_ms(total),
               achieved_tflops=round(flops / float(total) / 1e12, 3),
               achieved_gbps=round(kv_bytes / float(total) / 1e9, 1))
    return out


def parse_chunks(text: str, flag: str, default_context: int | None) -> list[tuple[int, int]]:
    """"T[:C],..." -> [(T, C), ...]; C is required when default_context is None."""
    out = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        first, _, second = part.partition(":")
        try:
            a = int(first)
            b = int(second) if second else default_context
        except ValueError:
            raise ValueError(f"{flag}: expected integers like 512:1024, got {part!r}") from None
        if b is None:
            raise ValueError(f"{flag}: {part!r} needs a context (B:C)")
        if a < 1 or b < 0:
            raise ValueError(f"{flag}: sizes must be >= 1 and contexts >= 0, got {part!r}")
        out.append((a, b))
    return out


def _step(opts: dict) -> dict:
    from servelab.simulator.cost_model import CostModel
    from servelab.simulator.footprint import kv_capacity_blocks

    prefill = parse_chunks(opts.get("prefill"), "--prefill", 0)
    decode = parse_chunks(opts.get("decode"), "--decode", None)
    if any(c < 1 for _, c in decode):
        raise ValueError("--decode: a decoding sequence has a context of at least 1 token")
    if not prefill and not decode:
        raise ValueError("cost step needs --prefill and/or --decode")
    profile, label = _profile(get_gpu(opts["gpu"]), opts)
    tp, ep, dp = opts.get("tp") or 1, opts.get("ep"), opts.get("dp")
    model = load_model_spec(opts["model"])
    if dp is not None and model.moe is None:
        dp = None   # a dense model's data-parallel ranks are independent replicas: one's step
    if dp is not None:   # vLLM's expert-parallel group is the TP x DP GPUs (`simulator/cli.expert_layout`)
        if ep is not None and ep != dp * tp:
            raise ValueError(ep_disagrees_with_dp(ep, dp, tp))
        ep = dp * tp
    load = opts.get("expert_load") or "balanced"
    K.parse_expert_load(load)
    pp = opts.get("pp") or 1
    if pp > 1 and (ep or 1) > tp:   # as `simulate` refuses it (`run._check_pipeline`)
        raise ValueError(f"--pp {pp} with data-parallel expert parallelism (ep={ep} above tp={tp}) "
                         "is not modelled: pipeline stages run without data-parallel ranks")
    cm = CostModel(model, opts["gpu"], tp=tp,   # weights: the checkpoint's, as `simulate` takes them
                   weight_dtype=opts.get("weight_dtype") or model.checkpoint_weight_dtype,
                   kv_dtype=opts.get("kv_dtype") or "bf16", calibration=profile,
                   ep=ep or 1, expert_load=load)
    longest = model.max_position_embeddings
    for flag, chunks, new in (("--prefill", prefill, lambda t: t), ("--decode", decode, lambda b: 1)):
        for a, c in chunks:
            if longest and c + new(a) > longest:
                raise ValueError(f"{flag} {a}:{c}: a sequence of {c + new(a):,} tokens is longer "
                                 f"than {model.name} takes ({longest:,}, its "
                                 "max_position_embeddings)")
    if pp > 1:
        return _pipelined_step(cm, pp, label, profile, prefill, decode, _shape(prefill, decode))
    kv_capacity_blocks(cm.model, cm.gpu, tp=cm.tp, weight_dtype=cm.weight_dtype,
                       kv_dtype=cm.kv_dtype, ep=cm.ep)   # raises when the model does not fit
    shape = _shape(prefill, decode)
    total = cm.step_time(shape)
    layers = cm.shapes.num_layers
    breakdown = cm.breakdown(shape)
    return {"kind": "step", "gpu": cm.gpu.name, "calibration": label,
            "engine_version": profile.engine_version, "model": cm.model.name,
            "tp": cm.tp, **({"ep": cm.ep, "expert_load": cm.expert_load} if cm.model.moe else {}),
            "weight_dtype": cm.weight_dtype, "kv_dtype": cm.kv_dtype,
            "layers": layers, "prefill": prefill, "decode": decode,
            "tokens": shape.num_tokens, "predicted_ms": _ms(total),
            "per_layer_ms": _ms(_layer_time(breakdown.items()) / layers),
            "ops": _op_rows(list(breakdown.items()), layers, total),
            **_step_notes(cm)}


def _step_notes(cm) -> dict:
    """{"notes": [...]} for what the reader of a step's price should know, or {}."""
    notes = [n for n in (cm.expert_width_note(),) if n]
    return {"notes": notes} if notes else {}


def _layer_time(ops) -> float:
    """Seconds of a step's layers, from its (name, OpCost) pairs: every op but the step
    overhead and the kernels a step runs once (`footprint.STEP_KERNELS`: embedding, final
    norm, LM head, sampler, logits gather). Over the layer count it is the mean layer, MoE
    layers and a model's dense leading layers alike (DeepSeek-V3's experts run in 58 of
    its 61 layers, its dense MLP in 3)."""
    from servelab.simulator.footprint import STEP_KERNELS

    return sum(op.time_s for name, op in ops if name != "step_overhead" and name not in STEP_KERNELS)


def _shape(prefill: list[tuple[int, int]], decode: list[tuple[int, int]]):
    """The `BatchShape` of prefill chunks (T, C) and decode groups (B, C)."""
    from servelab.outputs import BatchShape

    return BatchShape(
        num_prefill_seqs=len(prefill), num_prefill_tokens=sum(t for t, _ in prefill),
        prefill_context_sum=sum(c for _, c in prefill),
        prefill_q_context_sum=sum(t * c for t, c in prefill),
        prefill_q_sq_sum=sum(t * t for t, _ in prefill),
        num_decode_seqs=sum(b for b, _ in decode),
        decode_context_sum=sum(b * c for b, c in decode),
        prefill_max_keys=max((t + c for t, c in prefill), default=0))


def _op_rows(ops: list, layers: int, total: float) -> list[dict]:
    """`cost step`'s op table from (name, OpCost) pairs; a name seen twice (one per
    pipeline stage) is one row, its calls and time summed."""
    rows: dict[str, dict] = {}
    for name, op in ops:
        row = rows.setdefault(name, {"op": name, "class": op.op_class, "calls": 0,
                                     "time_s": 0.0, "per_layer": op.per_layer, "bound": op.bound})
        row["calls"] += op.calls
        row["time_s"] += op.time_s
    return [{"op": r["op"], "class": r["class"], "calls": r["calls"],
             "per_layer_ms": _ms(r["time_s"] / layers) if r["per_layer"] else None,
             "total_ms": _ms(r["time_s"]), "share_pct": round(100 * r["time_s"] / total, 2),
             "bound": r["bound"]} for r in rows.values()]


def _pipelined_step(cm, pp: int, label: str, profile, prefill, decode, shape) -> dict:
    """One step of a pipelined replica, priced as the simulator prices it
    (`simulator/pipeline.py`): each stage's layers (vLLM's `get_pp_indices` split) on its
    own `CostModel`, the activations' send between stages, and the step's end as a lone
    batch passes every stage (`StageTimeline.run_step` on idle stages). With pp batches
    in flight the slowest stage paces the replica (one step per its time)."""
    from servelab.simulator.pipeline import PipelineLayout, StageTimeline

    layout = PipelineLayout(cm.model, cm, pp)   # refuses pp above the layers
    # refuses a stage whose weights do not fit, at the engine settings the unpipelined step's
    # check (`footprint.kv_capacity_blocks`) assumes by default
    layout.stage_kv_blocks(gpu_memory_utilization=0.9, max_num_batched_tokens=2048, max_num_seqs=128)
    stage_s = layout.stage_times(shape)
    transfer_s = [layout.transfer_time(s, shape.num_tokens) for s in range(pp - 1)]
    total = StageTimeline(layout).run_step(0.0, shape)
    slowest = max(range(pp), key=stage_s.__getitem__)
    layers = cm.model.num_layers
    # a once-per-step op (embedding, LM head, step overhead...) counts on the stages that run it
    ops = [(name, op) for stage in layout.stages for name, op in stage.breakdown(shape).items()
           if op.per_layer or op.time_s > 0]
    per_layer = _layer_time(ops)
    return {"kind": "step", "gpu": cm.gpu.name, "calibration": label,
            "engine_version": profile.engine_version, "model": cm.model.name, "tp": cm.tp,
            "pp": pp, **({"ep": cm.ep, "expert_load": cm.expert_load} if cm.model.moe else {}),
            "weight_dtype": cm.weight_dtype, "kv_dtype": cm.kv_dtype,
            "layers": layers, "prefill": prefill, "decode": decode,
            "tokens": shape.num_tokens, "predicted_ms": _ms(total),
            "per_layer_ms": _ms(per_layer / layers),
            "stages": [{"stage": s, "layers": [start, end], "ms": _ms(t)}
                       for s, ((start, end), t) in enumerate(zip(layout.layer_ranges, stage_s))],
            "slowest_stage": slowest, "slowest_stage_ms": _ms(stage_s[slowest]),
            "transfers": [{"between": [s, s + 1], "link": link.link.name, "lanes": link.lanes,
                           "ms": _ms(t)} for s, (link, t) in enumerate(zip(layout.links, transfer_s))],
            "transfer_ms": _ms(sum(transfer_s)),
            "ops": _op_rows(ops, layers, total), **_step_notes(cm)}


def describe(kind: str, r: dict) -> str:
    """The human-readable answer to `servelab cost KIND`."""
    head = f"{r['predicted_ms']:.4f} ms"
    engine = f", vLLM {r['engine_version']}" if r.get("engine_version") else ""
    where = f"on {r['gpu']} (calibration: {r['calibration']}{engine})"
    if kind == "gemm":
        return (f"{head}  GEMM [{r['m']}x{r['k']}] x [{r['k']}x{r['n']}] {r['dtype']} {where}\n"
                f"  roofline: compute {r['compute_ms']:.4f} ms, memory {r['memory_ms']:.4f} ms "
                f"({r['bound']}-bound); floor {r['floor_ms']:.4f} ms; shape {r['shape_ms']:.4f} ms "
                f"(tiles, waves, k-loop latency, partial overlap)\n"
                f"  achieved {r['achieved_tflops']} TFLOP/s, {r['achieved_gbps']} GB/s")
    if kind == "attention":
        what = (f"prefill of {r['batch']} x {r['tokens']} tokens after {r['context']} cached"
                if r["phase"] == "prefill" else
                f"decode of {r['batch']} sequences at context {r['context']}")
        return (f"{head}  {what}, {r['heads']} heads / {r['kv_heads']} KV heads x "
                f"{r['head_dim']}, KV {r['kv_dtype']}, one layer, {where}\n"
                f"  roofline: compute {r['compute_ms']:.4f} ms, memory {r['memory_ms']:.4f} ms "
                f"({r['bound']}-bound, reading {r['kv_bytes'] / 1e6:.2f} MB of K/V)\n"
                f"  achieved {r['achieved_tflops']} TFLOP/s, {r['achieved_gbps']} GB/s")
    if kind == "moe":
        return (f"{head}  MoE layer: {r['tokens']} tokens, {r['experts']} experts of "
                f"{r['hidden']}x{r['inter']}, top-{r['topk']}, EP {r['ep']}, TP {r['tp']}, "
                f"{r['kernel']}, {r['expert_load']} load, {where}\n"
                f"  router GEMM {r['router_ms']:.4f} ms + fused experts {r['experts_ms']:.4f} ms "
                f"on the most loaded GPU ({r['active_experts']} experts, {r['pairs']} token-expert "
                f"pairs)\n"
                f"  roofline of the experts: compute {r['compute_ms']:.4f} ms, weights "
                f"{r['memory_ms']:.4f} ms ({r['bound']}-bound)"
                + (f"; EP exchange (all-gather before, reduce-scatter after, over {r['ep']} "
                   f"GPUs) {r['ep_exchange_ms']:.4f} ms (not included)" if r["ep"] > 1 else "")
                + "\n"
                f"  full tiles at {r['compute_eff']:.2f} of peak: "
                + (f"vLLM ships a tuned kernel config for {r['experts'] // r['ep']} experts of "
                   f"width {r['inter'] // r['tp']} on this GPU" if r["vllm_tuned_config"] else
                   "no tuned vLLM kernel config priced for this layer on this GPU (files are "
                   "priced for few-expert layers only: docs/moe-mla.md)")
                + _misaligned_note(r))
    if kind == "mla":
        what = (f"prefill of {r['batch']} x {r['tokens']} tokens after {r['context']} cached"
                if r["phase"] == "prefill" else
                f"decode of {r['batch']} sequences at context {r['context']}")
        return (f"{head}  MLA {what}, {r['heads']} heads / TP {r['tp']} = {r['heads_per_gpu']} "
                f"per GPU, KV {r['kv_dtype']}, one layer, {where}\n"
                f"  roofline: compute {r['compute_ms']:.4f} ms, memory {r['memory_ms']:.4f} ms "
                f"({r['bound']}-bound, reading {r['kv_bytes'] / 1e6:.2f} MB of latents once)\n"
                f"  achieved {r['achieved_tflops']} TFLOP/s, {r['achieved_gbps']} GB/s"
                + (f"\n  the latents are read {r['latent_reads']:.2f} times from HBM: blocks of "
                   f"{r['head_block']} heads re-read what L2 does not hold "
                   "(vLLM's Triton MLA kernel; docs/moe-mla.md)"
                   if r.get("latent_reads", 1.0) > 1.0 else ""))
    if kind == "allreduce":
        text = (f"{head}  all-reduce of {r['elements']} {r['dtype']} elements over {r['gpus']} "
                f"GPUs ({r['algorithm']}) {where}")
        if r["bus_gbps"] is None:
            return text
        return (text + f"\n  link: {r['link_ms']:.4f} ms to move 2(n-1)/n of "
                f"{r['bytes'] / 1e6:.2f} MB at the GPU's peak; achieved bus bandwidth "
                f"{r['bus_gbps']} GB/s")
    experts = f", ep={r['ep']}, {r['expert_load']} expert load" if "ep" in r else ""
    pp = f", pp={r['pp']}" if "pp" in r else ""
    dtypes = f", {r['weight_dtype']} weights, {r['kv_dtype']} KV"
    lines = [f"{head}  one step of {r['model']} (tp={r['tp']}{pp}{experts}{dtypes}, "
             f"{r['layers']} layers, {r['tokens']} tokens) {where}; mean layer "
             f"{r['per_layer_ms']:.4f} ms"]
    if pp:
        lines += [f"  stage {st['stage']} (layers {st['layers'][0]}-{st['layers'][1] - 1}): "
                  f"{st['ms']:.4f} ms" + ("  <- slowest" if st["stage"] == r["slowest_stage"] else "")
                  for st in r["stages"]]
        lines += [f"  send {x['between'][0]} -> {x['between'][1]} over {x['link']} x{x['lanes']}: "
                  f"{x['ms']:.4f} ms" for x in r["transfers"]]
        lines.append(f"  a lone batch: stages + sends = {r['predicted_ms']:.4f} ms; with {r['pp']} "
                     f"batches in flight the slowest stage paces the replica, one step per "
                     f"{r['slowest_stage_ms']:.4f} ms; ops below are summed over the stages")
    lines += [f"  {'op':<22}{'class':<14}{'calls':>6}{'per layer':>12}{'total':>12}{'share':>8}  bound"]
    for op in r["ops"]:
        per_layer = f"{op['per_layer_ms']:.4f}" if op["per_layer_ms"] is not None else "-"
        lines.append(f"  {op['op']:<22}{op['class']:<14}{op['calls']:>6}{per_layer:>12}"
                     f"{op['total_ms']:>12.4f}{op['share_pct']:>7.1f}%  {op['bound']}")
    lines += [f"  note: {note}" for note in r.get("notes", ())]
    return "\n".join(lines)


_NOT_COLUMNS = frozenset({"func", "command", "command_parser", "kind", "points", "out", "json"})
"""Entries of the parsed command line that are not a priced flag a column could set."""


POINT_OUTPUT = "predicted_ms"
"""The column `price_points` adds to every row (replacing one the file has)."""


def price_points(kind: str, path: str | Path, defaults: dict, note=None,
                 flag_defaults: dict | None = None) -> list[dict]:
    """Price every row of a CSV; columns named like the flags override `defaults`, except
    in an empty cell (a decode row's `tokens` beside prefill rows), which leaves the flag's
    value as given. Other columns (a measured time to compare with) are carried through
    unread, and `note` (a callable) is told their names, lest a misspelt flag go unseen
    (and that a `POINT_OUTPUT` column is replaced, and that a flag set away from its
    default, `flag_defaults` being the parser's, fills only the empty cells of a column
    that sets it too); a file none of whose columns names a flag is refused."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    flags = sorted(set(defaults) - _NOT_COLUMNS)
    columns = [key for key in rows[0] if key is not None]
    unread = [c for c in columns if c.strip().replace("-", "_") not in flags]
    if len(unread) == len(columns):
        raise ValueError(f"{path}: no column names a flag of `cost {kind}`; its columns may be "
                         f"{', '.join(flags)}")
    if flag_defaults is not None and note:
        for column in columns:
            name = column.strip().replace("-", "_")
            if name in flags and defaults[name] != flag_defaults.get(name):
                note(f"{path}: column {column} sets {name} row by row; --{name.replace('_', '-')} "
                     f"{defaults[name]} fills only its empty cells")
    if POINT_OUTPUT in unread:
        unread.remove(POINT_OUTPUT)
        if note:
            note(f"{path}: column {POINT_OUTPUT} is replaced by this pricing's")
    if unread and note:
        note(f"{path}: column{'s' if len(unread) > 1 else ''} {', '.join(unread)} "
             f"name{'' if len(unread) > 1 else 's'} no flag of `cost {kind}` and "
             f"{'are' if len(unread) > 1 else 'is'} carried through unread (flags: "
             f"{', '.join(flags)})")
    out = []
    for line, row in enumerate(rows, start=2):
        opts = dict(defaults)
        for key, value in row.items():
            if key is None:
                raise ValueError(f"{path}: line {line}: more cells than header columns")
            name = key.strip().replace("-", "_")
            if not (value or "").strip():   # an empty cell: the flag not given on this row
                continue
            opts[name] = _cell(name, value, path, line)
        try:
            result = price(kind, opts)
        except ValueError as exc:
            raise ValueError(f"{path}: line {line}: {exc}") from None
        out.append({**row, POINT_OUTPUT: result["predicted_ms"]})
    return out


def _cell(name: str, value: str | None, path: Path, line: int):
    value = (value or "").strip()
    if name in _INT_FIELDS:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{path}: line {line}: column {name!r} must be an integer, "
                             f"got {value!r}") from None
    return value or None

