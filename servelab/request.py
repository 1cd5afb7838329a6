"""The request data model shared by the scheduler, both executors and the reports.

A `Request` is what a client sent (lengths, tenant, priority, SLOs) plus the state the
scheduler keeps while serving it. Parallel sampling (`n > 1`) gives a request several
`Sequence`s: the prompt is prefilled once by sample 0, then forked (copy-on-write of
the shared partial block) into the other samples when the first tokens are drawn.

Sequence ids are `(request_id, sample_index)` tuples: unique, hashable, and sortable,
so every ordering key can end in one.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat
from typing import Hashable

SeqId = tuple[int, int]


class RegionOffset(int):
    """The key of the block `j` blocks after its region's first block (1 <= j < the
    region's size in blocks, `size`), in a trace that names content per region of several
    blocks (`Request.block_contents`; memory/prefix_cache.py hashes such keys). Equal to,
    and hashing as, the int j; take them from `region_offsets` (shared objects, so long
    prompts allocate none)."""

    size: int

    def __new__(cls, offset: int, size: int) -> "RegionOffset":
        if not 0 < offset < size:
            raise ValueError(f"a region offset lies in 1 .. size - 1, not {offset} (size {size})")
        self = super().__new__(cls, offset)
        self.size = size
        return self

    def __getnewargs__(self) -> tuple[int, int]:
        return int(self), self.size


@lru_cache(maxsize=None)
def region_offsets(size: int) -> tuple[RegionOffset, ...]:
    """The offsets 1 .. size - 1 of a region of `size` blocks, as shared keys."""
    return tuple(RegionOffset(j, size) for j in range(1, size))


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # queued, never admitted
    RUNNING = "running"          # holds KV blocks on the GPU
    SWAPPED = "swapped"          # preempted by swap: KV in the CPU pool
    PREEMPTED = "preempted"      # preempted by recompute: KV freed, waits to re-prefill
    FINISHED = "finished"
    REJECTED = "rejected"        # never admitted; see Request.reject_reason

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.REJECTED)


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request: the tokens it holds and how many have KV computed.

    `num_tokens - num_computed_tokens` is what the next step must compute: the rest
    of the prompt (or of a recompute) while prefilling, one token while decoding. A
    decoding sequence has `num_tokens - 1` slots: the last drawn token gets its slot
    (and its KV) in the step that computes it.
    """

    seq_id: SeqId
    num_tokens: int
    num_computed_tokens: int = 0
    prefill_len: int = 0
    """Tokens to compute as prefill since the sequence last got its blocks (the prompt,
    or prompt + outputs after a recompute preemption); later tokens are decodes."""
    output_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    finished: bool = False

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_len


@dataclass(slots=True, eq=False)
class Request:
    request_id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    """Target output tokens (the trace's). Replay stops here; real decoding may stop earlier at EOS."""
    max_tokens: int | None = None
    """Upper bound a client asked for; defaults to `output_len`. Reservation-based
    memory managers size by it, so a trace may set it above `output_len`."""
    n: int = 1
    priority: int = 0
    tenant: str = "default"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prefix_hashes: tuple[int, ...] | None = None
    prefix_block_size: int | None = None

    # --- serving state, owned by the scheduler ---
    status: RequestStatus = RequestStatus.WAITING
    reject_reason: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_preemptions: int = 0
    scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times: list[float] | None = None
    cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache at the first admission (vLLM's
    `cached_tokens`); None when the scheduler keeps no prefix cache."""
    cpu_cached_tokens: int | None = None
    """Of `cached_tokens`, those loaded from the CPU tier (None without a prefix cache)."""
    seed: int | None = None
    """Per-request sampling seed (real backend); sample i uses seed + i."""

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.output_len
        problems = []
        if not isinstance(self.request_id, int) or self.request_id < 0:
            problems.append(f"request_id must be a non-negative int, got {self.request_id!r}")
        if not self.arrival_s >= 0:
            problems.append(f"arrival_s must be >= 0, got {self.arrival_s!r}")
        if self.prompt_len < 1:
            problems.append(f"prompt_len must be >= 1, got {self.prompt_len!r}")
        if self.output_len < 1:
            problems.append(f"output_len must be >= 1, got {self.output_len!r}")
        if self.max_tokens < self.output_len:
            problems.append(f"max_tokens ({self.max_tokens}) must be >= output_len ({self.output_len})")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n!r}")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            problems.append(f"prompt_token_ids has {len(self.prompt_token_ids)} tokens, prompt_len is {self.prompt_len}")
        if self.prefix_hashes is not None and not self.prefix_block_size:
            problems.append("prefix_hashes given without prefix_block_size")
        if problems:
            raise ValueError(f"request {self.request_id}: " + "; ".join(problems))
        if not self.seqs:
            self.seqs = [Sequence((self.request_id, 0), self.prompt_len)]

    # ------------------------------------------------------------------ helpers
    @property
    def is_done(self) -> bool:
        return self.status.is_done

    @property
    def num_output_tokens(self) -> int:
        """Output tokens produced so far by the furthest sample."""
        return max(s.num_output_tokens for s in self.seqs)

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    def block_contents(self, seq: Sequence, block_size: int, start: int = 0) -> list[Hashable]:
        """Content keys of the sequence's full blocks from block `start` on, for prefix
        caching (a sequence only grows, so keys once given never change: callers extend
        what they already have, `start` = the number of keys they hold).

        With token ids a block's content is its tokens. With only trace prefix hashes
        (e.g. Mooncake's 512-token `hash_ids`) the first block of hashed region k is
        (hash_k, region_size) and the i-th after it just the offset i (1 <= i <
        region_size / block_size), a `RegionOffset`. A key is only ever compared with
        the key at the same position under an equal chain before it (a prefix cache's
        parent check), where the offset is the same for one region size, and the size in
        the region's first key keeps traces that mix sizes apart; so the region's hash,
        checked at its first block, need not repeat: equal chains of keys still mean
        equal content as the trace intends.
        The offsets are shared objects, so a long prompt's keys are built and freed
        without allocating one per block, and their chain hashes come in C (the region
        rule of `BlockKeys`). A block spanning several regions is (their hashes, j), j
        tokens into the first. Without either, nothing is cacheable and the list is
        empty. O(blocks returned).
        """
        n_full = seq.num_tokens // block_size
        if self.prompt_token_ids is not None:
            tokens = self.prompt_token_ids
            if seq.output_token_ids:
                tokens = tokens + tuple(seq.output_token_ids)
            n_full = min(n_full, len(tokens) // block_size)
            return [tuple(tokens[i * block_size:(i + 1) * block_size]) for i in range(start, n_full)]
        layout = self.region_layout(seq, block_size, start)
        if layout is not None:
            firsts, per, skip, count = layout
            later = region_offsets(per)
            keys = []
            for first_key in firsts:
                keys.append(first_key)
                keys += later
            return keys[skip:skip + count]
        if self.prefix_hashes is not None:
            trace_bs = self.prefix_block_size
            hashes = self.prefix_hashes
            n_full = min(n_full, min(self.prompt_len, len(hashes) * trace_bs) // block_size)
            out = []
            for i in range(start, n_full):
                first, last = i * block_size // trace_bs, ((i + 1) * block_size - 1) // trace_bs
                out.append((hashes[first:last + 1], i * block_size - first * trace_bs))
            return out
        return []

    def region_layout(self, seq: Sequence, block_size: int, start: int
                      ) -> tuple[list[tuple[int, int]], int, int, int] | None:
        """With trace prefix hashes whose regions are whole blocks: the first keys of
        the regions holding blocks start.., the blocks a region holds, how many of the
        first region's blocks come before `start`, and the number of new blocks (what
        the simulator's `BlockKeys.extend_regions` hashes in bulk). None otherwise."""
        if self.prompt_token_ids is not None or self.prefix_hashes is None \
                or self.prefix_block_size % block_size:
            return None
        trace_bs = self.prefix_block_size
        per = trace_bs // block_size
        covered = min(self.prompt_len, len(self.prefix_hashes) * trace_bs)
        n_full = min(seq.num_tokens // block_size, covered // block_size)
        first, stop = start // per, -(-n_full // per)
        # the size in each first key too: traces may mix sizes
        firsts = list(zip(self.prefix_hashes[first:stop], repeat(trace_bs)))
        return firsts, per, start - first * per, max(n_full - start, 0)

    def fresh_copy(self) -> "Request":
        """The same client request with no serving state (for replaying a trace again)."""
        return Request(self.request_id, self.arrival_s, self.prompt_len, self.output_len,
                       self.max_tokens, self.n, self.priority, self.tenant, self.slo_ttft_ms,
                       self.slo_tpot_ms, self.prompt_token_ids, self.prefix_hashes,
                       self.prefix_block_size, seed=self.seed)
