"""Speculative decoding on the real backend (`servelab.backends.speculative`).

The target is the catalog's tiny-llama with seeded random weights. Drafts share its
vocabulary and are built from configs, so their seeded weights follow from their shapes:

- ``small``: half the width, one layer — different weights; greedily it agrees with the
  target almost never, so nearly every proposal is rejected;
- ``perturbed``: the target's shapes and weights (same seed) with another RMSNorm epsilon,
  so it agrees with the target often but not always — partial acceptance;
- ``copy``: the target's own config, hence its weights: every proposal is accepted.

Greedy speculation must reproduce plain greedy decoding token for token, whatever the
draft; the copy's acceptance of exactly 1 proves its KV cache follows the target's block
tables through swaps, recomputes, prefix hits and chunked prefills (a stale draft block
would make it disagree). Sampled speculation is checked against the target distribution
by a chi-square test of `rejection_sample` on known p and q, which wrong acceptance rules
fail.
"""
from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
import torch
from scipy.stats import chisquare

from _backend_device import DEVICE
from servelab.backends.attention import SeqWork
from servelab.backends.model import ModelRunner
from servelab.backends.run import RealRunConfig, run_real
from servelab.backends.sampling import SamplingParams, draw, make_generator
from servelab.backends.speculative import ngram_lookup, rejection_sample, verify_greedy
from servelab.config import SchedulerConfig, SpeculativeConfig
from servelab.models import load_model_spec
from servelab.request import Request

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TARGET = "tiny-llama"
DRAFT_CHANGES = {
    "small": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1),
    "perturbed": dict(rms_norm_eps=1e-3),
    "copy": {},
}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, str]:
    """Draft name -> path of its config.json."""
    target = dict(load_model_spec(TARGET).hf_config)
    folder = tmp_path_factory.mktemp("drafts")
    paths = {}
    for name, changes in DRAFT_CHANGES.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps({**target, **changes, "_name_or_path": f"draft-{name}"}))
        paths[name] = str(path)
    return paths


def prompt(seed: int, length: int) -> tuple[int, ...]:
    return tuple(random.Random(seed).choices(range(256), k=length))


# (prompt, output) lengths; outputs of 1 and 2 tokens never speculate (the prefill draws
# the first token, and a request's last token is a plain decode).
LENGTHS = [(10, 24), (3, 17), (41, 20), (17, 1), (8, 2), (25, 12)]


def requests(seed_offset: int = 0) -> list[Request]:
    return [Request(i, 0.0, p, o, prompt_token_ids=prompt(100 + i, p), seed=seed_offset + i)
            for i, (p, o) in enumerate(LENGTHS)]


def serve(reqs, *, speculative=SpeculativeConfig(), sampling=SamplingParams(), kv_blocks=128,
          cpu_kv_blocks=0, prefix_caching=False, **scheduler):
    config = RealRunConfig(
        model=TARGET, device=DEVICE, dtype="float32",
        scheduler=SchedulerConfig(**{"max_model_len": 256, **scheduler, "speculative": speculative}),
        cache=dict(block_size=4, num_gpu_blocks=kv_blocks, num_cpu_blocks=cpu_kv_blocks,
                   enable_prefix_caching=prefix_caching),
        sampling=sampling, progress=False)
    return run_real(config, None, requests=[r.fresh_copy() for r in reqs])


def draft(path: str, k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", draft_model=path, num_speculative_tokens=k)


def acceptance(result) -> list[float]:
    """Acceptance rate of each request that proposed anything."""
    return [r["acceptance_rate"] for r in result.speculation["requests"] if r["proposed"]]


# --------------------------------------------------------------------------- greedy parity


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", list(DRAFT_CHANGES))
def test_greedy_speculation_reproduces_plain_greedy_token_for_token(drafts, name, k):
    plain = serve(requests())
    spec = serve(requests(), speculative=draft(drafts[name], k))
    assert spec.outputs == plain.outputs
    assert [len(s[0]) for s in spec.outputs.values()] == [o for _, o in LENGTHS]
    rates, total = acceptance(spec), spec.speculation["acceptance_rate"]
    assert len(rates) == 4
    if name == "copy":
        assert rates == [1.0] * 4 and total == 1.0
    elif name == "perturbed":
        assert 0.0 < total < 1.0   # both accepted and rejected proposals happen
    else:
        assert total < 0.5
    # fewer target passes than tokens when anything is accepted
    decode_steps = sum(1 for s in spec.steps if s.num_decode_tokens)
    if total > 0:
        assert decode_steps < sum(1 for s in plain.steps if s.num_decode_tokens)


@pytest.mark.parametrize("case", ["swap", "recompute", "prefix+chunks", "max-batch"])
def test_draft_kv_follows_the_block_tables_of_every_scheduling_path(drafts, case):
    """The copy draft accepts everything only if its own cache holds the right KV in every
    block the scheduler hands out: swapped out and back, recomputed, shared by a prefix
    hit, filled chunk by chunk, or by plain decodes while the batch is too large to
    speculate (the draft catches up on them later)."""
    forked = Request(6, 0.0, 6, 9, n=2, prompt_token_ids=prompt(106, 6))   # never speculates
    reqs, options, speculative = requests() + [forked], {}, draft(drafts["copy"], 3)
    if case == "swap":
        options = dict(kv_blocks=20, cpu_kv_blocks=64, preemption="swap")
    elif case == "recompute":
        options = dict(kv_blocks=20, preemption="recompute")
    elif case == "prefix+chunks":
        shared = prompt(7, 24)
        reqs = [Request(i, 0.0, 24 + 3 * i, 10, prompt_token_ids=shared + prompt(200 + i, 3 * i))
                for i in range(4)]
        options = dict(prefix_caching=True, chunked_prefill=8, max_num_batched_tokens=16,
                       max_num_seqs=2)
    else:
        speculative = dataclasses.replace(speculative, max_batch=3)
    plain = serve(reqs, **options)
    spec = serve(reqs, speculative=speculative, **options)
    assert spec.outputs == plain.outputs
    assert acceptance(spec) and set(acceptance(spec)) == {1.0}
    if case == "swap":
        assert spec.num_swap_preemptions > 0
    elif case == "recompute":
        assert spec.num_recompute_preemptions > 0
    elif case == "max-batch":   # plain decodes first, speculation once few requests are left
        counts = spec.speculation
        assert counts["decode_steps"] > counts["verify_steps"] + len(reqs)
    else:
        assert spec.block_usage.prefix_hits > 0
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in spec.steps)


def draft_greedy_counts(draft_path: str, req: Request, outputs: list[int], k: int) -> dict:
    """What a greedy run must count for `req` if every proposal is the draft's greedy
    continuation of the sequence so far: each verify step recomputed from scratch by a
    fresh draft (a prefill of the whole sequence, then plain decodes), its proposals
    checked against the target's greedy `outputs`."""
    runner = ModelRunner(load_model_spec(draft_path), device=DEVICE, dtype="float32",
                         num_gpu_blocks=64, block_size=4, use_triton=False, seed=0)
    table = list(range(64))
    tokens = list(req.prompt_token_ids) + outputs
    counts = {"verify_steps": 0, "proposed": 0, "accepted": 0}
    produced = 1   # the prefill draws the first output token
    while req.output_len - produced > 1:
        proposals = min(k, req.output_len - produced - 1)
        last = req.prompt_len + produced - 1   # position of the last sampled token
        logits = runner.run([SeqWork(tokens[:last + 1], 0, table, True)])
        proposed = [int(logits.argmax())]
        for j in range(1, proposals):
            logits = runner.run([SeqWork([proposed[-1]], last + j, table, False)])
            proposed.append(int(logits.argmax()))
        accepted = next((j for j, (a, b) in enumerate(zip(proposed, tokens[last + 1:]))
                         if a != b), proposals)
        counts["verify_steps"] += 1
        counts["proposed"] += proposals
        counts["accepted"] += accepted
        produced += accepted + 1
    return counts


@pytest.mark.parametrize("name, k", [("perturbed", 3), ("small", 2)])
def test_every_proposal_is_the_drafts_own_greedy_continuation(drafts, name, k):
    """The draft's paged KV is right after partial acceptances (rejected positions
    rewritten, a fully accepted step's last proposal caught up): each request's counts
    equal those of a draft recomputed from scratch at every step."""
    result = serve(requests(), speculative=draft(drafts[name], k))
    for req, got in zip(requests(), result.speculation["requests"]):
        expected = draft_greedy_counts(drafts[name], req, result.outputs[req.request_id][0], k)
        assert {key: got[key] for key in expected} == expected, f"request {req.request_id}"


def test_a_stop_token_among_the_verified_ones_ends_the_request_there(drafts, tmp_path):
    """Not replaying, a verify step that produces EOS keeps the tokens up to it and stops."""
    plain = serve(requests())
    output = plain.outputs[0][0]
    eos = output[9]   # its first occurrence ends request 0 early, in a verify step
    assert output.index(eos) > 1
    target = tmp_path / "target.json"   # tiny-llama's shapes, hence its weights, with that EOS
    target.write_text(json.dumps({**load_model_spec(TARGET).hf_config, "eos_token_id": eos}))
    runs = []
    for speculative in (SpeculativeConfig(), draft(drafts["copy"], 4)):
        config = RealRunConfig(
            model=str(target), device=DEVICE, dtype="float32", replay=False, progress=False,
            scheduler=SchedulerConfig(max_model_len=256, speculative=speculative),
            cache=dict(block_size=4, num_gpu_blocks=128))
        runs.append(run_real(config, None, requests=requests()))
    stopped, spec = runs
    assert spec.outputs == stopped.outputs
    assert spec.outputs[0][0] == output[:output.index(eos) + 1]
    assert spec.speculation["requests"][0]["accepted"] > 0


def test_verify_greedy_keeps_proposals_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0], [1.0, 1.0, 0.0]])
    assert verify_greedy(logits, [1, 0, 2]) == [1, 0, 2, 0]   # all accepted, then one more
    assert verify_greedy(logits, [1, 2, 2]) == [1, 0]         # second rejected: the argmax
    assert verify_greedy(logits[:1], []) == [1]               # no proposal: plain greedy


# --------------------------------------------------------------------------- the distribution


P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                  [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
                  [0.50, 0.10, 0.10, 0.10, 0.10, 0.10]], dtype=torch.float64)
"""Target distributions at [last, d1, d2]; token 5 is impossible at the first position."""
Q = torch.tensor([[0.10, 0.10, 0.10, 0.20, 0.30, 0.20],
                  [0.40, 0.20, 0.20, 0.10, 0.05, 0.05]], dtype=torch.float64)
"""Draft distributions d1 and d2 are drawn from."""
TRIALS = 8000


def always_accept(p, q, proposed, generator):
    return list(proposed) + [int(draw(p[-1:], [generator])[0])]


def resample_from_target(p, q, proposed, generator):
    """The classic mistake: on rejection draw from p instead of norm(max(0, p - q))."""
    for j, token in enumerate(proposed):
        if float(torch.rand(1, generator=generator, dtype=torch.float64)) * q[j, token] >= p[j, token]:
            return list(proposed[:j]) + [int(draw(p[j:j + 1], [generator])[0])]
    return list(proposed) + [int(draw(p[-1:], [generator])[0])]


def produced_token_pvalues(verify) -> list[float]:
    """Chi-square p-values of the first and second produced tokens against P[0] and P[1]
    (the second exists when the first proposal was accepted; P's rows do not depend on the
    context, so it is distributed as P[1])."""
    generator = make_generator(2024)
    counts = torch.zeros(2, P.shape[1])
    for _ in range(TRIALS):
        proposed = draw(Q, [generator, generator]).tolist()
        for position, token in enumerate(verify(P, Q, proposed, generator)[:2]):
            counts[position, token] += 1
    pvalues = []
    for position in range(2):
        possible = P[position] > 0
        if counts[position][~possible].sum():
            return [0.0, 0.0]   # an impossible token was produced
        observed = counts[position][possible]
        expected = P[position][possible] * observed.sum() / P[position][possible].sum()
        pvalues.append(float(chisquare(observed.numpy(), expected.numpy()).pvalue))
    return pvalues


def test_rejection_sampling_keeps_the_target_distribution():
    assert min(produced_token_pvalues(rejection_sample)) > 1e-3


@pytest.mark.parametrize("wrong_rule", [always_accept, resample_from_target])
def test_the_distribution_check_catches_a_wrong_acceptance_rule(wrong_rule):
    assert min(produced_token_pvalues(wrong_rule)) < 1e-6


def test_rejection_sampling_with_a_deterministic_proposal_never_repeats_a_rejected_token():
    """q one-hot (n-gram): accepted with probability p(x); a rejection draws from p
    without x."""
    generator = make_generator(5)
    firsts = [rejection_sample(P[:2], None, [4], generator)[0] for _ in range(3000)]
    share = firsts.count(4) / len(firsts)
    assert abs(share - 0.10) < 0.02
    assert 5 not in firsts


def test_sampled_speculation_is_seeded_per_request_and_independent_of_batch_mates(drafts):
    """A request's draws come from its own stream in a fixed order per verify step, so its
    tokens depend on its seed and on its own steps' sizes, not on who shares the batch.
    (Preemption or a tight token budget change those sizes, and with them which draws
    make which token: the distribution stays the target's, the tokens do not.)"""
    hot = SamplingParams(temperature=1.5, top_k=50)
    spec = draft(drafts["perturbed"], 3)
    alone = [Request(0, 0.0, 9, 20, prompt_token_ids=prompt(400, 9), seed=11)]
    crowd = alone + [Request(i, 0.0, 5 + 4 * i, 15, prompt_token_ids=prompt(400 + i, 5 + 4 * i),
                             seed=i) for i in range(1, 5)]
    a = serve(alone, speculative=spec, sampling=hot)
    b = serve(crowd, speculative=spec, sampling=hot)
    assert a.outputs[0] == b.outputs[0]
    assert a.speculation["requests"][0] == b.speculation["requests"][0]
    assert 0 < a.speculation["requests"][0]["accepted"]
    reseeded = [Request(0, 0.0, 9, 20, prompt_token_ids=prompt(400, 9), seed=12)]
    assert serve(reseeded, speculative=spec, sampling=hot).outputs[0] != a.outputs[0]


# --------------------------------------------------------------------------- n-gram


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_match():
    assert ngram_lookup([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert ngram_lookup([5, 1, 9, 1, 7, 1], 2) == [7, 1]       # latest match of [1]
    assert ngram_lookup([5, 1, 9, 8, 1, 9], 4) == [8, 1, 9]   # longest suffix first
    assert ngram_lookup([1, 2, 3], 2) == []
    assert ngram_lookup([4], 2) == []


def test_ngram_speculation_reproduces_plain_greedy_and_accepts_repeats():
    plain = serve(requests())
    spec = serve(requests(), speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert spec.outputs == plain.outputs
    assert spec.speculation["accepted_tokens"] > 0   # random models repeat themselves


# --------------------------------------------------------------------------- the run directory


TRACE_CSV = ("arrival_s,prompt_tokens,output_tokens\n"
             "0.0,12,8\n0.01,7,10\n0.02,20,6\n0.5,9,1\n")


def run_cli(*args: str) -> int:
    from servelab.cli import main

    return main(["run", "--device", "cpu", "--model", TARGET, "--block-size", "4",
                 "--kv-blocks", "32", *args])


def test_run_directory_records_acceptance_per_request(tmp_path, drafts):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_CSV)
    out = tmp_path / "run"
    assert run_cli("--trace", str(trace), "--out", str(out), "--speculative",
                   f"draft:{drafts['copy']}", "--num-speculative-tokens", "3") == 0
    assert "speculation.json" in {p.name for p in out.iterdir()}
    spec = json.loads((out / "speculation.json").read_text())
    per_request = spec["requests"]
    assert [r["request_id"] for r in per_request] == [0, 1, 2, 3]
    assert spec["proposed_tokens"] == sum(r["proposed"] for r in per_request) > 0
    assert spec["accepted_tokens"] == sum(r["accepted"] for r in per_request)
    assert spec["verify_steps"] == sum(r["verify_steps"] for r in per_request)
    assert spec["decode_steps"] == sum(r["decode_steps"] for r in per_request)
    assert spec["acceptance_rate"] == 1.0
    # one output token: no decode step at all
    assert per_request[3] == {"request_id": 3, "decode_steps": 0, "verify_steps": 0,
                              "proposed": 0, "accepted": 0, "acceptance_rate": None}
    # 8 output tokens, K = 3, all accepted: the prefill's token, then 4 + 3 in two verify steps
    assert per_request[0] == {"request_id": 0, "decode_steps": 2, "verify_steps": 2,
                              "proposed": 5, "accepted": 5, "acceptance_rate": 1.0}
    # K = 3 and everything accepted: 4 tokens per verify step but near a request's end
    assert 1 < spec["tokens_per_verify_step"] <= 4 and spec["tokens_per_decode_step"] > 1
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["scheduler"]["speculative"]["method"] == "draft"
    assert config["derived"]["speculative"]["draft"]["weights"] == "seeded random (seed 0)"
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    plain = tmp_path / "plain"
    assert run_cli("--trace", str(trace), "--out", str(plain)) == 0
    assert not (plain / "speculation.json").exists()
    assert [json.loads(line) for line in (plain / "outputs.jsonl").read_text().splitlines()] \
        == outputs


@pytest.mark.parametrize("case, message", [
    ("vocab", r"vocabulary of 512 tokens, the target tiny-llama 256"),
    ("larger", r"is larger than the target tiny-llama"),
    ("eagle", r"--speculative eagle: the real backend runs draft:MODEL and ngram"),
    ("k0", r"--num-speculative-tokens: expected an integer >= 1"),
])
def test_bad_speculative_input_is_refused_in_one_line_before_the_run(tmp_path, capsys, drafts,
                                                                     case, message):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_CSV)
    base = dict(load_model_spec(TARGET).hf_config)
    bad = tmp_path / "draft.json"
    args = ["--speculative", f"draft:{bad}"]
    if case == "vocab":
        bad.write_text(json.dumps({**base, "vocab_size": 512}))
    elif case == "larger":
        bad.write_text(json.dumps({**base, "num_hidden_layers": 3}))
    elif case == "eagle":
        args = ["--speculative", "eagle"]
    else:
        args = ["--speculative", f"draft:{drafts['small']}", "--num-speculative-tokens", "0"]
    out = tmp_path / "run"
    try:
        status = run_cli("--trace", str(trace), "--out", str(out), *args)
    except SystemExit as exc:   # argparse refuses K < 1 itself
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err
    assert not out.exists()


@pytest.mark.kernels
def test_verify_steps_on_the_triton_kernels_match_the_reference_path(drafts):
    """A verify step is a chunk with context on the prefill kernel; the draft's catch-up
    and proposals run the same kernels on its own cache."""
    reqs = [Request(0, 0.0, 9, 7, prompt_token_ids=prompt(30, 9)),
            Request(1, 0.0, 5, 6, prompt_token_ids=prompt(31, 5))]
    runs = []
    for use_triton in (True, False):
        config = RealRunConfig(
            model=TARGET, device=DEVICE, dtype="float32", use_triton=use_triton, progress=False,
            scheduler=SchedulerConfig(max_model_len=64, speculative=draft(drafts["perturbed"], 3)),
            cache=dict(block_size=4, num_gpu_blocks=12))
        runs.append(run_real(config, None, requests=[r.fresh_copy() for r in reqs]))
    triton_run, reference_run = runs
    assert triton_run.config["derived"]["triton_interpret"] == (DEVICE == "cpu")
    assert triton_run.outputs == reference_run.outputs
    assert triton_run.speculation == reference_run.speculation
    assert 0 < triton_run.speculation["accepted_tokens"] < triton_run.speculation["proposed_tokens"]
