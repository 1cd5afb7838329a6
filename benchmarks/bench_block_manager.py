"""Micro-benchmark of the block managers' hot paths (not a test): the paged manager the
simulator runs (`simulator/speed/paged.py`) and the contiguous baseline.

Reports µs per KV block for allocate + free (the limit chased: under 1 µs per block),
for a prefix-cache hit (allocate reusing cached blocks + free), for a cold prefix-cached
allocation (allocate + commit every block + free, evicting as it goes) and for the
contiguous baseline, and µs per sequence for one decode step (can_append_slots +
append_slots of one token).

    .venv/bin/python benchmarks/bench_block_manager.py [--block-size 16] [--num-blocks 100000]

Times are the best of `--repeat` runs, by default in CPU time of this process
(`--timer process`), which other load on a shared machine disturbs far less than wall
time (`--timer wall`).
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

from servelab.memory import ContiguousBlockManager
from servelab.simulator.speed import RunPagedBlockManager   # what the simulator runs

TIMERS = {"process": time.process_time, "wall": time.perf_counter}
Clock = Callable[[], float]


def best_of(clock: Clock, repeat: int, setup: Callable[[], object],
            run: Callable[[object], int]) -> float:
    """Smallest seconds per unit over `repeat` runs; `run(setup())` returns its units
    and only `run` is timed."""
    best = float("inf")
    for _ in range(repeat):
        arg = setup()
        t0 = clock()
        units = run(arg)
        best = min(best, (clock() - t0) / units)
    return best


def prompt_blocks(prompt: int, num_blocks: int, bs: int) -> list[tuple[int, ...]]:
    """Content keys of `num_blocks` full blocks: `bs` token ids each, distinct per
    (prompt, block) as real prompts are, from a small id range to keep memory low."""
    tail = tuple(range(bs - 2))
    return [(prompt, i) + tail for i in range(num_blocks)]


def bench_allocate_free(clock: Clock, bs: int, pool: int, seq_blocks: int, repeat: int) -> float:
    """Fill the pool with sequences, then free them all: seconds per block."""
    m = RunPagedBlockManager(bs, pool)
    num_seqs = pool // seq_blocks
    tokens = seq_blocks * bs - bs // 2           # last block half full

    def run(_) -> int:
        for s in range(num_seqs):
            m.allocate(s, tokens)
        for s in range(num_seqs):
            m.free(s)
        return num_seqs * seq_blocks
    return best_of(clock, repeat, lambda: None, run)


def bench_prefix_hit(clock: Clock, bs: int, pool: int, seq_blocks: int, repeat: int) -> float:
    """Sequences whose whole prompt is cached: allocate (hits) + free, per hit block."""
    m = RunPagedBlockManager(bs, pool, enable_prefix_caching=True)
    contents = prompt_blocks(0, seq_blocks, bs)
    tokens = seq_blocks * bs + 1                 # every full block can hit
    m.allocate("warm", tokens, contents)
    m.mark_computed("warm", tokens)
    m.free("warm")
    num_seqs = pool // (seq_blocks + 1) // 4

    def run(_) -> int:
        for s in range(num_seqs):
            if m.allocate(s, tokens, contents) != seq_blocks * bs:
                raise RuntimeError("expected a full prefix hit")
        for s in range(num_seqs):
            m.free(s)
        return num_seqs * seq_blocks
    return best_of(clock, repeat, lambda: None, run)


def bench_prefix_cold(clock: Clock, bs: int, pool: int, seq_blocks: int, repeat: int) -> float:
    """Distinct prompts: a lookup miss, a commit per block, and eviction once the pool
    has filled with cached blocks; seconds per block."""
    m = RunPagedBlockManager(bs, pool, enable_prefix_caching=True)
    num_seqs = pool // seq_blocks
    tokens = seq_blocks * bs
    prompts = iter(range(10 ** 9))

    def setup() -> list[list[tuple[int, ...]]]:
        return [prompt_blocks(next(prompts), seq_blocks, bs) for _ in range(num_seqs)]

    def run(batch) -> int:
        for s, contents in enumerate(batch):
            m.allocate(s, tokens, contents)
            m.mark_computed(s, tokens)
        for s in range(num_seqs):
            m.free(s)
        return num_seqs * seq_blocks
    return best_of(clock, repeat, setup, run)


def bench_decode_step(clock: Clock, bs: int, pool: int, num_seqs: int, steps: int,
                      repeat: int) -> float:
    """Scheduler steps of can_append_slots + append_slots(1) for every running
    sequence; seconds per sequence and step. The pool stays far from full."""
    m = RunPagedBlockManager(bs, pool)
    for s in range(num_seqs):
        m.allocate(s, 100)
    seqs = list(range(num_seqs))

    def run(_) -> int:
        can, append = m.can_append_slots, m.append_slots
        for _ in range(steps):
            for s in seqs:
                if can(s, 1):
                    append(s, 1)
        return steps * num_seqs
    return best_of(clock, repeat, lambda: None, run)


def bench_contiguous(clock: Clock, bs: int, pool: int, seq_blocks: int, repeat: int) -> float:
    """Contiguous (oracle) allocate + free; seconds per reserved block."""
    m = ContiguousBlockManager(bs, pool, mode="oracle", max_model_len=seq_blocks * bs * 4)
    num_seqs = pool // seq_blocks
    tokens = seq_blocks * bs

    def run(_) -> int:
        for s in range(num_seqs):
            m.allocate(s, tokens, expected_total_tokens=tokens)
        for s in range(0, num_seqs, 2):          # every other first: many free extents
            m.free(s)
        for s in range(1, num_seqs, 2):
            m.free(s)
        return num_seqs * seq_blocks
    return best_of(clock, repeat, lambda: None, run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=100_000)
    p.add_argument("--seq-blocks", type=int, default=128, help="blocks per sequence (2048 tokens)")
    p.add_argument("--decode-seqs", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--timer", choices=sorted(TIMERS), default="process")
    a = p.parse_args()
    clock, bs, pool, sb, r = TIMERS[a.timer], a.block_size, a.num_blocks, a.seq_blocks, a.repeat
    us = 1e6
    rows = [
        ("paged allocate + free", bench_allocate_free(clock, bs, pool, sb, r), "µs/block"),
        ("prefix-cache hit: allocate + free", bench_prefix_hit(clock, bs, pool, sb, r), "µs/block"),
        ("prefix cold: allocate + commit + free", bench_prefix_cold(clock, bs, pool, sb, r), "µs/block"),
        ("decode: can_append + append(1)",
         bench_decode_step(clock, bs, pool, a.decode_seqs, 64, r), "µs/seq"),
        ("contiguous oracle allocate + free", bench_contiguous(clock, bs, pool, sb, r), "µs/block"),
    ]
    print(f"block_size={bs} num_blocks={pool} seq_blocks={sb}: best of {r}, {a.timer} time")
    width = max(len(name) for name, _, _ in rows)
    for name, seconds, unit in rows:
        print(f"{name:<{width}}  {seconds * us:8.3f} {unit}")


if __name__ == "__main__":
    main()
