"""Disaggregated prefill/decode on the real backend (`servelab.backends.disaggregated`).

One prefill engine and one decode engine share the tiny seeded Llama of
test_backend_e2e.py; each request's prompt is prefilled (and its first token sampled) on
the first, its prompt KV blocks are copied into the second's cache, and the second
decodes the rest. Greedy decoding must give every request Hugging Face's `generate()`
continuation token for token, however the decode cache is sized (roomy, small enough that
finished prefills wait for it, or so small that decodes are preempted there): a block
copied to the wrong place, not copied, or read before it lands changes the tokens, which a
control run with the copy switched off shows. The copy itself is checked in place (the
decode blocks equal the prefill blocks they came from), and the run directory holds one
handoffs row per handed-off request.

Timelines: the two engines interleave by their virtual times, made of measured step and
copy durations, so which request lands, grows or is preempted when depends on the
machine's load. Most tests fix every step and copy at STEP_S (`fixed_times`), which makes
each run's decisions the same everywhere; one case keeps the measured times.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from _backend_device import DEVICE
from servelab.backends.disaggregated import RealDisaggregation, pool_blocks
from servelab.backends.kv_cache import KVCache
from servelab.backends.run import RealRunConfig, RunSetupError, run_real
from servelab.backends.sampling import SamplingParams
from servelab.config import SchedulerConfig
from servelab.request import Request
from test_backend_e2e import (TRACE_CSV, assert_matches_hf, checkpoint, prompt,  # noqa: F401
                              reference, run_cli)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

BLOCK_SIZE = 4
STEP_S = 0.001
# (prompt, output) tokens: prompts ending mid-block and on a block edge, and one request
# of a single output token, which ends on the prefill engine.
LENGTHS = [(5, 12), (13, 8), (9, 12), (8, 10), (11, 9), (6, 12), (3, 1)]


def requests(spread: bool = False) -> list[Request]:
    """All at t=0: prefilled in one step, then landed in order (0, 1 and 2 fill a decode
    cache of 9 blocks, so the others wait, however long steps take); or, `spread`, three
    at t=0 and the rest over the next milliseconds, prefilled while the first decode."""
    return [Request(i, 0.0 if i < 3 or not spread else 0.0005 * i, p, o,
                    prompt_token_ids=prompt(700 + i, p))
            for i, (p, o) in enumerate(LENGTHS)]


def serve(checkpoint, reqs, *, prefill_blocks=32, decode_blocks=64, cpu_kv_blocks=0,
          prefix_caching=False, sampling=SamplingParams(), replay=True, out=None,
          disaggregated=True, **scheduler):
    folder, _ = checkpoint
    config = RealRunConfig(
        model=None, checkpoint=str(folder), device=DEVICE, dtype="float32",
        scheduler=SchedulerConfig(**{"max_model_len": 256, **scheduler}),
        cache=dict(block_size=BLOCK_SIZE, num_gpu_blocks=prefill_blocks,
                   num_cpu_blocks=cpu_kv_blocks, enable_prefix_caching=prefix_caching),
        sampling=sampling, replay=replay, progress=False,
        disaggregation=RealDisaggregation(decode_kv_blocks=decode_blocks) if disaggregated else None)
    return run_real(config, out, requests=reqs)


def handoff_rows(result) -> list:
    return list(result.disaggregation.handoffs)


def fix_times(monkeypatch) -> None:
    """Every engine step and every KV copy takes STEP_S (`StepTimer`, which times both)."""
    from servelab.backends.executor import StepTimer

    monkeypatch.setattr(StepTimer, "stop", lambda self: STEP_S)


@pytest.fixture
def fixed_times(monkeypatch):
    fix_times(monkeypatch)


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("decode_blocks, preemption, spread, measured", [
    (64, "recompute", True, True),    # room to spare: nothing waits; measured times
    (64, "recompute", False, False),
    (9, "recompute", False, False),   # finished prefills wait for the decode cache; decodes are preempted
    (9, "swap", False, False),
    (9, "recompute", True, False),    # prefill steps between decode steps
])
def test_greedy_outputs_match_hf_generate(checkpoint, reference, monkeypatch, decode_blocks,
                                          preemption, spread, measured):
    if not measured:
        fix_times(monkeypatch)
    reqs = requests(spread)
    result = serve(checkpoint, reqs, decode_blocks=decode_blocks, preemption=preemption,
                   cpu_kv_blocks=16)
    assert_matches_hf(result, reqs, reference)
    rows = handoff_rows(result)
    handed = [r.request_id for r in reqs if r.output_len > 1]
    assert [h.request_id for h in rows] == handed
    block_bytes = result.disaggregation.report["layout"]["block_bytes"]
    for h in rows:
        assert h.kv_bytes == math.ceil(h.prompt_tokens / BLOCK_SIZE) * block_bytes > 0
        assert h.prefill_end_s <= h.landed_s <= h.transfer_start_s < h.transfer_end_s == h.released_s
    records = {r.request_id: r for r in result.records}
    for h in rows:   # TTFT on the prefill engine, the rest on the decode engine, after the copy
        rec = records[h.request_id]
        assert rec.first_token_s == h.prefill_end_s and rec.finish_s > h.transfer_end_s
    report = result.disaggregation.report
    assert report["transfers"]["count"] == len(handed) and report["requests"]["ended_on_prefill_pool"] == 1
    waited = report["back_pressure"]["requests_that_waited"]
    assert report["requests"]["decode_rejections_for_memory"] == 0
    if decode_blocks == 64:
        assert waited == 0 and result.summary["num_preemptions"] == 0
    else:
        assert waited > 0 and report["back_pressure"]["waiting_peak_blocks"] > 0
        assert any(h.landed_s > h.prefill_end_s for h in rows)
        assert result.summary["num_preemptions"] > 0
        if preemption == "swap":
            assert result.num_swap_preemptions > 0


def test_prefix_cache_on_the_prefill_engine_and_chunked_prefill_match_hf(checkpoint, reference,
                                                                         fixed_times):
    shared = prompt(7, 8)   # two full blocks
    reqs = [Request(i, 0.0 if i == 0 else 1.0, 8 + t, 7, prompt_token_ids=shared + prompt(750 + i, t))
            for i, t in enumerate((3, 5, 2, 6))]
    result = serve(checkpoint, reqs, prefix_caching=True, chunked_prefill=4,
                   max_num_batched_tokens=8)
    assert_matches_hf(result, reqs, reference)
    assert result.block_usage.prefix_hits >= 2 * (len(reqs) - 1)
    assert [r.cached_tokens for r in result.records] == [0, 8, 8, 8]


def test_decode_reads_the_copied_blocks_and_nothing_else(checkpoint, reference, monkeypatch,
                                                         fixed_times):
    """The copy in place: every decode block equals the prefill block it came from, and
    every prefill block copied holds computed KV. The decode cache starts as NaN, so a
    slot read before anything wrote it would show in the tokens; without the copy they
    change."""
    import functools

    import servelab.backends.run as run_module
    from servelab.backends.disaggregated import decode_runner

    monkeypatch.setattr(run_module, "decode_runner", functools.partial(decode_runner, poison_kv=True))
    copies = []
    original = KVCache.copy_blocks_to

    def checked(self, other, pairs):
        assert not self.k.isnan().any() and (copies or other.k.isnan().all())
        copied = original(self, other, pairs)
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for mine, theirs in ((self.k, other.k), (self.v, other.v)):
            assert torch.equal(theirs[:, dst], mine[:, src])
            assert mine[:, src].abs().sum() > 0
        copies.append((len(pairs), copied))
        return copied

    monkeypatch.setattr(KVCache, "copy_blocks_to", checked)
    reqs = requests()
    result = serve(checkpoint, reqs, decode_blocks=9)
    assert_matches_hf(result, reqs, reference)
    assert [c for _, c in copies] == [h.kv_bytes for h in sorted(
        handoff_rows(result), key=lambda h: h.transfer_start_s)]
    assert sum(n for n, _ in copies) == result.disaggregation.report["transfers"]["blocks"]

    monkeypatch.setattr(KVCache, "copy_blocks_to", lambda self, other, pairs: 0)
    reqs = requests()
    control = serve(checkpoint, reqs, decode_blocks=9)
    assert any(control.outputs[r.request_id] != [reference(r.prompt_token_ids)[:r.output_len]]
               for r in reqs)


def test_sampled_outputs_equal_one_engines(checkpoint, fixed_times):
    """The random streams follow a request to the decode engine: with temperature, each
    request draws what it draws when one engine serves it."""
    hot = SamplingParams(temperature=1.2, top_k=40)
    reqs = [Request(i, 0.0, p, o, prompt_token_ids=prompt(800 + i, p), seed=None if i % 2 else 10 + i)
            for i, (p, o) in enumerate(LENGTHS)]
    together = serve(checkpoint, [r.fresh_copy() for r in reqs], sampling=hot, disaggregated=False)
    apart = serve(checkpoint, [r.fresh_copy() for r in reqs], sampling=hot, decode_blocks=9)
    assert apart.outputs == together.outputs
    assert apart.disaggregation.report["back_pressure"]["requests_that_waited"] > 0


def test_eos_as_first_token_ends_the_request_on_the_prefill_engine(checkpoint, reference, tmp_path,
                                                                  fixed_times):
    import shutil

    folder, hf = checkpoint
    p = prompt(900, 7)
    first = reference(p)[0]
    eos_folder = shutil.copytree(folder, tmp_path / "eos")
    config = json.loads((eos_folder / "config.json").read_text())
    config["eos_token_id"] = first
    (eos_folder / "config.json").write_text(json.dumps(config))
    other = prompt(901, 6)
    reqs = [Request(0, 0.0, 7, 9, prompt_token_ids=p), Request(1, 0.0, 6, 5, prompt_token_ids=other)]
    result = serve((eos_folder, hf), reqs, replay=False)
    stop = reference(other).index(first) + 1 if first in reference(other)[:5] else 5
    assert result.outputs == {0: [[first]], 1: [reference(other)[:stop]]}
    assert result.records[0].status == "finished" and result.records[0].output_tokens == 1
    assert [h.request_id for h in handoff_rows(result)] == [1]


def test_wall_clock_serves_every_request(checkpoint, reference):
    """On the wall clock the engines share real time (each waits for the other's steps):
    the same tokens, and every step starts after the previous one, of either engine, ended."""
    folder, _ = checkpoint
    config = RealRunConfig(model=None, checkpoint=str(folder), device=DEVICE, dtype="float32",
                           clock="wall",
                           cache=dict(block_size=BLOCK_SIZE, num_gpu_blocks=32), progress=False,
                           disaggregation=RealDisaggregation(decode_kv_blocks=64))
    reqs = requests(spread=True)
    result = run_real(config, None, requests=reqs)
    assert_matches_hf(result, reqs, reference)
    steps = result.steps
    assert all(b.start_s >= a.start_s + a.duration_s for a, b in zip(steps, steps[1:]))
    assert len(handoff_rows(result)) == len(reqs) - 1


def test_a_lone_decode_is_not_aborted_for_blocks_that_landed_imports_hold(checkpoint, reference,
                                                                          fixed_times):
    """Two prompts of two full blocks land at once and fill a decode cache of four blocks;
    the first is delivered a copy earlier and decodes alone, and needs a third block at its
    second step, while the second, delivered, waits to be admitted. Its whole length (12
    tokens) fits the cache (16): it should wait, or be preempted, not be rejected."""
    reqs = [Request(i, 0.0, 7, 6, prompt_token_ids=prompt(950 + i, 7)) for i in range(2)]
    result = serve(checkpoint, reqs, decode_blocks=4)
    assert result.disaggregation.report["requests"]["decode_rejections_for_memory"] == 0
    assert_matches_hf(result, reqs, reference)


# --------------------------------------------------------------------------- setup


def test_pool_blocks_share_what_one_engine_would_get():
    derive = lambda: 100   # noqa: E731
    assert pool_blocks(RealDisaggregation(), None, derive) == (50, 50, "derived")
    assert pool_blocks(RealDisaggregation(), 30, derive) == (30, 30, "given")
    assert pool_blocks(RealDisaggregation(prefill_kv_blocks=70), None, derive) == (70, 30, "derived")
    assert pool_blocks(RealDisaggregation(decode_kv_blocks=20), 8, derive) == (8, 20, "given")
    with pytest.raises(ValueError, match="leave none of the 100 that fit"):
        pool_blocks(RealDisaggregation(decode_kv_blocks=100), None, derive)


def test_copy_blocks_to_moves_only_the_given_blocks():
    src = KVCache(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8,
                  dtype=torch.float32, device=DEVICE)
    src.k.normal_(), src.v.normal_()
    dst = src.like(3, poison=True)
    assert dst.k.shape[1] == 3 and dst.k.isnan().all()
    assert src.copy_blocks_to(dst, [(4, 0), (1, 2)]) == 2 * src.bytes_per_block
    for pool, into in ((src.k, dst.k), (src.v, dst.v)):
        assert torch.equal(into[:, 0], pool[:, 4]) and torch.equal(into[:, 2], pool[:, 1])
        assert into[:, 1].isnan().all()   # untouched
    other = KVCache(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=1, head_dim=8,
                    dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="caches differ in layout"):
        src.copy_blocks_to(other, [(0, 0)])
    with pytest.raises(ValueError, match=r"destination block\(s\) \[3\] outside \[0, 3\)"):
        src.copy_blocks_to(dst, [(0, 3)])


def test_what_a_disaggregated_run_cannot_serve_is_refused_before_it(checkpoint):
    from servelab.config import SpeculativeConfig

    with pytest.raises(ValueError, match="does not run with speculative decoding"):
        RealRunConfig(model="tiny-llama", disaggregation=RealDisaggregation(),
                      scheduler=SchedulerConfig(speculative=SpeculativeConfig(method="ngram")))
    with pytest.raises(RunSetupError, match=r"request 0 asks for n > 1 samples"):
        serve(checkpoint, [Request(0, 0.0, 5, 4, n=2, prompt_token_ids=prompt(1, 5))])
    reqs = [Request(0, 0.0, 9, 4, prompt_token_ids=prompt(1, 9)),
            Request(1, 0.0, 5, 1, prompt_token_ids=prompt(2, 5))]   # ends on the prefill engine
    with pytest.raises(RunSetupError, match=r"^decode engine: a KV cache of 2 blocks \(8 tokens\) cannot "
                       r"hold any request: the smallest needs 12 tokens .*--decode-kv-blocks$"):
        serve(checkpoint, [r.fresh_copy() for r in reqs], decode_blocks=2)
    with pytest.raises(RunSetupError, match=r"^prefill engine: .* the smallest needs 5 tokens"):
        serve(checkpoint, [r.fresh_copy() for r in reqs], prefill_blocks=1)


# --------------------------------------------------------------------------- the command line


def test_cli_writes_handoffs_and_the_disaggregation_summary(tmp_path, fixed_times):
    from servelab.reports.runio import read_json, read_requests

    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_CSV)
    out = tmp_path / "run"
    assert run_cli("--model", "tiny-llama", "--trace", str(trace), "--out", str(out),
                   "--block-size", "4", "--kv-blocks", "12", "--decode-kv-blocks", "8",
                   "--prefill-replicas", "1", "--decode-replicas", "1") == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "summary.json", "requests.csv",
                                               "steps.csv", "outputs.jsonl", "handoffs.csv",
                                               "disaggregation.json"}
    records = read_requests(out / "requests.csv")
    assert [r.request_id for r in records] == list(range(6))
    assert [r.output_tokens for r in records] == [8, 10, 6, 12, 4, 9]
    lines = (out / "handoffs.csv").read_text().splitlines()
    header = lines[0].split(",")
    assert header[:5] == ["request_id", "prefill_replica", "prompt_tokens", "kv_bytes", "held_blocks"]
    rows = [dict(zip(header, line.split(","))) for line in lines[1:]]
    assert [int(r["request_id"]) for r in rows] == list(range(6))
    assert all(int(r["kv_bytes"]) > 0 and float(r["transfer_end_s"]) > float(r["transfer_start_s"])
               for r in rows)
    report = read_json(out / "disaggregation.json")
    assert report["transfers"]["count"] == 6 and report["layout"]["decode"]["kv_blocks"] == 8
    config = read_json(out / "config.json")
    assert config["config"]["disaggregation"]["decode_kv_blocks"] == 8
    assert config["derived"]["disaggregation"]["prefill"]["kv_blocks"] == 12


@pytest.mark.parametrize("flags, message", [
    (["--prefill-replicas", "2", "--decode-replicas", "1"], "one prefill engine and one decode engine"),
    (["--prefill-replicas", "1"], "needs both --prefill-replicas and --decode-replicas"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-link", "nvlink"], "drop --kv-link"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer", "layerwise"],
     "once the prefill has ended"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-tp", "2"], "without tensor parallelism"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-gpu", "h100-sxm"], "on --device"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--speculative", "ngram"],
     "does not run with speculative decoding"),
])
def test_cli_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys, flags, message):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_CSV)
    out = tmp_path / "run"
    assert run_cli("--model", "tiny-llama", "--trace", str(trace), "--out", str(out), *flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("servelab run: error: ") and "\n" not in err and message in err, err
    assert not out.exists()
