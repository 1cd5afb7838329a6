"""What the scheduler tells an executor, and what the executor answers.

These are the only objects that cross the scheduler/executor boundary: small
dataclasses of ids and ints. Neither side sees the other's internals, which is what
lets the simulator and the real backend run the very same scheduler.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

from servelab.request import SeqId


class PreemptionMode(enum.Enum):
    """What a preemption did with a request's KV cache: the two outcomes an executor must
    act on. Which one a preemption takes is the configured strategy's choice
    (`servelab.policies.preemption`); a new strategy chooses between these two."""

    RECOMPUTE = "recompute"
    """The KV was freed; the request waits to compute it again (prefill)."""
    SWAP = "swap"
    """The KV moved to the CPU pool (SchedulerOutput.swap_out); it comes back by swap-in."""


class ScheduledSeq(NamedTuple):
    """One sequence's work in a step. A named tuple: the scheduler makes hundreds per
    step, and a tuple is the cheapest immutable record Python has."""

    request_id: int
    seq_id: SeqId
    num_tokens: int
    """Tokens computed this step: a prefill chunk, or 1 for a decode."""
    context_len: int
    """Tokens whose KV was already in the cache before this step (prefix hits included)."""
    num_samples: int
    """Tokens drawn at the end of the step: 0 for a chunk that does not finish the
    prefill, 1 normally, n when a request with n samples finishes its prompt (the
    scheduler then forks the sequence into n samples)."""
    is_prefill: bool
    """True while computing prompt (or recomputed) tokens, False for a decode token. A
    decode of num_tokens K + 1 > 1 is a speculative verify step: the last sampled token
    and K proposed ones, of which the step keeps a prefix and samples one more
    (`servelab.speculative`)."""

    @property
    def completes_prefill(self) -> bool:
        return self.is_prefill and self.num_samples > 0


class ScheduledWork:
    """Every sequence's work in one step: a read-only sequence of ScheduledSeq.

    Most of a busy step is plain decodes (single-sample requests computing one token)
    that the scheduler advances together. It hands them over compactly: one
    (request_id, seq_id, base) row each, whose context this step is base + tick. They
    come first, then the work listed one entry per sequence (prefill chunks, samples of
    multi-sample requests, every other decode). Iterating builds the compact decodes'
    ScheduledSeqs on the fly (O(sequences)); `len`, `prefill_continues` and
    `BatchShape.from_output` never do, so a cost model prices a step in O(listed work).

    Both shapes are public and read-only (`rows`, `tick`, `rows_context_sum`, `listed`):
    what prices a step reads them rather than iterating.
    """

    __slots__ = ("rows", "tick", "rows_context_sum", "listed")

    def __init__(self, listed: list[ScheduledSeq] | tuple = (),
                 rows: tuple[tuple[int, SeqId, int], ...] = (), tick: int = 0,
                 rows_context_sum: int = 0) -> None:
        self.listed = listed
        """Work listed one ScheduledSeq per sequence (after the rows)."""
        self.rows = rows
        """Compact plain decodes: (request_id, seq_id, base) each, one token at context
        base + tick."""
        self.tick = tick
        self.rows_context_sum = rows_context_sum
        """Σ (context + 1) over the rows: KV tokens their decode attention reads."""

    def __len__(self) -> int:
        return len(self.rows) + len(self.listed)

    def __iter__(self) -> Iterator[ScheduledSeq]:
        t = self.tick
        for rid, sid, base in self.rows:
            yield ScheduledSeq(rid, sid, 1, base + t, 1, False)
        yield from self.listed

    def __getitem__(self, index):
        return list(self)[index]

    def __eq__(self, other) -> bool:
        if isinstance(other, ScheduledWork):
            return list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ScheduledWork({list(self)!r})"

    def prefill_continues(self) -> bool:
        """Does a prefill chunk that does not finish its prompt run in this step? Then
        that request prefills again next step. O(listed work); prefill chunks come last
        in a decode-first step, so the scan starts from the end."""
        return any(e.is_prefill and not e.num_samples for e in reversed(self.listed))


class BlockPairs(Sequence):
    """Block copies (source block, destination block) kept as two columns, `firsts[i]` to
    `seconds[i]`: a sequence of pairs to whoever iterates it (the real backend's copies),
    a count to whoever only needs how many (the simulator's cost model), without a tuple
    made per pair. A CPU tier hands millions of these over in a long run (the Mooncake
    benchmark: 8.6 million offloads; docs/performance.md). Read-only once built."""

    __slots__ = ("firsts", "seconds")

    def __init__(self, firsts: list[int], seconds: list[int]) -> None:
        if len(firsts) != len(seconds):
            raise ValueError(f"BlockPairs: {len(firsts)} sources for {len(seconds)} destinations")
        self.firsts = firsts
        self.seconds = seconds

    def __len__(self) -> int:
        return len(self.firsts)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.firsts, self.seconds)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        return self.firsts[index], self.seconds[index]

    def __eq__(self, other) -> bool:
        if isinstance(other, (BlockPairs, list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # equal to a list, so unhashable like one

    def __repr__(self) -> str:
        return repr(list(self))


NO_WORK = ScheduledWork()
"""The work of a step that computes nothing (a ScheduledWork never changes)."""


@dataclass(slots=True)
class SchedulerOutput:
    now: float
    scheduled: ScheduledWork = NO_WORK
    """Every sequence's work this step (see ScheduledWork)."""
    preempted: list[tuple[int, PreemptionMode]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(gpu_block, cpu_block) pairs to copy GPU → CPU before the step."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(cpu_block, gpu_block) pairs to copy CPU → GPU before the step."""
    copies: list[tuple[int, int]] = field(default_factory=list)
    """Copy-on-write (src_gpu_block, dst_gpu_block) pairs, done after swaps and loads,
    before compute."""
    offload: Sequence[tuple[int, int]] = field(default_factory=list)
    """(gpu_block, host_block) pairs (a list, or `BlockPairs`): prefix blocks evicted from
    the GPU cache, copied to the CPU tier first of all (before anything can overwrite
    them)."""
    load: Sequence[tuple[int, int]] = field(default_factory=list)
    """(host_block, gpu_block) pairs (a list, or `BlockPairs`): prefix-cache hits found in
    the CPU tier, copied to the GPU after swaps, before copies and compute."""
    rejected: list[tuple[int, str]] = field(default_factory=list)
    block_tables: dict[SeqId, list[int]] = field(default_factory=dict)
    """Block table of every scheduled sequence (the executor's view of its KV)."""

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to move: an executor has no work."""
        work = self.scheduled
        return not (work.rows or work.listed or self.swap_out or self.swap_in or self.copies
                    or self.offload or self.load)


@dataclass(slots=True)
class StepResult:
    duration_s: float
    """Wall (real) or modelled (simulated) time the step took."""
    sampled: dict[SeqId, list[int]] | None = None
    """Tokens drawn per scheduled sequence (num_samples of them); None when the
    executor produces no real tokens (simulation): the scheduler then counts tokens."""
    stopped: set[SeqId] | frozenset[SeqId] = frozenset()
    """Sequences whose last drawn token ends them (EOS) before their target length."""
    shape: BatchShape | None = None
    """The step's BatchShape, if the executor computed it (the engine step reuses it)."""
    produced: dict[SeqId, int] | None = None
    """Tokens each speculative verify entry produced (1 + the proposed tokens accepted),
    when the executor produces no real tokens (simulation); with real tokens, the length
    of `sampled[seq]` says it."""


@dataclass(slots=True)
class BatchShape:
    """The aggregate composition of a step: what a cost model needs to price it.
    A value: nothing changes one after it is made (it is not frozen only because a
    frozen dataclass costs microseconds more to build, and one is built every step).

    For attention, a prefill chunk of q tokens over a cached context c does causal work
    proportional to q·c + q(q+1)/2, so the sums below are sufficient statistics; the
    longest chunk's last query tile, which no other thread block can help with, attends
    to `prefill_max_keys` keys.
    """

    num_prefill_seqs: int = 0
    num_prefill_tokens: int = 0
    prefill_context_sum: int = 0      # Σ c over prefill chunks
    prefill_q_context_sum: int = 0    # Σ q·c
    prefill_q_sq_sum: int = 0         # Σ q²
    num_decode_seqs: int = 0
    decode_context_sum: int = 0       # Σ (c + 1): KV tokens read by decode attention
    num_swap_blocks: int = 0          # blocks moved over PCIe (in + out)
    num_copy_blocks: int = 0          # copy-on-write block copies on the GPU
    prefill_max_keys: int = 0         # max (c + q) over prefill chunks; 0: unknown
    num_offload_blocks: int = 0       # prefix blocks GPU -> CPU tier over PCIe
    num_load_blocks: int = 0          # prefix hits CPU tier -> GPU over PCIe

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @classmethod
    def from_output(cls, out: SchedulerOutput) -> "BatchShape":
        """O(listed work): compact decodes count by their precomputed sums."""
        work = out.scheduled
        nps = npt = pcs = pqc = pqq = keys = 0
        nds, dcs = len(work.rows), work.rows_context_sum
        for s in work.listed:
            if s.is_prefill:
                nps += 1
                npt += s.num_tokens
                pcs += s.context_len
                pqc += s.num_tokens * s.context_len
                pqq += s.num_tokens * s.num_tokens
                if s.context_len + s.num_tokens > keys:
                    keys = s.context_len + s.num_tokens
            else:
                nds += 1
                dcs += s.context_len + 1
        return cls(nps, npt, pcs, pqc, pqq, nds, dcs,
                   len(out.swap_in) + len(out.swap_out), len(out.copies), keys,
                   len(out.offload), len(out.load))
