"""µs per scheduler step: schedule() + update() with N running decode sequences.

Setup (issue target: at most 100 µs per step for 256 sequences): 256 requests with
1024-token prompts (shared 512-token prefix, so prefix caching is exercised) are
admitted and prefilled, then the benchmark times steady decode steps, each one
schedule() → a trivial executor result → update(). Prefix caching on, 16-token blocks.

    python benchmarks/bench_scheduler.py [--seqs 256] [--steps 2000] [--policy fcfs]
"""
from __future__ import annotations

import argparse
import time

from servelab.config import CacheConfig, SchedulerConfig
from servelab.outputs import StepResult
from servelab.simulator.speed import build_scheduler   # the simulator's scheduler
from servelab.request import Request


def build(num_seqs: int, policy: str, prompt: int, prefix: int):
    sched = build_scheduler(
        SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs),
                        chunked_prefill=8192, max_model_len=prompt + 100_000),
        CacheConfig(block_size=16, num_gpu_blocks=num_seqs * (prompt // 16 + 400), enable_prefix_caching=True),
        policy)
    shared = tuple(range(prefix))
    for i in range(num_seqs):
        ids = shared + tuple(range(10_000 + i * prompt, 10_000 + i * prompt + prompt - prefix))
        sched.add_request(Request(i, 0.0, prompt, 1_000_000, prompt_token_ids=ids, tenant=f"t{i % 4}"), 0.0)
    now = 0.0
    while any(s.is_prefilling or s.num_computed_tokens == 0 for r in sched.requests.values() for s in r.seqs):
        out = sched.schedule(now)
        sched.update(out, StepResult(0.01))
        now += 0.01
    return sched, now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--policy", default="fcfs")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    best_wall = best_cpu = float("inf")
    for _ in range(args.repeat):
        sched, now = build(args.seqs, args.policy, args.prompt, args.prefix)
        result = StepResult(0.01)
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            out = sched.schedule(now)
            sched.update(out, result)
            now += 0.01
        wall = (time.perf_counter() - w0) / args.steps * 1e6
        cpu = (time.process_time() - c0) / args.steps * 1e6
        assert len(out.scheduled) == args.seqs and not out.preempted
        best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
    usage = sched.bm.usage()
    print(f"policy={args.policy} running={args.seqs} block_size=16 prefix_caching=on "
          f"prefix_hit_rate={usage.prefix_hit_rate:.2f}")
    print(f"schedule()+update(): {best_wall:.1f} µs/step wall, {best_cpu:.1f} µs/step CPU "
          f"(best of {args.repeat} × {args.steps} steps)")


if __name__ == "__main__":
    main()
