"""Speculative decoding in the simulator: the scheduler's verify steps, the acceptance
model, the pricing, and the refusals (servelab/speculative.py, simulator/speculation.py)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from servelab.cli import main
from servelab.config import SchedulerConfig, SpeculativeConfig
from servelab.speculative import accepted_tokens, expected_tokens_per_step
from servelab.simulator.run import SimulationConfig, run_simulation
from servelab.traces import Trace, TraceRecord, write_csv

TARGET = dict(model="llama-3.1-70b", gpu="h100-sxm", tp=4)


def _config(tmp_path, records, spec: SpeculativeConfig | None = None, **kw) -> SimulationConfig:
    trace = tmp_path / "t.csv"
    if not trace.exists():
        write_csv(Trace(tuple(records)), trace)
    scheduler = SchedulerConfig(max_num_batched_tokens=2048, chunked_prefill=2048, max_model_len=8192,
                                speculative=spec or SpeculativeConfig())
    return SimulationConfig(trace=str(trace), engine=None, scheduler=scheduler, prefix_caching=False,
                            watermark=0.0, **{**TARGET, **kw})


def _decode_steps(result) -> dict[int, int]:
    return {r["request_id"]: r["decode_steps"] for r in result.derived["speculation"]["requests"]}


# --------------------------------------------------------------------------- the acceptance model
def test_draws_follow_the_per_token_model():
    for k, alpha in ((4, 0.8), (2, 0.5), (6, 0.3)):
        draws = [accepted_tokens(7, rid, pos, k, alpha) for rid in range(100) for pos in range(60)]
        assert all(0 <= a <= k for a in draws)
        mean = sum(a + 1 for a in draws) / len(draws)
        assert mean == pytest.approx(expected_tokens_per_step(k, alpha), rel=0.03)
    assert accepted_tokens(0, 1, 2, 4, 1.0) == 4 and accepted_tokens(0, 1, 2, 4, 0.0) == 0
    assert expected_tokens_per_step(4, 1.0) == 5


def test_a_draw_depends_on_the_request_and_position_only():
    assert [accepted_tokens(3, 9, p, 4, 0.7) for p in range(50)] == \
           [accepted_tokens(3, 9, p, 4, 0.7) for p in range(50)]
    assert [accepted_tokens(3, 9, p, 4, 0.7) for p in range(50)] != \
           [accepted_tokens(4, 9, p, 4, 0.7) for p in range(50)]


# --------------------------------------------------------------------------- runs
@settings(max_examples=12, deadline=None)
@given(outputs=st.lists(st.integers(1, 40), min_size=1, max_size=6), k=st.integers(1, 6))
def test_full_acceptance_needs_ceil_of_n_over_k_plus_one_steps(tmp_path_factory, outputs, k):
    """With every proposal accepted, a request of N output tokens gets its first from its
    prefill and the other N - 1 from ceil((N - 1) / (K + 1)) decode steps."""
    tmp = tmp_path_factory.mktemp("full")
    records = [TraceRecord(0.01 * i, 100 + 7 * i, n) for i, n in enumerate(outputs)]
    spec = SpeculativeConfig("ngram", num_speculative_tokens=k, acceptance=1.0)
    result = run_simulation(_config(tmp, records, spec))
    steps = _decode_steps(result)
    for i, n in enumerate(outputs):
        assert steps.get(i, 0) == math.ceil((n - 1) / (k + 1)), (i, n)
    assert [r.output_tokens for r in sorted(result.requests, key=lambda r: r.request_id)] == outputs


def test_no_acceptance_is_never_faster(tmp_path):
    records = [TraceRecord(0.05 * i, 300 + 13 * i, 60 + 5 * i) for i in range(12)]
    plain = run_simulation(_config(tmp_path, records))
    spec = run_simulation(_config(tmp_path, records, SpeculativeConfig("ngram", acceptance=0.0)))
    base = {r.request_id: r for r in plain.requests}
    for r in spec.requests:
        assert r.finish_s >= base[r.request_id].finish_s - 1e-12
        assert r.output_tokens == base[r.request_id].output_tokens
    assert spec.derived["speculation"]["accepted_tokens"] == 0


def test_a_good_draft_speeds_decoding_up_at_low_load(tmp_path):
    records = [TraceRecord(1.0 * i, 500, 200) for i in range(6)]
    plain = run_simulation(_config(tmp_path, records))
    spec = run_simulation(_config(tmp_path, records, SpeculativeConfig(
        "draft", draft_model="llama-3.1-8b", acceptance=0.8)))
    tpot = lambda res: sum(r.tpot_ms for r in res.requests) / len(res.requests)
    assert tpot(plain) / tpot(spec) > 1.5
    stats = spec.derived["speculation"]
    # accepted / proposed counts the leading run: sum of 0.8^j for j = 1..4, over 4
    assert stats["acceptance_rate"] == pytest.approx(sum(0.8 ** j for j in range(1, 5)) / 4, abs=0.05)
    assert stats["tokens_per_decode_step"] == pytest.approx(expected_tokens_per_step(4, 0.8), rel=0.1)


def test_speculation_stops_above_the_batch_limit(tmp_path):
    records = [TraceRecord(0.0, 200, 20 * (i + 1)) for i in range(8)]   # 8 running, then fewer
    free = run_simulation(_config(tmp_path, records, SpeculativeConfig("ngram", acceptance=0.5)))
    capped = run_simulation(_config(tmp_path, records, SpeculativeConfig("ngram", acceptance=0.5, max_batch=4)))
    proposed = lambda res: res.derived["speculation"]["proposed_tokens"]
    assert 0 < proposed(capped) < proposed(free)


def test_tight_memory_preempts_and_still_finishes_everything(tmp_path):
    """Lookahead slots under pressure: recompute and swap preemption, every block back."""
    records = [TraceRecord(0.01 * i, 400, 150) for i in range(10)]
    for preemption in ("recompute", "swap"):
        config = _config(tmp_path, records, SpeculativeConfig("ngram", acceptance=0.6), kv_blocks=140,
                         cpu_kv_blocks=400)
        config = replace(config, scheduler=replace(config.scheduler, preemption=preemption))
        result = run_simulation(config)
        assert sum(r.num_preemptions for r in result.requests) > 0, preemption
        assert all(r.status == "finished" and r.output_tokens == 150 for r in result.requests)


def test_per_tenant_acceptance(tmp_path):
    records = [TraceRecord(0.5 * i, 300, 120, tenant="a" if i % 2 else "b") for i in range(8)]
    spec = SpeculativeConfig("ngram", acceptance=0.9, tenant_acceptance=(("b", 0.2),))
    result = run_simulation(_config(tmp_path, records, spec))
    per = {r["request_id"]: r for r in result.derived["speculation"]["requests"]}
    rate = lambda ids: sum(per[i]["accepted"] for i in ids) / sum(per[i]["proposed"] for i in ids)
    leading = lambda alpha: sum(alpha ** j for j in range(1, 5)) / 4   # K = 4
    assert rate([1, 3, 5, 7]) == pytest.approx(leading(0.9), abs=0.07)
    assert rate([0, 2, 4, 6]) == pytest.approx(leading(0.2), abs=0.07)


def test_a_run_is_deterministic_and_reruns_from_its_config(tmp_path):
    argv = ["simulate", "--trace", "default", "--num-requests", "150", "--rate", "10", "--model",
            "llama-3.1-70b", "--tp", "4", "--speculative", "draft:llama-3.1-8b", "--acceptance-rate", "0.7"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    for name in ("summary.json", "requests.csv", "steps.csv", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    config = json.loads((tmp_path / "a" / "config.json").read_text())["config"]
    assert config["scheduler"]["speculative"]["method"] == "draft"
    again = run_simulation(SimulationConfig.from_dict(config))
    assert again.summary == json.loads((tmp_path / "a" / "summary.json").read_text())


@pytest.mark.parametrize("flags, message", [
    (["--speculative", "draft:llama-2-7b"], "a draft must share the target's vocabulary"),
    (["--speculative", "draft:llama-3.1-70b"], "is larger than the target"),
    (["--speculative", "draft"], "draft needs its model"),
    (["--speculative", "medusa"], "--speculative: expected draft:MODEL"),
    (["--speculative", "ngram", "--acceptance-rate", "1.5"], "an acceptance rate is in [0, 1]"),
    (["--acceptance-rate", "0.5"], "--acceptance-rate configures speculative decoding"),
])
def test_bad_speculation_is_one_line(tmp_path, capsys, flags, message):
    argv = ["simulate", "--trace", "default", "--num-requests", "20", "--model", "llama-3.1-8b", *flags,
            "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_weights_that_do_not_fit_with_a_draft_name_the_draft_and_no_pipeline_stages():
    """Pipeline stages are not modelled with speculation, so the refusal does not offer
    them; the draft's share of the weights is named."""
    from servelab.models import load_model_spec
    from servelab.simulator.footprint import kv_capacity_blocks
    from servelab.simulator.gpus import get_gpu

    model = load_model_spec("qwen3-30b-a3b")
    with pytest.raises(ValueError) as refused:
        kv_capacity_blocks(model, get_gpu("h100-sxm"), tp=1, ep=2, proposer=model)
    message = str(refused.value)
    assert message.startswith("qwen3-30b-a3b's weights and its proposer's (qwen3-30b-a3b, 56.9 GiB) need "
                              "86.7 GiB per GPU at tp=1, ep=2 (bf16)")
    assert "pipeline" not in message and message.endswith("raise tp or ep or use fp8 weights")
    assert kv_capacity_blocks(model, get_gpu("h100-sxm"), tp=1, ep=2) > 0   # alone it fits


def test_mtp_needs_a_model_with_multi_token_prediction_layers():
    from servelab.config import SpeculativeConfig
    from servelab.models import load_model_spec
    from servelab.simulator.speculation import proposer_spec

    mtp = SpeculativeConfig(method="mtp", num_speculative_tokens=1)
    head = proposer_spec(mtp, load_model_spec("deepseek-v3"))
    assert head.num_layers == 1 and head.name == "deepseek-v3 mtp head"
    with pytest.raises(ValueError, match=r"^--speculative mtp needs a model with multi-token-prediction "
                                         r"layers .*llama-3.1-8b \(LlamaForCausalLM\) has none"):
        proposer_spec(mtp, load_model_spec("llama-3.1-8b"))
    eagle = SpeculativeConfig(method="eagle", num_speculative_tokens=1)
    assert proposer_spec(eagle, load_model_spec("llama-3.1-8b")).num_layers == 1


def test_a_mixture_of_experts_targets_head_is_one_of_its_moe_layers():
    """DeepSeek-V3's MTP head (and an EAGLE head on a MoE target) is one MoE layer: its
    weights are positive and take KV room from the target (a head built with the target's
    three dense leading layers' indices counted -2 MoE layers and added room)."""
    from servelab.config import SpeculativeConfig
    from servelab.models import load_model_spec
    from servelab.simulator.footprint import kv_capacity_blocks, weight_bytes_per_gpu
    from servelab.simulator.speculation import proposer_spec

    target = load_model_spec("deepseek-v3")
    head = proposer_spec(SpeculativeConfig(method="mtp", num_speculative_tokens=1), target)
    assert head.num_layers == 1 and head.moe is not None and head.moe.dense_layers == ()
    assert weight_bytes_per_gpu(head, 8, "fp8") > 0
    without = kv_capacity_blocks(target, "h200", 8, weight_dtype="fp8")
    assert kv_capacity_blocks(target, "h200", 8, weight_dtype="fp8", proposer=head) < without
