"""The real engine end to end: the shared scheduler driving the model runner must produce,
token for token, what Hugging Face transformers' own `generate()` produces.

A tiny random Llama (2 layers, hidden 64, 4 heads over 2 KV heads) is built by
transformers from a seed, saved with save_pretrained and loaded by the runner. Greedy
decoding is batch-independent in exact arithmetic, so every scheduling path — policies,
preemption by recompute and by swap, chunked prefill, prefix-cache hits, copy-on-write
forks of parallel samples — must give each request exactly HF's greedy continuation of its
prompt. fp32 on both sides; the logits agree to ~1e-6, and the fixture checks that every
greedy choice along HF's path wins by a margin far larger than that, so the comparison of
token ids is exact rather than lucky.

Runtime: torch is held to one thread here (two cores shared by many processes make
intra-op threads spin), which makes a tiny step ~3 ms.
"""
from __future__ import annotations

import json
import random
from importlib import metadata

import pytest
import torch

from _backend_device import DEVICE
from servelab.backends.run import RealRunConfig, run_real
from servelab.backends.sampling import SamplingParams
from servelab.config import SchedulerConfig
from servelab.request import Request

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
MAX_NEW = 16
MIN_MARGIN = 1e-3
"""Smallest top-1 minus top-2 logit gap allowed along HF's greedy paths (logits agree to ~1e-6)."""


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, HF model): a seeded tiny Llama with perturbed norms, saved as safetensors."""
    import transformers

    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name == "lm_head.weight":
                param.mul_(20.0)  # spread the logits: wide greedy margins
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, hf


@pytest.fixture(scope="module")
def reference(checkpoint):
    """prompt -> HF's greedy continuation of MAX_NEW tokens, computed once per prompt."""
    _, hf = checkpoint
    cache: dict[tuple[int, ...], list[int]] = {}

    def get(prompt) -> list[int]:
        prompt = tuple(prompt)
        if prompt not in cache:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                  eos_token_id=None, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True)
            for step in out.logits:
                top2 = step[0].float().topk(2).values
                assert top2[0] - top2[1] > MIN_MARGIN, "near-tie on HF's greedy path: change seed"
            cache[prompt] = out.sequences[0, len(prompt):].tolist()
        return cache[prompt]

    return get


def prompt(seed: int, length: int) -> tuple[int, ...]:
    return tuple(random.Random(seed).choices(range(TINY["vocab_size"]), k=length))


# Six requests, all arriving at once (so scheduling does not depend on measured step times).
LENGTHS = [(5, 12), (13, 8), (9, 12), (7, 10), (11, 9), (6, 12)]


def mixed_requests() -> list[Request]:
    return [Request(i, 0.0, p, o, priority=(2, 0, 1, 0, 2, 1)[i], tenant="ab"[i % 2],
                    prompt_token_ids=prompt(100 + i, p))
            for i, (p, o) in enumerate(LENGTHS)]


def serve(checkpoint, requests, *, kv_blocks=64, cpu_kv_blocks=0, policy="fcfs",
          policy_options=None, prefix_caching=False, sampling=SamplingParams(), replay=True,
          seed=0, **scheduler):
    folder, _ = checkpoint
    config = RealRunConfig(
        model=None, checkpoint=str(folder), device=DEVICE, dtype="float32",
        scheduler=SchedulerConfig(**{"max_model_len": 256, **scheduler}),
        cache=dict(block_size=4, num_gpu_blocks=kv_blocks, num_cpu_blocks=cpu_kv_blocks,
                   enable_prefix_caching=prefix_caching),
        policy=policy, policy_options=policy_options or {}, sampling=sampling, replay=replay,
        seed=seed, progress=False)
    return run_real(config, None, requests=requests)


def assert_matches_hf(result, requests, reference):
    assert all(r.status == "finished" for r in result.records)
    for req in requests:
        expected = reference(req.prompt_token_ids)[:req.output_len]
        samples = result.outputs[req.request_id]
        assert len(samples) == req.n
        for i, got in enumerate(samples):
            assert got == expected, f"request {req.request_id} sample {i}"


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("policy, options", [
    ("fcfs", {}), ("priority", {"aging_rate": 0.5}), ("sjf", {}),
    ("fair", {"weights": {"a": 2.0, "b": 1.0}})])
def test_every_policy_under_preemption_matches_hf_generate(checkpoint, reference, policy,
                                                           options, preemption):
    requests = mixed_requests()
    result = serve(checkpoint, requests, kv_blocks=10, cpu_kv_blocks=16, policy=policy,
                   policy_options=options, preemption=preemption)
    assert_matches_hf(result, requests, reference)
    assert result.summary["num_preemptions"] > 0
    if preemption == "swap":
        assert result.num_swap_preemptions > 0 and result.num_swapped_blocks > 0
    else:
        assert result.num_recompute_preemptions > 0 and result.num_swapped_blocks == 0


def test_chunked_prefill_matches_hf_generate(checkpoint, reference):
    requests = mixed_requests()
    result = serve(checkpoint, requests, chunked_prefill=3, max_num_batched_tokens=8)
    assert_matches_hf(result, requests, reference)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 8 for s in result.steps)
    assert sum(s.num_prefill_seqs for s in result.steps) > len(requests)  # prompts were split
    assert any(s.num_prefill_seqs and s.num_decode_tokens for s in result.steps)  # mixed steps


def test_prefix_cache_hits_match_hf_generate(checkpoint, reference):
    shared = prompt(7, 10)  # two full blocks of 4 shared, then a partial one
    requests = [Request(i, 0.0 if i == 0 else 1.0, 10 + t, 8,
                        prompt_token_ids=shared + prompt(200 + i, t))
                for i, t in enumerate((3, 5, 2, 6))]
    result = serve(checkpoint, requests, prefix_caching=True)
    assert_matches_hf(result, requests, reference)
    assert result.block_usage.prefix_hits >= 2 * (len(requests) - 1)
    # a hit skips computing the cached tokens: less prefill than the prompts hold
    assert sum(s.num_prefill_tokens for s in result.steps) < sum(r.prompt_len for r in requests)


def test_trace_prefix_hashes_become_shared_synthetic_prompts(checkpoint, reference):
    from servelab.backends.executor import with_prompt_tokens

    hashes = [(11, 22), (11, 22), (11, 33), (44,)]  # 6-token blocks, as a trace gives them
    requests = [Request(i, 0.0 if i == 0 else 1.0, 12, 6, prefix_hashes=h, prefix_block_size=6)
                for i, h in enumerate(hashes)]
    prompts = [with_prompt_tokens(r, TINY["vocab_size"], seed=0).prompt_token_ids
               for r in requests]
    assert prompts[0] == prompts[1] and prompts[0][:6] == prompts[2][:6]
    assert prompts[0][6:] != prompts[2][6:] and prompts[3][:6] != prompts[0][:6]
    result = serve(checkpoint, requests, prefix_caching=True)
    assert result.block_usage.prefix_hits >= 2 + 1  # request 1: two full blocks; request 2: one
    for req, p in zip(requests, prompts):
        assert result.outputs[req.request_id] == [reference(p)[:6]]


@pytest.mark.parametrize("kv_blocks, preemption", [(64, "recompute"), (12, "recompute"),
                                                   (12, "swap")])
def test_parallel_sampling_forks_match_hf_generate(checkpoint, reference, kv_blocks, preemption):
    requests = [Request(0, 0.0, 7, 10, n=3, prompt_token_ids=prompt(300, 7)),
                Request(1, 0.0, 9, 8, n=2, prompt_token_ids=prompt(301, 9)),
                Request(2, 0.0, 6, 12, prompt_token_ids=prompt(302, 6))]
    result = serve(checkpoint, requests, kv_blocks=kv_blocks, cpu_kv_blocks=24,
                   preemption=preemption)
    assert_matches_hf(result, requests, reference)
    assert result.num_copied_blocks > 0  # the forks' shared partial blocks were copied on write
    if kv_blocks < 64:
        assert result.summary["num_preemptions"] > 0


# --------------------------------------------------------------------------- sampling, EOS


def test_random_sampling_is_seeded_per_sample_and_independent_of_batch_mates(checkpoint):
    hot = SamplingParams(temperature=1.5, top_k=50)
    alone = [Request(0, 0.0, 7, 12, n=3, prompt_token_ids=prompt(400, 7), seed=11)]
    crowd = alone + [Request(i, 0.0, 5 + i, 9, prompt_token_ids=prompt(400 + i, 5 + i), seed=i)
                     for i in range(1, 4)]
    a = serve(checkpoint, [r.fresh_copy() for r in alone], sampling=hot)
    b = serve(checkpoint, [r.fresh_copy() for r in crowd], sampling=hot, kv_blocks=14,
              preemption="swap", cpu_kv_blocks=24)
    assert a.outputs[0] == b.outputs[0]
    assert len({tuple(s) for s in a.outputs[0]}) > 1  # the samples draw their own streams
    reseeded = [Request(0, 0.0, 7, 12, n=3, prompt_token_ids=prompt(400, 7), seed=12)]
    assert serve(checkpoint, reseeded, sampling=hot).outputs[0] != a.outputs[0]


def test_eos_stops_a_sample_unless_replaying(checkpoint, reference, tmp_path):
    import shutil

    folder, hf = checkpoint
    p = prompt(500, 8)
    greedy = reference(p)
    k = 4
    eos = greedy[k]
    stop_at = greedy.index(eos)  # first time the greedy path draws it
    eos_folder = shutil.copytree(folder, tmp_path / "eos")
    config = json.loads((eos_folder / "config.json").read_text())
    config["eos_token_id"] = eos
    (eos_folder / "config.json").write_text(json.dumps(config))
    for replay, expected in ((False, greedy[:stop_at + 1]), (True, greedy[:12])):
        result = serve((eos_folder, hf), [Request(0, 0.0, 8, 12, prompt_token_ids=p)],
                       replay=replay)
        assert result.outputs[0] == [expected]
        assert result.records[0].output_tokens == len(expected)


# --------------------------------------------------------------------------- clocks


def test_virtual_clock_advances_by_measured_steps_and_jumps_idle_gaps(checkpoint):
    requests = [Request(0, 0.0, 5, 3, prompt_token_ids=prompt(600, 5)),
                Request(1, 5.0, 6, 3, prompt_token_ids=prompt(601, 6))]
    result = serve(checkpoint, requests)
    first, second = result.records
    assert second.scheduled_s == 5.0  # the idle gap is skipped, not slept
    assert first.finish_s < 5.0
    steps = result.steps
    assert steps[0].start_s == 0.0
    for a, b in zip(steps, steps[1:]):
        assert b.start_s == (5.0 if b.start_s == 5.0 else a.start_s + a.duration_s)
    assert second.finish_s == steps[-1].start_s + steps[-1].duration_s


def test_wall_clock_releases_arrivals_in_real_time(checkpoint):
    folder, _ = checkpoint
    requests = [Request(0, 0.0, 5, 3, prompt_token_ids=prompt(600, 5)),
                Request(1, 0.3, 6, 3, prompt_token_ids=prompt(601, 6))]
    config = RealRunConfig(model=None, checkpoint=str(folder), device=DEVICE, clock="wall",
                           cache=dict(block_size=4, num_gpu_blocks=16), progress=False)
    first, second = run_real(config, None, requests=requests).records
    assert 0.0 <= first.scheduled_s < 0.3
    assert 0.3 <= second.scheduled_s < 0.3 + 1.0
    assert second.first_token_s > second.scheduled_s


# --------------------------------------------------------------------------- the command line

TRACE_CSV = ("arrival_s,prompt_tokens,output_tokens,tenant,priority\n"
             "0.0,12,8,a,0\n0.01,7,10,b,1\n0.02,20,6,a,0\n0.5,9,12,b,2\n0.6,5,4,a,1\n"
             "0.7,15,9,b,0\n")


def run_cli(*args: str) -> int:
    from servelab.cli import main

    return main(["run", "--device", "cpu", *args])


def test_cli_writes_a_complete_run_directory(tmp_path, capsys):
    from servelab.reports import SUMMARY_KEYS
    from servelab.reports.runio import read_json, read_requests, read_steps

    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_CSV)
    out = tmp_path / "run"
    assert run_cli("--model", "tiny-llama", "--trace", str(trace), "--out", str(out),
                   "--block-size", "4", "--kv-blocks", "12", "--policy", "fair",
                   "--tenant-weights", "a=2,b=1", "--seed", "5", "--no-prefix-caching") == 0
    # the default engine is vLLM's, whose CPU backend schedules synchronously, as this does
    assert "schedules asynchronously" not in capsys.readouterr().err
    assert {p.name for p in out.iterdir()} == {"config.json", "summary.json", "requests.csv",
                                               "steps.csv", "outputs.jsonl"}
    summary = read_json(out / "summary.json")
    assert tuple(summary) == SUMMARY_KEYS
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 49
    records = read_requests(out / "requests.csv")
    assert [r.request_id for r in records] == list(range(6))
    assert [r.output_tokens for r in records] == [8, 10, 6, 12, 4, 9]
    steps = read_steps(out / "steps.csv")
    assert steps and all(s.duration_s > 0 and s.kv_blocks_total == 12 for s in steps)
    assert all(b.start_s >= a.start_s + a.duration_s for a, b in zip(steps, steps[1:]))
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert [len(line["samples"][0]) for line in lines] == [8, 10, 6, 12, 4, 9]
    assert all(0 <= t < 256 for line in lines for t in line["samples"][0])
    config = read_json(out / "config.json")
    assert config["format"] == "servelab.real/1"
    given, derived = config["config"], config["derived"]
    assert (given["model"], given["device"], given["seed"]) == ("tiny-llama", "cpu", 5)
    assert given["cli_args"]["tenant_weights"] == {"a": 2.0, "b": 1.0}
    assert given["cli_args"]["policy"] == "fair" and "given_flags" not in given["cli_args"]
    assert derived["policy"] == {"name": "fair", "weights": {"a": 2.0, "b": 1.0},
                                 "input_weight": 1.0, "output_weight": 2.0}
    assert derived["cache"]["num_gpu_blocks"] == 12 and derived["kv_blocks"] == "given"
    assert derived["versions"]["torch"] == metadata.version("torch")  # 2.11.0, not +cu130
    assert (derived["device"], derived["dtype"], derived["use_triton"]) == ("cpu", "float32", False)
    assert derived["trace"]["num_requests"] == 6 and given["clock"] == "virtual"


def write_config_only_checkpoint(folder, **overrides):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], **TINY, **overrides}))
    return folder


@pytest.mark.parametrize("case, message", [
    ("gpt2", "unsupported architecture 'GPT2LMHeadModel'"),
    ("shape", r"self_attn\.k_proj\.weight has shape \(16, 64\), the model expects \(32, 64\)"),
    ("cuda", "CUDA is not available"),
    ("cuda:7", "CUDA is not available"),
    ("tpu", "device 'tpu'"),
])
def test_cli_bad_input_exits_2_before_writing_anything(checkpoint, tmp_path, capsys, monkeypatch,
                                                        case, message):
    from safetensors.torch import load_file, save_file

    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_CSV)
    args = ["--model", "tiny-llama"]
    if case == "gpt2":
        folder = write_config_only_checkpoint(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
        args = ["--checkpoint", str(folder)]
    elif case == "shape":
        folder = tmp_path / "shape"
        folder.mkdir()
        (folder / "config.json").write_text((checkpoint[0] / "config.json").read_text())
        tensors = load_file(checkpoint[0] / "model.safetensors")
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
        save_file(tensors, folder / "model.safetensors")
        args = ["--checkpoint", str(folder)]
    else:
        args += ["--device", case]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine too
    out = tmp_path / "run"
    assert run_cli(*args, "--trace", str(trace), "--out", str(out), "--kv-blocks", "8") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("servelab run: error: ") and "\n" not in err
    assert __import__("re").search(message, err), err
    assert not out.exists()


def test_cli_names_the_gpus_there_are_when_asked_for_one_past_them(tmp_path, capsys,
                                                                    monkeypatch):
    """Found on the H200: `--device cuda:7` on a one-GPU machine ended in torch's bare
    AssertionError ("Invalid device id") from the memory query behind the engine defaults."""
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_CSV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = tmp_path / "run"
    assert run_cli("--model", "tiny-llama", "--device", "cuda:7", "--trace", str(trace),
                   "--out", str(out)) == 2
    assert capsys.readouterr().err.strip() == (
        "servelab run: error: device 'cuda:7' does not exist: this machine has 1 CUDA "
        "device(s), cuda:0..cuda:0")
    assert not out.exists()


def test_cli_without_the_backend_extra_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    """A machine with the simulator alone (scripts/main.sh installs no torch): one line
    naming the missing packages and the install command, not a ModuleNotFoundError."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "triton") else
                        real_find_spec(name, *a))
    out = tmp_path / "run"
    assert run_cli("--model", "tiny-llama", "--out", str(out)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "(torch, triton missing)" in err
    assert "pip install 'servelab[backend]'" in err
    assert not out.exists()


def test_cli_refuses_an_out_holding_another_run_unless_forced(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_CSV)
    out = tmp_path / "run"
    common = ["--model", "tiny-llama", "--trace", str(trace), "--out", str(out), "--kv-blocks", "12"]
    assert run_cli(*common) == 0
    assert run_cli(*common) == 0                               # the same run again
    capsys.readouterr()
    before = (out / "config.json").read_text()
    assert run_cli(*common, "--policy", "sjf") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--out {out} holds another run" in err and "--force" in err
    assert (out / "config.json").read_text() == before
    assert run_cli(*common, "--policy", "sjf", "--force") == 0
    assert json.loads((out / "config.json").read_text())["config"]["policy"] == "sjf"


def test_a_run_where_no_request_finishes_says_why_in_one_line(tmp_path, capsys):
    """It printed a traceback formatting the summary's null latencies."""
    out = tmp_path / "run"
    assert run_cli("--model", "tiny-llama", "--trace", "default", "--num-requests", "3",
                   "--max-model-len", "100", "--out", str(out)) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("servelab run: error: no request finished: 3 rejected (3 x prompt of ")
    assert err.endswith(f"exceeds max_model_len 100 (and alike)); the run is in {out}")
    assert (out / "summary.json").exists()


def test_the_real_backend_refuses_an_acceptance_rate_it_would_not_use(tmp_path, capsys):
    assert run_cli("--model", "tiny-llama", "--speculative", "ngram", "--acceptance-rate", "0.3",
                   "--out", str(tmp_path / "run")) == 2
    assert "--acceptance-rate is the simulator's: the real backend measures" in \
        capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_gpu_memory_utilization_on_the_cpu_is_noted_as_unused(tmp_path, capsys):
    assert run_cli("--model", "tiny-llama", "--trace", "default", "--num-requests", "2",
                   "--gpu-memory-utilization", "0.5", "--out", str(tmp_path / "run")) == 0
    assert ("servelab run: note: --gpu-memory-utilization sizes the KV cache on a GPU; on the "
            "CPU it holds at most 256 MiB") in capsys.readouterr().err


def test_run_help_offers_no_simulated_pool_flags(capsys):
    """`servelab run` has no --tp or --gpu for the pool flags to default to: the pool TP,
    GPU, link and transfer flags (refused there) are not in its help."""
    from servelab.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    assert "--prefill-replicas" in text
    assert not any(f in text for f in ("--prefill-tp", "--decode-gpu", "--kv-link", "(default --tp)"))
    # nor the proposers, the acceptance rate or pool sizes it refuses
    assert "--speculative draft:MODEL|ngram|off" in text and "eagle|mtp" not in text
    assert "--acceptance-rate" not in text and "prefill replicas: 1 (one engine each)" in text
