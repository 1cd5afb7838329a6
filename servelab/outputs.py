"""What the scheduler tells an executor, and what the executor answers.

These are the only objects that cross the scheduler/executor boundary: small
dataclasses of ids and ints. Neither side sees the other's internals, which is what
lets the simulator and the real backend run the very same scheduler.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from servelab.request import SeqId


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


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
    """True while computing prompt (or recomputed) tokens, False for a decode token."""

    @property
    def completes_prefill(self) -> bool:
        return self.is_prefill and self.num_samples > 0


class DecodeBatch(NamedTuple):
    """Plain decode work of one step in aggregate: single-sample requests that each
    compute one token. The scheduler advances such sequences together without touching
    each one per step; this is its O(1) description of them. Row i is
    (request_id, seq_id, base): that sequence's context length this step is
    `base + tick`. `entries()` lists them as ScheduledSeqs (O(rows))."""

    rows: tuple[tuple[int, SeqId, int], ...]
    tick: int
    num_seqs: int
    context_sum: int
    """Σ (context_len + 1) over the rows: KV tokens their decode attention reads."""

    def entries(self) -> list[ScheduledSeq]:
        t = self.tick
        return [ScheduledSeq(rid, sid, 1, base + t, 1, False) for rid, sid, base in self.rows]


@dataclass(slots=True)
class SchedulerOutput:
    now: float
    listed: list[ScheduledSeq] = field(default_factory=list)
    """Work listed sequence by sequence: prefill chunks, samples of multi-sample
    requests, and every decode the scheduler did not batch."""
    decode_batch: DecodeBatch | None = None
    """Plain decodes in aggregate (see DecodeBatch), or None."""
    preempted: list[tuple[int, PreemptionMode]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(gpu_block, cpu_block) pairs to copy GPU → CPU before the step."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(cpu_block, gpu_block) pairs to copy CPU → GPU before the step."""
    copies: list[tuple[int, int]] = field(default_factory=list)
    """Copy-on-write (src_gpu_block, dst_gpu_block) pairs, done after swaps, before compute."""
    rejected: list[tuple[int, str]] = field(default_factory=list)
    block_tables: dict[SeqId, list[int]] = field(default_factory=dict)
    """Block table of every scheduled sequence (the executor's view of its KV)."""

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Every sequence's work this step: the batched decodes, then the listed work.
        Built on each access (O(sequences)): hot paths read `listed` and
        `decode_batch` instead."""
        batch = self.decode_batch
        return batch.entries() + self.listed if batch is not None else list(self.listed)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to move: an executor has no work."""
        return not (self.listed or self.decode_batch or self.swap_out or self.swap_in
                    or self.copies)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.listed if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        batch = self.decode_batch
        return sum(s.num_tokens for s in self.listed if not s.is_prefill) + \
            (batch.num_seqs if batch is not None else 0)


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


@dataclass(slots=True)
class BatchShape:
    """The aggregate composition of a step: what a cost model needs to price it.
    A value: nothing changes one after it is made (it is not frozen only because a
    frozen dataclass costs microseconds more to build, and one is built every step).

    For attention, a prefill chunk of q tokens over a cached context c does causal work
    proportional to q·c + q(q+1)/2, so the sums below are sufficient statistics.
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

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @classmethod
    def from_output(cls, out: SchedulerOutput) -> "BatchShape":
        nps = npt = pcs = pqc = pqq = nds = dcs = 0
        batch = out.decode_batch
        if batch is not None:
            nds, dcs = batch.num_seqs, batch.context_sum
        for s in out.listed:
            if s.is_prefill:
                nps += 1
                npt += s.num_tokens
                pcs += s.context_len
                pqc += s.num_tokens * s.context_len
                pqq += s.num_tokens * s.num_tokens
            else:
                nds += 1
                dcs += s.context_len + 1
        return cls(nps, npt, pcs, pqc, pqq, nds, dcs,
                   len(out.swap_in) + len(out.swap_out), len(out.copies))
