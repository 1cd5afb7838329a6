"""`servelab cost step --pp N`: one step of a pipelined replica, priced as the simulator
prices it (`simulator/pipeline.py`).

The expected figures come from the simulator's own pipeline at the same shape: the
stages' layer split and times of a `PipelineLayout`, its transfer times, and the step's
end as `StageTimeline.run_step` charges a lone batch on idle stages. Bad layouts are
one-line errors, the same checks `simulate --pp` makes.
"""
from __future__ import annotations

import csv

import pytest

from test_cost_cli import cost, cost_json
from servelab.cli import main
from servelab.outputs import BatchShape
from servelab.simulator.cost_model import CostModel
from servelab.simulator.pipeline import PipelineLayout, StageTimeline

GPU = "h100-sxm"
DECODE = (64, 2000)   # 64 sequences at context 2000
PREFILL = (512, 1024)   # one chunk of 512 tokens after 1024 cached


def shape() -> BatchShape:
    (t, c), (b, d) = PREFILL, DECODE
    return BatchShape(num_prefill_seqs=1, num_prefill_tokens=t, prefill_context_sum=c,
                      prefill_q_context_sum=t * c, prefill_q_sq_sum=t * t, num_decode_seqs=b,
                      decode_context_sum=b * d, prefill_max_keys=t + c)


STEP = ("--prefill", f"{PREFILL[0]}:{PREFILL[1]}", "--decode", f"{DECODE[0]}:{DECODE[1]}")


@pytest.mark.parametrize("model, tp, pp, extra", [
    ("llama-3.1-70b", 4, 3, ()),          # 80 layers over 3 stages: 27, 27, 26; a node boundary
    ("llama-3.1-8b", 1, 2, ()),           # both stages on one node's NVLink
    ("qwen3-30b-a3b", 2, 4, ("--ep", "2")),   # mixture of experts, EP within the stage's TP
])
def test_a_pipelined_step_is_what_the_simulator_charges(capsys, model, tp, pp, extra):
    r = cost_json(capsys, "step", "--gpu", GPU, "--model", model, "--tp", tp, "--pp", pp, *extra, *STEP)
    cm = CostModel(model, GPU, tp=tp, ep=int(extra[1]) if extra else 1,
                   calibration=f"{GPU}.vllm-0.24")     # cost's default: simulate's engine
    layout = PipelineLayout(cm.model, cm, pp)
    s = shape()
    stage_s = layout.stage_times(s)
    assert r["pp"] == pp and len(r["stages"]) == pp
    assert [st["layers"] for st in r["stages"]] == [list(x) for x in layout.layer_ranges]
    assert [st["ms"] for st in r["stages"]] == pytest.approx([t * 1e3 for t in stage_s], abs=1e-6)
    assert r["slowest_stage"] == stage_s.index(max(stage_s))
    assert r["slowest_stage_ms"] == pytest.approx(max(stage_s) * 1e3, abs=1e-6)
    sends = [layout.transfer_time(b, s.num_tokens) for b in range(pp - 1)]
    assert [x["ms"] for x in r["transfers"]] == pytest.approx([t * 1e3 for t in sends], abs=1e-6)
    assert [x["link"] for x in r["transfers"]] == [link.link.name for link in layout.links]
    # the step's end as the simulator's stage timeline charges it, on idle stages
    assert r["predicted_ms"] == pytest.approx(StageTimeline(layout).run_step(0.0, s) * 1e3, abs=1e-6)
    assert r["predicted_ms"] == pytest.approx(sum(st["ms"] for st in r["stages"]) + r["transfer_ms"],
                                              abs=1e-5)
    # ops summed over the stages, plus the sends, make the step; each layer counted once
    assert sum(op["total_ms"] for op in r["ops"]) + r["transfer_ms"] == \
        pytest.approx(r["predicted_ms"], abs=1e-4)
    ops = {op["op"]: op for op in r["ops"]}
    assert ops["input_norm"]["calls"] == cm.model.num_layers
    assert ops["step_overhead"]["calls"] == ops["lm_head"]["calls"] == ops["embedding"]["calls"] == 1


def test_the_text_names_every_stage_the_slowest_and_the_sends(capsys):
    r = cost_json(capsys, "step", "--gpu", GPU, "--model", "llama-3.1-70b", "--tp", 4, "--pp", 3, *STEP)
    rc, out, err = cost(capsys, "step", "--gpu", GPU, "--model", "llama-3.1-70b", "--tp", 4, "--pp", 3,
                        *STEP)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"{r['predicted_ms']:.4f} ms  one step of llama-3.1-70b (tp=4, pp=3,")
    assert lines[1] == f"  stage 0 (layers 0-26): {r['stages'][0]['ms']:.4f} ms" + (
        "  <- slowest" if r["slowest_stage"] == 0 else "")
    assert sum("<- slowest" in line for line in lines) == 1
    assert f"  send 1 -> 2 over {r['transfers'][1]['link']} x4: {r['transfers'][1]['ms']:.4f} ms" in lines
    assert f"one step per {r['slowest_stage_ms']:.4f} ms" in out


def test_pp_1_is_the_plain_step(capsys):
    plain = cost_json(capsys, "step", "--gpu", GPU, "--model", "llama-3.1-8b", *STEP)
    assert cost_json(capsys, "step", "--gpu", GPU, "--model", "llama-3.1-8b", "--pp", 1, *STEP) == plain
    assert "pp" not in plain and "stages" not in plain


def test_points_take_a_pp_column(capsys, tmp_path):
    src, out = tmp_path / "steps.csv", tmp_path / "priced.csv"
    src.write_text("pp,tp,decode\n1,4,64:2000\n2,4,64:2000\n3,4,64:2000\n")
    rc, _, err = cost(capsys, "step", "--gpu", GPU, "--model", "llama-3.1-70b", "--points", src,
                      "--out", out)
    assert rc == 0, err
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["pp"] for row in rows] == ["1", "2", "3"]
    for row in rows:
        single = cost_json(capsys, "step", "--gpu", GPU, "--model", "llama-3.1-70b", "--tp", 4,
                           "--pp", row["pp"], "--decode", "64:2000")
        assert float(row["predicted_ms"]) == pytest.approx(single["predicted_ms"], abs=1e-9)
    assert len({row["predicted_ms"] for row in rows}) == 3


@pytest.mark.parametrize("argv, fragments", [
    (["--model", "llama-3.1-8b", "--pp", "33"],
     ["pp=33 exceeds llama-3.1-8b's 32 layers", "pp <= 32"]),
    (["--model", "qwen3-30b-a3b", "--dp", "2", "--pp", "2"],
     ["--pp 2 with data-parallel expert parallelism (ep=2 above tp=1) is not modelled"]),
    (["--model", "llama-3.1-70b", "--pp", "2", "--gpu", "l40s"],
     ["weights need", "pipeline stage 0 (layers 0-39)", "raise pp or tp"]),
])
def test_a_layout_that_cannot_run_is_one_line(capsys, argv, fragments):
    gpu = [] if "--gpu" in argv else ["--gpu", GPU]
    rc, out, err = cost(capsys, "step", *gpu, *argv, "--decode", "8:100")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("cell, fragment", [
    ("40", "pp=40 exceeds llama-3.1-8b's 32 layers"), ("0", "--pp must be an integer >= 1, got 0")])
def test_a_bad_pp_cell_names_its_line(capsys, tmp_path, cell, fragment):
    src = tmp_path / "steps.csv"
    src.write_text(f"pp,decode\n2,8:100\n{cell},8:100\n")
    rc, out, err = cost(capsys, "step", "--gpu", GPU, "--model", "llama-3.1-8b", "--points", src)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{src}: line 3: {fragment}" in err


def test_pp_0_is_refused_by_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["cost", "step", "--gpu", GPU, "--model", "llama-3.1-8b", "--pp", "0", "--decode", "8:100"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--pp: expected an integer >= 1" in err
