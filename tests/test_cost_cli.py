"""`servelab cost`: each kind prints what the cost model charges, --json, --points, and
one-line errors for shapes that cannot exist.

The expected figures come from the cost model itself at the same shapes: a GEMM or an
attention kernel of `cost` must equal that op of a `CostModel` step (per layer), an
all-reduce the step's TP all-reduce per call, and `cost step` the step time.
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from servelab.cli import main
from servelab.outputs import BatchShape
from servelab.simulator import kernels as K
from servelab.simulator.calibration import resolve
from servelab.simulator.cost_model import CostModel
from servelab.simulator.gpus import get_gpu

GPU = "h100-sxm"
DEFAULT = "h100-sxm.vllm-0.24"
"""The profile `cost` prices GPU with by default: `simulate`'s (its default engine's version)."""


def cost(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["cost", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def cost_json(capsys, *argv) -> dict:
    rc, out, err = cost(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def llama8b() -> CostModel:
    return CostModel("llama-3.1-8b", GPU, calibration=DEFAULT)


def per_layer(cm: CostModel, shape: BatchShape, op: str) -> float:
    """Seconds of one call of `op`, unscaled (cost prices the kernel, not a run fit)."""
    o = cm.breakdown(shape)[op]
    return o.time_s / o.calls / cm.scales[o.op_class]


# --- each kind agrees with the cost model ------------------------------------------------------


def test_gemm_is_the_cost_models_gemm_at_that_shape(capsys, llama8b):
    o_proj = {g.name: g for g in llama8b.shapes.gemms}["o_proj"]
    shape = BatchShape(num_prefill_seqs=1, num_prefill_tokens=512, prefill_q_sq_sum=512 ** 2)
    expected_ms = per_layer(llama8b, shape, "o_proj") * 1e3
    r = cost_json(capsys, "gemm", "--gpu", GPU, "--m", 512, "--n", o_proj.n, "--k", o_proj.k)
    assert r["predicted_ms"] == pytest.approx(expected_ms, abs=1e-6)
    assert r["calibration"] == DEFAULT and r["bound"] == "compute"
    p = resolve(GPU, DEFAULT).kernels.gemm
    assert p.floor_s > 0 and r["floor_ms"] == pytest.approx(p.floor_s * 1e3, abs=1e-6)
    rc, out, _ = cost(capsys, "gemm", "--gpu", GPU, "--m", 512, "--n", o_proj.n, "--k", o_proj.k)
    first = out.splitlines()[0]
    assert rc == 0 and first == (f"{r['predicted_ms']:.4f} ms  GEMM [512x{o_proj.k}] x "
                                 f"[{o_proj.k}x{o_proj.n}] bf16 on h100-sxm (calibration: "
                                 f"h100-sxm.vllm-0.24, vLLM 0.24.0)")


def test_fp8_gemm_uses_the_fp8_parameters_and_peak(capsys):
    r = cost_json(capsys, "gemm", "--gpu", GPU, "--m", 4096, "--n", 8192, "--k", 8192, "--dtype", "fp8")
    p = resolve(GPU, DEFAULT).kernels.gemm_fp8
    expected = K.gemm_time(4096, 8192, 8192, get_gpu(GPU), p, "fp8", 1.0, 1.0, 2.0)
    assert r["predicted_ms"] == pytest.approx(float(expected) * 1e3, abs=1e-6)
    assert r["bytes"] == 8192 * 8192 + 4096 * (8192 + 8192 * 2)
    assert r["flops"] / (r["compute_ms"] * 1e-3) == pytest.approx(1979e12 * p.compute_eff, rel=1e-3)


def test_decode_attention_is_the_cost_models_attention_per_layer(capsys, llama8b):
    shape = BatchShape(num_decode_seqs=32, decode_context_sum=32 * 1500)
    r = cost_json(capsys, "attention", "--gpu", GPU, "--phase", "decode", "--batch", 32,
                  "--context", 1500, "--heads", 32, "--kv-heads", 8, "--head-dim", 128)
    assert r["predicted_ms"] == pytest.approx(per_layer(llama8b, shape, "attn_decode") * 1e3, abs=1e-6)
    assert r["kv_bytes"] == 32 * 1500 * 2 * 8 * 128 * 2
    assert r["memory_ms"] == pytest.approx(r["kv_bytes"] / 3350e9 * 1e3, abs=1e-6)
    assert r["bound"] == "memory"
    assert r["achieved_gbps"] == pytest.approx(r["kv_bytes"] / r["predicted_ms"] / 1e6, abs=0.1)
    rc, out, _ = cost(capsys, "attention", "--gpu", GPU, "--phase", "decode", "--batch", 32,
                      "--context", 1500, "--heads", 32, "--kv-heads", 8)
    lines = out.splitlines()
    assert rc == 0 and lines[1].startswith(f"  roofline: compute {r['compute_ms']:.4f} ms, "
                                           f"memory {r['memory_ms']:.4f} ms (memory-bound")
    assert lines[2] == f"  achieved {r['achieved_tflops']} TFLOP/s, {r['achieved_gbps']} GB/s"


def test_prefill_attention_is_the_cost_models_attention_per_layer(capsys, llama8b):
    shape = BatchShape(num_prefill_seqs=2, num_prefill_tokens=1024, prefill_context_sum=2048,
                       prefill_q_context_sum=2 * 512 * 1024, prefill_q_sq_sum=2 * 512 ** 2)
    r = cost_json(capsys, "attention", "--gpu", GPU, "--phase", "prefill", "--batch", 2,
                  "--tokens", 512, "--context", 1024, "--heads", 32, "--kv-heads", 8)
    assert r["predicted_ms"] == pytest.approx(per_layer(llama8b, shape, "attn_prefill") * 1e3, abs=1e-6)
    assert r["flops"] == 4.0 * 128 * 32 * 2 * (512 * 1024 + 0.5 * (512 ** 2 + 512))
    rc, out, _ = cost(capsys, "attention", "--gpu", GPU, "--phase", "prefill", "--batch", 2,
                      "--tokens", 512, "--context", 1024, "--heads", 32, "--kv-heads", 8)
    assert rc == 0 and out.startswith(f"{r['predicted_ms']:.4f} ms  prefill of 2 x 512 tokens "
                                      f"after 1024 cached")


def test_allreduce_is_the_steps_tp_allreduce_per_call(capsys):
    cm = CostModel("llama-3.1-8b", GPU, tp=2, calibration=DEFAULT)
    shape = BatchShape(num_prefill_seqs=1, num_prefill_tokens=512, prefill_q_sq_sum=512 ** 2)
    r = cost_json(capsys, "allreduce", "--gpu", GPU, "--gpus", 2, "--elements", 512 * 4096)
    assert r["predicted_ms"] == pytest.approx(per_layer(cm, shape, "allreduce") * 1e3, abs=1e-6)
    assert (r["bytes"], r["algorithm"]) == (512 * 4096 * 2, "custom one-stage")
    old = ("--engine-version", "0.14.0")                  # no symmetric memory there
    big = cost_json(capsys, "allreduce", "--gpu", GPU, "--gpus", 8, "--elements", 2 ** 24, *old)
    assert big["algorithm"] == "ring" and big["predicted_ms"] > r["predicted_ms"]
    mid = cost_json(capsys, "allreduce", "--gpu", GPU, "--gpus", 8, "--elements", 2 ** 18, *old)
    assert mid["algorithm"] == "custom two-stage"         # 512 KiB: past the one-stage limit
    newer = cost_json(capsys, "allreduce", "--gpu", GPU, "--gpus", 8, "--elements", 2 ** 18)
    assert newer["algorithm"] == "symmetric memory"       # on by default in vLLM 0.24
    one = cost_json(capsys, "allreduce", "--gpu", GPU, "--gpus", 1, "--elements", 4096)
    assert (one["predicted_ms"], one["algorithm"]) == (0.0, "none (one GPU)")
    moved = 2 * 7 / 8 * 2 ** 25                      # bytes through each GPU's link, ring
    assert big["bus_gbps"] == pytest.approx(moved / big["predicted_ms"] / 1e6, abs=0.1)
    rc, out, _ = cost(capsys, "allreduce", "--gpu", GPU, "--gpus", 8, "--elements", 2 ** 24, *old)
    assert rc == 0 and out.splitlines()[1].startswith("  link: ")
    assert f"achieved bus bandwidth {big['bus_gbps']} GB/s" in out


def test_step_is_the_cost_models_step_time(capsys, llama8b):
    shape = BatchShape(num_prefill_seqs=2, num_prefill_tokens=512 + 2048, prefill_context_sum=1024,
                       prefill_q_context_sum=2048 * 1024, prefill_q_sq_sum=512 ** 2 + 2048 ** 2,
                       num_decode_seqs=32, decode_context_sum=32 * 1500,
                       prefill_max_keys=2048 + 1024)
    argv = ("step", "--gpu", GPU, "--model", "llama-3.1-8b", "--prefill", "512,2048:1024",
            "--decode", "32:1500")
    r = cost_json(capsys, *argv)
    assert r["predicted_ms"] == pytest.approx(llama8b.step_time(shape) * 1e3, abs=1e-6)
    assert (r["tokens"], r["layers"], r["tp"]) == (512 + 2048 + 32, 32, 1)
    assert r["prefill"] == [[512, 0], [2048, 1024]] and r["decode"] == [[32, 1500]]
    ops = {op["op"]: op for op in r["ops"]}
    assert set(ops) == set(llama8b.breakdown(shape))
    assert sum(op["total_ms"] for op in r["ops"]) == pytest.approx(r["predicted_ms"], abs=1e-4)
    assert sum(op["share_pct"] for op in r["ops"]) == pytest.approx(100, abs=0.1)
    rc, out, _ = cost(capsys, *argv)
    assert rc == 0 and out.startswith(f"{r['predicted_ms']:.4f} ms  one step of llama-3.1-8b")
    assert re.search(r"^  attn_decode +attn_decode +32 ", out, re.M)


def test_step_prices_a_mixture_of_experts_layout(capsys):
    """--ep / --dp / --expert-load reach the cost model as `simulate` passes them."""
    from servelab.simulator.cost_model import CostModel
    shape = BatchShape(num_decode_seqs=64, decode_context_sum=64 * 1000)
    base = ("step", "--gpu", GPU, "--model", "qwen3-30b-a3b", "--decode", "64:1000")
    for flags, ep, load in (((), 1, "balanced"), (("--dp", 2), 2, "balanced"),
                            (("--ep", 2, "--expert-load", "power-law:1.2"), 2, "power-law:1.2")):
        r = cost_json(capsys, *base, *flags)
        expected = CostModel("qwen3-30b-a3b", GPU, ep=ep, expert_load=load,
                             calibration=DEFAULT).step_time(shape)
        assert r["predicted_ms"] == pytest.approx(expected * 1e3, abs=1e-6)
        assert (r["ep"], r["expert_load"]) == (ep, load)
    assert cost_json(capsys, *base, "--dp", 2)["predicted_ms"] != cost_json(capsys, *base)["predicted_ms"]
    rc, _, err = cost(capsys, *base, "--dp", 2, "--ep", 4)
    assert rc == 2 and "--ep 4 disagrees with --dp 2" in err and "leave --ep out: --dp 2 sets it to 2" in err
    rc, _, err = cost(capsys, *base, "--expert-load", "zipf")
    assert rc == 2 and err.count("\n") == 1


def test_step_names_the_dtypes_it_priced(capsys):
    """FP8 weights and KV price a step differently (and DeepSeek-V3 defaults to FP8
    weights): the header and the JSON say which were priced."""
    base = ("step", "--gpu", GPU, "--model", "qwen3-30b-a3b", "--decode", "64:2000")
    r = cost_json(capsys, *base, "--weight-dtype", "fp8", "--kv-dtype", "fp8")
    assert (r["weight_dtype"], r["kv_dtype"]) == ("fp8", "fp8")
    assert (cost_json(capsys, *base)["weight_dtype"], cost_json(capsys, *base)["kv_dtype"]) == \
        ("bf16", "bf16")
    rc, out, _ = cost(capsys, *base, "--weight-dtype", "fp8", "--kv-dtype", "fp8")
    assert rc == 0 and "balanced expert load, fp8 weights, fp8 KV, 48 layers" in out.splitlines()[0]


def test_json_keys_per_kind(capsys):
    gemm = cost_json(capsys, "gemm", "--gpu", GPU, "--m", 1, "--n", 4096, "--k", 4096)
    assert set(gemm) == {"kind", "gpu", "calibration", "engine_version", "m", "n", "k", "dtype",
                         "predicted_ms",
                         "compute_ms", "memory_ms", "floor_ms", "shape_ms", "bound", "flops",
                         "bytes", "achieved_tflops", "achieved_gbps"}
    assert (gemm["kind"], gemm["bound"], gemm["flops"]) == ("gemm", "memory", 2 * 4096 * 4096)
    decode = cost_json(capsys, "attention", "--gpu", GPU, "--phase", "decode", "--batch", 1,
                       "--context", 10, "--heads", 8, "--kv-heads", 8)
    assert {"kind", "phase", "batch", "context", "heads", "kv_heads", "head_dim", "kv_dtype",
            "kv_bytes", "predicted_ms"} <= set(decode) and decode["head_dim"] == 128
    ar = cost_json(capsys, "allreduce", "--gpu", GPU, "--gpus", 2, "--elements", 8)
    assert {"kind", "gpus", "elements", "dtype", "bytes", "algorithm", "predicted_ms"} <= set(ar)
    step = cost_json(capsys, "step", "--gpu", GPU, "--model", "tiny-llama", "--decode", "1:1")
    assert {"kind", "model", "tp", "layers", "tokens", "predicted_ms", "per_layer_ms",
            "ops"} <= set(step)
    assert set(step["ops"][0]) == {"op", "class", "calls", "per_layer_ms", "total_ms",
                                   "share_pct", "bound"}


ONCE_PER_STEP = {"step_overhead", "embedding", "final_norm", "lm_head", "sampler", "logits_gather"}


@pytest.mark.parametrize("dense_layers", [3, 1])
def test_a_steps_mean_layer_counts_every_layer_op_moe_layers_and_dense_ones_alike(
        capsys, tmp_path, dense_layers):
    """DeepSeek-V3's experts run in 58 of its 61 layers (three dense leading layers; one in
    a config like Kimi-K2's, whose dense MLP then runs once a step): the headline's mean
    layer includes both kinds; with the ops run once per step it makes up the step."""
    config = json.loads((Path(__file__).resolve().parents[1] / "servelab" / "data" / "models" /
                         "deepseek-v3.json").read_text())
    config["first_k_dense_replace"] = dense_layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    step = cost_json(capsys, "step", "--gpu", "h200", "--model", str(tmp_path / "config.json"),
                     "--tp", 8, "--decode", "64:2000")
    calls = {op["op"]: op["calls"] for op in step["ops"]}
    assert (step["layers"], calls["moe_experts"], calls["mlp_gate_up"]) == (61, 61 - dense_layers, dense_layers)
    once = sum(op["total_ms"] for op in step["ops"] if op["op"] in ONCE_PER_STEP)
    # to the rounding of the printed milliseconds (4 decimals): a dense layer's MLP is 0.03 ms
    assert step["per_layer_ms"] * 61 + once == pytest.approx(step["predicted_ms"], abs=61 * 5e-5 + 1e-3)
    experts = next(op for op in step["ops"] if op["op"] == "moe_experts")
    assert step["per_layer_ms"] > experts["total_ms"] / 61


def test_bare_roofline_is_faster_than_the_profile_for_a_small_gemm(capsys):
    """No floor and no k-latency: a small GEMM is its bytes over the full HBM bandwidth."""
    argv = ("gemm", "--gpu", GPU, "--m", 1, "--n", 1024, "--k", 1024)
    bare = cost_json(capsys, *argv, "--calibration", "none")
    fitted = cost_json(capsys, *argv)
    assert bare["calibration"] == "none" and (bare["floor_ms"], bare["shape_ms"]) == (0.0, 0.0)
    nbytes = 1024 * 1024 * 2 + 1 * (1024 * 2 + 1024 * 2)
    assert bare["predicted_ms"] == pytest.approx(nbytes / 3350e9 * 1e3, abs=1e-6)
    assert fitted["floor_ms"] > 0 and fitted["predicted_ms"] > 2 * bare["predicted_ms"]


# --- --points ---------------------------------------------------------------------------------


def write_csv(path, header, rows):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def read_csv(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_points_price_every_row_in_order_like_single_calls(capsys, tmp_path):
    rows = [(1, 4096, 4096, "bf16"), (512, 4096, 4096, "fp8"), (16, 1024, 8192, "bf16"),
            (8192, 14336, 4096, "fp16")]
    src = write_csv(tmp_path / "shapes.csv", ["m", "n", "k", "dtype"], rows)
    out = tmp_path / "priced.csv"
    rc, stdout, err = cost(capsys, "gemm", "--gpu", GPU, "--points", src, "--out", out)
    assert rc == 0 and stdout == "" and err == ""
    priced = read_csv(out)
    assert list(priced[0]) == ["m", "n", "k", "dtype", "predicted_ms"]
    assert [(int(r["m"]), int(r["n"]), int(r["k"]), r["dtype"]) for r in priced] == rows
    for (m, n, k, dtype), row in zip(rows, priced):
        single = cost_json(capsys, "gemm", "--gpu", GPU, "--m", m, "--n", n, "--k", k, "--dtype", dtype)
        assert float(row["predicted_ms"]) == single["predicted_ms"]


def test_points_take_missing_columns_from_the_flags_and_columns_win(capsys, tmp_path):
    src = write_csv(tmp_path / "m.csv", ["m", "n"], [(1, 4096), (64, 4096), (4096, 1024)])
    rc, stdout, err = cost(capsys, "gemm", "--gpu", GPU, "--points", src, "--n", 99, "--k", 4096)
    assert rc == 0, err
    priced = list(csv.DictReader(stdout.splitlines()))
    assert [r["m"] for r in priced] == ["1", "64", "4096"]
    for r in priced:
        single = cost_json(capsys, "gemm", "--gpu", GPU, "--m", r["m"], "--n", r["n"], "--k", 4096)
        assert float(r["predicted_ms"]) == single["predicted_ms"]


def test_points_as_json_keep_numbers_numbers_and_csv_lines_end_in_newlines(capsys, tmp_path):
    src = write_csv(tmp_path / "g.csv", ["m", "n", "k", "dtype", "note"],
                    [(1, 4096, 4096, "bf16", "inf")])
    rows = cost_json(capsys, "gemm", "--gpu", GPU, "--points", src)
    assert rows[0]["m"] == 1 and rows[0]["k"] == 4096 and rows[0]["dtype"] == "bf16"
    assert rows[0]["note"] == "inf"                              # not a JSON infinity
    rc, stdout, _ = cost(capsys, "gemm", "--gpu", GPU, "--points", src)
    assert rc == 0 and "\r" not in stdout and stdout.startswith("m,n,k,dtype,note,predicted_ms\n")


def test_points_name_columns_they_do_not_read_and_refuse_a_file_of_none(capsys, tmp_path):
    """A misspelt column (`mm` for `m`) used to be ignored silently, every row priced at
    the flag's value; a column kept for comparison (`measured_ms`) is carried through."""
    src = write_csv(tmp_path / "typo.csv", ["mm", "n", "k", "measured_ms"],
                    [(1, 4096, 4096, 0.01), (4096, 4096, 4096, 0.3)])
    rc, stdout, err = cost(capsys, "gemm", "--gpu", GPU, "--m", 512, "--points", src)
    assert rc == 0
    assert err == (f"cost: note: {src}: columns mm, measured_ms name no flag of `cost gemm` "
                   "and are carried through unread (flags: calibration, dtype, engine_version, "
                   "gpu, k, m, n)\n")
    assert [r["measured_ms"] for r in csv.DictReader(stdout.splitlines())] == ["0.01", "0.3"]
    none = write_csv(tmp_path / "none.csv", ["rows", "cols", "depth"], [(1, 2, 3)])
    assert_one_line_error(*cost(capsys, "gemm", "--gpu", GPU, "--points", none),
                          f"{none}: no column names a flag of `cost gemm`; its columns may be "
                          "calibration, dtype, engine_version, gpu, k, m, n")


def test_points_for_attention_accept_flag_spelled_columns(capsys, tmp_path):
    src = write_csv(tmp_path / "attn.csv", ["batch", "context", "heads", "kv-heads"],
                    [(1, 128, 32, 8), (64, 4096, 32, 8), (8, 1024, 64, 64)])
    out = tmp_path / "o.csv"
    assert cost(capsys, "attention", "--gpu", GPU, "--phase", "decode", "--points", src,
                "--out", out)[0] == 0
    priced = read_csv(out)
    assert list(priced[0]) == ["batch", "context", "heads", "kv-heads", "predicted_ms"]
    for row in priced:
        single = cost_json(capsys, "attention", "--gpu", GPU, "--phase", "decode",
                           "--batch", row["batch"], "--context", row["context"],
                           "--heads", row["heads"], "--kv-heads", row["kv-heads"])
        assert float(row["predicted_ms"]) == single["predicted_ms"]


# --- impossible shapes: exit 2, one line naming the problem --------------------------------------


def assert_one_line_error(rc, out, err, *fragments):
    assert rc == 2, (out, err)
    assert err.startswith("servelab cost: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("argv, fragments", [
    (["attention", "--phase", "decode", "--batch", "1", "--context", "10", "--heads", "30",
      "--kv-heads", "8"], ["--heads (30) must be a multiple of --kv-heads (8)"]),
    (["attention", "--phase", "decode", "--batch", "8", "--heads", "32", "--kv-heads", "8"],
     ["--phase decode needs --context >= 1"]),
    (["attention", "--phase", "decode", "--batch", "8", "--context", "0", "--heads", "32",
      "--kv-heads", "8"], ["--phase decode needs --context >= 1"]),
    (["attention", "--phase", "prefill", "--batch", "1", "--heads", "32", "--kv-heads", "8"],
     ["--phase prefill needs --tokens"]),
    (["step", "--model", "llama-3.1-70b", "--tp", "1", "--decode", "1:100"],
     ["llama-3.1-70b weights need", "at tp=1", "raise tp"]),
    (["step", "--model", "llama-3.1-8b", "--decode", "8:0"],
     ["--decode: a decoding sequence has a context of at least 1 token"]),
    (["step", "--model", "llama-3.1-8b", "--prefill", "0"], ["--prefill: sizes must be >= 1"]),
    (["step", "--model", "llama-3.1-8b", "--prefill", "12x"], ["--prefill: expected integers"]),
    (["step", "--model", "llama-3.1-8b"], ["cost step needs --prefill and/or --decode"]),
    (["step", "--model", "llama-3.1-8b", "--prefill", "512:99999999"],
     ["--prefill 512:99999999: a sequence of 100,000,511 tokens is longer than llama-3.1-8b "
      "takes (131,072, its max_position_embeddings)"]),
    (["step", "--model", "llama-3.1-8b", "--decode", "4:131072"], ["--decode 4:131072"]),
    (["step", "--model", "llama-3.1-8b", "--tp", "3", "--decode", "1:5"], ["tp=3 must divide"]),
    (["gemm", "--m", "1", "--n", "1"], ["cost gemm needs --k"]),
    (["gemm", "--m", "1", "--n", "1", "--k", "1", "--out", "x.csv"], ["--out needs --points"]),
    (["gemm", "--m", "1", "--n", "1", "--k", "1", "--calibration", "a100-80gb"],
     ["calibration profile is for device 'a100-80gb'"]),
    (["gemm", "--m", "1", "--n", "1", "--k", "1", "--calibration", "h100-sxm",
      "--engine-version", "0.24.0"],
     ["calibration profile h100-sxm was fitted to kernels measured inside vLLM 0.14.0",
      "h100-sxm.vllm-0.24"]),
    (["gemm", "--m", "1", "--n", "1", "--k", "1", "--engine-version", "latest"],
     ["engine version must be a version such as 0.24.0"]),
])
def test_impossible_requests_are_one_line_errors(capsys, tmp_path, monkeypatch, argv, fragments):
    monkeypatch.chdir(tmp_path)
    kind, *rest = argv
    assert_one_line_error(*cost(capsys, kind, "--gpu", GPU, *rest), *fragments)
    assert not (tmp_path / "x.csv").exists()


def test_an_engine_version_picks_its_profile_and_every_answer_names_it(capsys):
    """--engine-version prices with the profile `profile_for` picks; text and JSON say which
    profile and which vLLM version, for a kernel and for a whole step."""
    argv = ("gemm", "--gpu", GPU, "--m", 64, "--n", 4096, "--k", 4096)
    old, new = cost_json(capsys, *argv, "--engine-version", "0.14.0"), cost_json(capsys, *argv)
    assert (old["calibration"], old["engine_version"]) == ("h100-sxm", "0.14.0")
    assert (new["calibration"], new["engine_version"]) == ("h100-sxm.vllm-0.24", "0.24.0")
    expected = float(K.gemm_time(64, 4096, 4096, get_gpu(GPU),
                                 resolve(GPU, engine_version="0.24.0").kernels.gemm))
    assert new["predicted_ms"] == pytest.approx(expected * 1e3, abs=1e-6)
    assert new["predicted_ms"] != old["predicted_ms"]
    rc, out, _ = cost(capsys, *argv, "--engine-version", "0.24.0")
    assert rc == 0 and "(calibration: h100-sxm.vllm-0.24, vLLM 0.24.0)" in out.splitlines()[0]
    step = cost_json(capsys, "step", "--gpu", "h200", "--model", "llama-3.1-8b",
                     "--decode", "8:100", "--engine-version", "0.24.0")
    assert (step["calibration"], step["engine_version"]) == ("h100-sxm.vllm-0.24", "0.24.0")


def test_a_model_that_fits_at_a_higher_tp_is_priced(capsys):
    r = cost_json(capsys, "step", "--gpu", GPU, "--model", "llama-3.1-70b", "--tp", "4",
                  "--decode", "1:100")
    assert r["tp"] == 4 and r["predicted_ms"] > 0


def test_fp8_gemm_on_a_gpu_without_fp8_tensor_cores(capsys):
    assert_one_line_error(*cost(capsys, "gemm", "--gpu", "a100-80gb", "--m", 1, "--n", 1, "--k", 1,
                                "--dtype", "fp8"), "a100-80gb has no FP8 tensor cores")


@pytest.mark.parametrize("flag, value", [("--m", "0"), ("--k", "-5"), ("--n", "1.5")])
def test_non_positive_sizes_on_the_command_line_are_usage_errors(capsys, flag, value):
    sizes = {"--m": "1", "--n": "1", "--k": "1", flag: value}
    with pytest.raises(SystemExit) as exc:
        main(["cost", "gemm", "--gpu", GPU, *[x for kv in sizes.items() for x in kv]])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected an integer" in err and value in err and "Traceback" not in err


@pytest.mark.parametrize("header, rows, fragments", [
    (["m", "n", "k"], [(1, 1, 1), ("abc", 1, 1)],
     ["line 3: column 'm' must be an integer, got 'abc'"]),
    (["m", "n", "k"], [(1, 1, 1), (1, 1, 1), (1.5, 1, 1)],
     ["line 4: column 'm' must be an integer, got '1.5'"]),
    (["m", "n", "k"], [(0, 4096, 4096)], ["line 2: --m must be an integer >= 1, got 0"]),
    (["m", "n", "k"], [(1, 4096, 4096), (4, 4096, -2)], ["line 3: --k must be an integer >= 1, got -2"]),
    (["m", "n", "k", "dtype"], [(1, 4096, 4096, "int4")], ["line 2: --dtype must be one of"]),
    (["m", "n"], [(1, 4096)], ["line 2: cost gemm needs --k"]),
    (["m", "n", "k"], [(1, 4096, 4096, 7)], ["line 2: more cells than header columns"]),
])
def test_bad_points_name_file_and_line(capsys, tmp_path, header, rows, fragments):
    src = write_csv(tmp_path / "bad.csv", header, rows)
    out = tmp_path / "priced.csv"
    result = cost(capsys, "gemm", "--gpu", GPU, "--points", src, "--out", out)
    assert_one_line_error(*result, f"{src}: ", *fragments)
    assert not out.exists()


def test_an_empty_cell_leaves_the_flag_as_given_so_one_table_mixes_phases(capsys, tmp_path):
    """An MLA table of prefill and decode rows: a decode row leaves `tokens` empty."""
    src = write_csv(tmp_path / "mla.csv", ["phase", "batch", "tokens", "context", "heads", "tp"],
                    [("prefill", 2, 512, 0, 128, 8), ("decode", 64, "", 4096, 128, 8)])
    rows = cost_json(capsys, "mla", "--gpu", GPU, "--phase", "decode", "--points", src)
    prefill = cost_json(capsys, "mla", "--gpu", GPU, "--phase", "prefill", "--batch", 2, "--tokens", 512,
                        "--heads", 128, "--tp", 8)
    decode = cost_json(capsys, "mla", "--gpu", GPU, "--phase", "decode", "--batch", 64, "--context", 4096,
                       "--heads", 128, "--tp", 8)
    assert [r["predicted_ms"] for r in rows] == [prefill["predicted_ms"], decode["predicted_ms"]]
    gemm = write_csv(tmp_path / "gemm.csv", ["m", "n", "k"], [(1, 4096, 4096), (1, 4096, "")])
    assert_one_line_error(*cost(capsys, "gemm", "--gpu", GPU, "--points", gemm),
                          f"{gemm}: line 3: cost gemm needs --k")


def test_cost_mla_says_when_blocks_of_heads_reread_the_latents(capsys):
    """On the L40S (vLLM's Triton MLA kernel) 128 heads over many long sequences read the
    latents once per block of 16 heads: the JSON counts the reads, the text says why."""
    args = ("mla", "--gpu", "l40s", "--phase", "decode", "--batch", 256, "--context", 8191)
    many = cost_json(capsys, *args, "--heads", 128)
    one_block = cost_json(capsys, *args, "--heads", 16)
    assert 7.0 < many["latent_reads"] <= 8.0 and one_block["latent_reads"] == 1.0
    assert many["predicted_ms"] > 5 * one_block["predicted_ms"]
    rc, out, _ = cost(capsys, *args, "--heads", 128)
    assert rc == 0 and f"read {many['latent_reads']:.2f} times from HBM: blocks of 16 heads" in out
    rc, out, _ = cost(capsys, "mla", "--gpu", "h100-sxm", "--phase", "decode", "--batch", 256,
                      "--context", 8191, "--heads", 128)
    assert rc == 0 and "re-read" not in out          # FlashMLA: one read
    for phase in ("decode", "prefill"):   # the engine cannot serve it at all
        rc, out, err = cost(capsys, "mla", "--gpu", "l40s", "--phase", phase, "--batch", 4,
                            "--tokens", 512, "--context", 8191, "--heads", 128, "--kv-dtype", "fp8")
        assert rc != 0 and not out and "Triton kernel, which has none" in err


def test_bad_attention_point_names_its_line(capsys, tmp_path):
    src = write_csv(tmp_path / "attn.csv", ["batch", "context", "heads", "kv_heads"],
                    [(1, 10, 32, 8), (1, 10, 30, 8)])
    assert_one_line_error(*cost(capsys, "attention", "--gpu", GPU, "--phase", "decode",
                                "--points", src),
                          f"{src}: line 3: --heads (30) must be a multiple of --kv-heads (8)")
    src = write_csv(tmp_path / "ctx.csv", ["batch", "context", "heads", "kv_heads"],
                    [(1, 10, 32, 8), (4, 0, 32, 8)])
    assert_one_line_error(*cost(capsys, "attention", "--gpu", GPU, "--phase", "decode",
                                "--points", src), f"{src}: line 3: ", "--context >= 1")


@pytest.mark.parametrize("kind, header, row, refused", [
    ("gemm", ["m", "n", "k", "dtype"], (16, 4096, 4096, "fp32"), "fp32"),
    ("allreduce", ["gpus", "elements", "dtype"], (2, 4096, "fp8"), "fp8"),
])
def test_points_refuse_a_dtype_the_flag_refuses(capsys, tmp_path, kind, header, row, refused):
    """Columns are "named like the flags": a value `--dtype` refuses for this kind must not
    be priced from a CSV either."""
    with pytest.raises(SystemExit):
        main(["cost", kind, "--gpu", GPU, "--dtype", refused])
    capsys.readouterr()
    src = write_csv(tmp_path / "p.csv", header, [row])
    assert_one_line_error(*cost(capsys, kind, "--gpu", GPU, "--points", src),
                          f"{src}: line 2: ", refused)


def test_data_parallel_ranks_of_a_dense_model_are_replicas_priced_one_at_a_time(capsys):
    """`simulate --dp 2` on a dense model runs two independent replicas; `cost step --dp 2`
    prices one of them, not a refusal naming --ep."""
    argv = ("step", "--gpu", GPU, "--model", "tiny-llama", "--decode", "8:100")
    assert cost_json(capsys, *argv, "--dp", 2)["predicted_ms"] == cost_json(capsys, *argv)["predicted_ms"]


def test_a_profile_of_another_engine_version_names_costs_own_flag(capsys):
    """`cost` chooses an engine version with --engine-version (simulate's --engine is not
    one of its flags), and its refusal says so."""
    argv = ["cost", "gemm", "--gpu", "h100-sxm", "--m", "512", "--n", "4096", "--k", "4096",
            "--calibration", "h100-sxm", "--engine-version", "0.24.0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "or choose that engine (--engine-version 0.14.0)" in err and "--engine vllm" not in err


def test_points_say_which_flags_and_columns_they_replace(tmp_path, capsys):
    """With --points, a flag set away from its default that a column sets too fills only
    that column's empty cells, and a note says so; a predicted_ms column already in the
    file is replaced, and the note says so rather than that it is carried through unread."""
    points = tmp_path / "p.csv"
    points.write_text("m,n,k,dtype\n512,4096,4096,fp8\n")
    base = ["cost", "gemm", "--gpu", "h100-sxm", "--points", str(points)]
    assert main(base + ["--m", "7"]) == 0
    out, err = capsys.readouterr()
    assert f"{points}: column m sets m row by row; --m 7 fills only its empty cells" in err
    assert out.splitlines()[1].startswith("512,4096,4096,fp8,")
    assert main(base + ["--out", str(tmp_path / "o.csv")]) == 0
    capsys.readouterr()
    again = ["cost", "gemm", "--gpu", "h100-sxm", "--points", str(tmp_path / "o.csv")]
    assert main(again) == 0
    err = capsys.readouterr().err
    assert "column predicted_ms is replaced by this pricing's" in err and "unread" not in err


def test_an_engine_version_without_its_own_profile_is_noted(capsys):
    """`cost --engine-version` for a version the GPU was not measured inside prices the
    nearest one, and says so as `simulate` does (it said nothing)."""
    base = ("step", "--gpu", "rtx-pro-6000", "--model", "llama-3.1-8b", "--decode", "32:2048")
    rc, out, err = cost(capsys, *base, "--engine-version", "9.9.9")
    assert rc == 0 and "vLLM 0.19.0" in out.splitlines()[0]
    assert err == ("cost: note: carried over: no rtx-pro-6000 tables for vLLM 9.9.9; "
                   "rtx-pro-6000's vLLM 0.19.0 profile (nearest engine version measured on this "
                   "GPU)\n")
    rc, _, err = cost(capsys, *base, "--engine-version", "0.19.0")
    assert rc == 0 and err == ""
