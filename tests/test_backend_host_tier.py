"""The CPU tier of the prefix cache on the real backend: evicted prefix blocks are copied
to host tensors, hits there are copied back, and greedy outputs stay Hugging Face's.

The GPU cache is made so small (8 blocks of 4 tokens) that one long request evicts every
block an earlier one left cached; a later request sharing the earlier prompt's prefix then
finds it only in the CPU tier. The requests arrive 100 s apart on the virtual clock, so
each runs alone and the evictions do not depend on measured step times.

Three checks, from the outside in: every request's tokens equal HF `generate()` (a load of
the wrong block, or none, changes the KV the prefill attends to); each step's copies move
exactly the bytes they name (a host block after an offload holds what the GPU block held
when the step began, a GPU block after a load holds its host block); and the run's
records say where the hits came from.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from _backend_device import DEVICE
from servelab.backends.executor import RealExecutor
from servelab.backends.kv_cache import KVCache
from servelab.backends.run import RealRunConfig, run_real
from servelab.config import SchedulerConfig
from servelab.models import load_model_spec
from servelab.request import Request
from test_backend_e2e import (TINY, assert_matches_hf, checkpoint, prompt,  # noqa: F401
                              reference)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

BLOCK_SIZE, GPU_BLOCKS, HOST_BLOCKS = 4, 8, 16
SHARED = prompt(7, 8)  # two full blocks
LONG = prompt(23, 28)   # seven full blocks; with its outputs, every GPU block


def tier_requests() -> list[Request]:
    """SHARED cached on the GPU (request 0), evicted by LONG (1), hit in the CPU tier (2);
    then LONG, its last blocks evicted by request 2, hit in both tiers (3).

    Request 2 finds one free GPU block, so its second loaded block is one it evicts in
    the same step: that step's offload must read the block before the load writes it."""
    prompts = [SHARED + prompt(30, 3), LONG, SHARED + prompt(31, 5), LONG + prompt(32, 2)]
    outputs = [6, 4, 6, 2]
    return [Request(i, 100.0 * i, len(p), o, prompt_token_ids=p)
            for i, (p, o) in enumerate(zip(prompts, outputs))]


def gib_for(num_blocks: int) -> float:
    """--kv-offload-gb holding exactly num_blocks of the tiny model's fp32 blocks."""
    spec = load_model_spec("tiny-llama")
    return num_blocks * spec.kv_bytes_per_token(4) * BLOCK_SIZE / 2**30


def serve(checkpoint, requests, *, kv_offload_gb=gib_for(HOST_BLOCKS)):  # noqa: F811
    folder, _ = checkpoint
    config = RealRunConfig(
        model=None, checkpoint=str(folder), device=DEVICE, dtype="float32",
        scheduler=SchedulerConfig(max_model_len=64),
        cache=dict(block_size=BLOCK_SIZE, num_gpu_blocks=GPU_BLOCKS, watermark=0.0,
                   enable_prefix_caching=True),
        kv_offload_gb=kv_offload_gb, progress=False)
    return run_real(config, None, requests=requests)


class CopyAudit:
    """Wraps `RealExecutor.execute` to check each step's tier copies on the cache tensors:
    a host block after an offload equals its GPU block as the step began, and a GPU block
    after the step equals the host block it was loaded from (nothing overwrites either
    within the step: loaded blocks are full cached blocks, and a host block loaded from is
    not reused until the copies are taken)."""

    def __init__(self, monkeypatch) -> None:
        self.offloaded = self.loaded = 0
        execute = RealExecutor.execute
        audit = self

        def audited(executor, out):
            cache: KVCache = executor.runner.kv_cache
            before = {gb: (cache.k[:, gb].to("cpu", copy=True), cache.v[:, gb].to("cpu", copy=True))
                      for gb, _ in out.offload}
            result = execute(executor, out)
            for gb, hb in out.offload:
                assert torch.equal(cache.host_k[:, hb], before[gb][0]), f"offload {gb}->{hb}: K"
                assert torch.equal(cache.host_v[:, hb], before[gb][1]), f"offload {gb}->{hb}: V"
            for hb, gb in out.load:
                assert torch.equal(cache.k[:, gb].cpu(), cache.host_k[:, hb]), \
                    f"load {hb}->{gb}: K"
                assert torch.equal(cache.v[:, gb].cpu(), cache.host_v[:, hb]), \
                    f"load {hb}->{gb}: V"
            audit.offloaded += len(out.offload)
            audit.loaded += len(out.load)
            return result

        monkeypatch.setattr(RealExecutor, "execute", audited)


# --------------------------------------------------------------------------- the run


def test_cpu_tier_hits_match_hf_generate_and_copy_the_right_blocks(checkpoint, reference,
                                                                    monkeypatch):
    audit = CopyAudit(monkeypatch)
    requests = tier_requests()
    result = serve(checkpoint, requests)
    assert_matches_hf(result, requests, reference)
    assert audit.offloaded > 0 and audit.loaded > 0   # the audit saw real traffic
    assert (result.num_offloaded_blocks, result.num_loaded_blocks) == (audit.offloaded,
                                                                       audit.loaded)
    usage = result.block_usage
    assert usage.num_host_total_blocks == HOST_BLOCKS
    assert (usage.host_offloaded_blocks, usage.host_loaded_blocks) == (audit.offloaded,
                                                                       audit.loaded)
    cached = {r.request_id: (r.cached_tokens, r.cpu_cached_tokens) for r in result.records}
    assert cached[0] == (0, 0) and cached[1] == (0, 0)
    assert cached[2] == (8, 8)                       # SHARED, found only in the CPU tier
    assert cached[3][1] > 0 and cached[3][0] > cached[3][1]   # LONG's blocks, both tiers
    prompt_tokens = sum(r.prompt_len for r in requests)
    summary = result.summary
    assert summary["prefix_cache_hit_rate"] == pytest.approx(
        sum(c for c, _ in cached.values()) / prompt_tokens)
    assert summary["prefix_cache_cpu_hit_rate"] == pytest.approx(
        sum(c for _, c in cached.values()) / prompt_tokens)
    assert summary["prefix_cache_cpu_hit_rate"] > 0
    loads = [s.num_load_blocks for s in result.steps]
    assert sum(loads) == audit.loaded and sum(s.num_offload_blocks for s in result.steps) > 0


def test_without_the_tier_the_same_run_recomputes_what_the_tier_served(checkpoint, reference):
    requests = tier_requests()
    tier = serve(checkpoint, [r.fresh_copy() for r in requests])
    none = serve(checkpoint, requests, kv_offload_gb=0.0)
    assert_matches_hf(none, requests, reference)
    assert none.num_offloaded_blocks == none.num_loaded_blocks == 0
    assert all(r.cpu_cached_tokens == 0 for r in none.records)
    assert none.summary["prefix_cache_cpu_hit_rate"] == 0
    assert tier.summary["prefix_cache_hit_rate"] > none.summary["prefix_cache_hit_rate"]
    prefilled = [sum(s.num_prefill_tokens for s in run.steps) for run in (tier, none)]
    assert prefilled[0] == prefilled[1] - sum(r.cpu_cached_tokens for r in tier.records)


# --------------------------------------------------------------------------- the tensors


def test_offload_and_load_move_blocks_through_the_tier_pool_only():
    cache = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3,
                    dtype=torch.float32, device="cpu", num_cpu_blocks=2, num_host_blocks=3)
    generator = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.offload([(4, 2), (1, 0)])
    assert torch.equal(cache.host_k[:, 2], before_k[:, 4])
    assert torch.equal(cache.host_v[:, 0], before_v[:, 1])
    assert (cache.cpu_k == 0).all() and (cache.host_k[:, 1] == 0).all()
    cache.k[:, [1, 4]] = float("nan")           # the GPU blocks are reused
    cache.load([(2, 5), (0, 3)])
    assert torch.equal(cache.k[:, 5], before_k[:, 4]) and torch.equal(cache.v[:, 3], before_v[:, 1])
    assert torch.equal(cache.k[:, 0], before_k[:, 0])
    with pytest.raises(ValueError, match=r"load: source block\(s\) \[3\] outside \[0, 3\)"):
        cache.load([(3, 0)])
    with pytest.raises(ValueError, match=r"offload: destination block\(s\) \[5\] outside"):
        cache.offload([(0, 5)])


# --------------------------------------------------------------------------- the command line

TRACE_CSV = ("arrival_s,prompt_tokens,output_tokens,prefix_block_size,prefix_hashes\n"
             "0,12,6,4,1 2\n100,22,8,4,7 8 9 10 11\n200,12,6,4,1 2\n")


def run_cli(tmp_path, *args: str) -> int:
    from servelab.cli import main

    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_CSV)
    return main(["run", "--device", "cpu", "--model", "tiny-llama", "--trace", str(trace),
                 "--block-size", "4", "--kv-blocks", "8", "--watermark", "0", *args])


def test_cli_kv_offload_gb_serves_hits_from_the_cpu_tier(tmp_path, capsys):
    from servelab.reports.runio import read_json, read_requests, read_steps

    out = tmp_path / "run"
    gb = f"{gib_for(HOST_BLOCKS):.17g}"
    assert run_cli(tmp_path, "--prefix-caching", "--kv-offload-gb", gb, "--out", str(out)) == 0
    assert "from the CPU tier" in capsys.readouterr().out
    summary = read_json(out / "summary.json")
    assert summary["prefix_cache_cpu_hit_rate"] == pytest.approx(8 / 46)
    records = read_requests(out / "requests.csv")
    assert [(r.cached_tokens, r.cpu_cached_tokens) for r in records] == [(0, 0), (0, 0), (8, 8)]
    steps = read_steps(out / "steps.csv")
    assert sum(s.num_load_blocks for s in steps) == 2 and sum(s.num_offload_blocks for s in steps)
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["kv_offload_gb"] == float(gb)
    assert config["derived"]["cache"]["num_host_blocks"] == HOST_BLOCKS


@pytest.mark.parametrize("args, message", [
    (["--prefix-caching", "--kv-offload-gb", "-1"],
     "argument --kv-offload-gb: expected a finite number >= 0, got '-1'"),
    (["--prefix-caching", "--kv-offload-gb", "lots"],
     "argument --kv-offload-gb: expected a number, got 'lots'"),
    (["--no-prefix-caching", "--kv-offload-gb", "1"], "--kv-offload-gb: a CPU tier holds prefix-cache blocks and needs "
                               "--prefix-caching"),
    (["--prefix-caching", "--kv-offload-gb", "1e9"],
     r"--kv-offload-gb 1e\+09: tiny-llama in float32 on cpu needs .* GiB of host memory "
     r"\(weights .* \+ KV pool .* \+ CPU tier .* GiB\), .* GiB is available"),
    (["--prefix-caching", "--kv-offload-gb", "1e-9"], r"--kv-offload-gb 1e-09 holds no KV block"),
    (["--prefix-caching", "--block-size", "3"],
     "the trace's prefix hashes name 4-token blocks, which the KV block size 3 does not divide"),
])
def test_cli_bad_kv_offload_gb_exits_2_with_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    try:
        status = run_cli(tmp_path, *args, "--out", str(out))
    except SystemExit as exc:   # argparse's own errors
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("servelab run: error: ") and "\n" not in err, err
    assert re.search(message, err), err
    assert not out.exists()


def test_host_memory_check_counts_pinned_pools_as_the_allocator_rounds_them(monkeypatch):
    """On CUDA the weights and the KV pool live on the GPU; the swap pool and the CPU tier
    are pinned host tensors (K and V), each rounded up to a power of two."""
    from servelab.backends import host_pools
    from servelab.config import CacheConfig

    spec = load_model_spec("llama-3.1-8b")
    block = spec.kv_bytes_per_token(2) * 4
    cache = CacheConfig(block_size=4, num_gpu_blocks=10**6, num_cpu_blocks=3,
                        enable_prefix_caching=True, num_host_blocks=5)
    # 3 blocks: K and V of 1.5 blocks each -> 2 blocks each; 5 -> 2.5 -> 4 each
    pinned = (2 * 2 + 2 * 4) * block          # block (128 KiB x 4) is a power of two

    def check(available, device):
        monkeypatch.setattr(host_pools, "available_host_bytes", lambda: available)
        host_pools.check_host_memory(spec, torch.device(device), torch.bfloat16, cache, 1.0)

    check(pinned, "cuda")                      # exactly enough: the GPU pool is not counted
    with pytest.raises(ValueError, match="CPU tier"):
        check(pinned - 1, "cuda")
    unpinned = (3 + 5) * block + spec.num_params * 2 + 10**6 * block
    check(unpinned, "cpu")                     # on a CPU: weights and every pool, unrounded
    with pytest.raises(ValueError, match="weights"):
        check(unpinned - 1, "cpu")
