"""Plain decodes in bulk: the scheduler's speed machinery, behind one object.

Most steps of a busy engine are mostly plain decodes: single-sample requests computing one
token each. The scheduler (`policies/scheduler.py`) hands such a request to its
`DecodeBatch` after a step in which it drew a token, and takes it back whenever it needs
requests one by one. Members advance together with a tick counter (a `_Member` derives its
Sequence's lengths from the tick), so a step costs O(members crossing a block boundary),
not O(members):

- within a step (`take_step`): when the one-by-one path would give every running request
  its whole work with no preemption, every member decodes one token; only members whose
  next slot starts a new block (one in block_size, found by bucket) get `append_slots`,
  and finishes come off a heap keyed by the tick they happen at. Otherwise the members go
  back to the scheduler (`dissolve`), which schedules the step one by one;
- across steps (`run_bound`, `advance`): a run of plain decode steps is applied in closed
  form (the simulator's fast-forward): O(block_size) for members, O(sequences) for the
  requests the scheduler lists one by one. With a CPU tier, a run of members may outlast
  the free list, its later steps evicting cached blocks with a copy each to the tier:
  `OffloadRun` says which step copies how many, for the caller to price.

Members' Sequences, and their slots in the block manager, are brought up to the tick
lazily; `sync` does it for all (O(members)), and the scheduler calls it before it shows a
running request to anyone (a policy, `Scheduler.running`). Batching needs a block manager
that declares `grows_by_block`: block use is then a function of each sequence's length.

Property tests hold it to the one-by-one path: every decision, record and sequence length
is the same with batching on or off (tests/test_scheduler_properties.py), and a
fast-forwarded simulation equals a stepped one (tests/test_simulator_fastforward.py).
"""
from __future__ import annotations

import heapq
from itertools import accumulate
from typing import Callable

from servelab.config import SchedulerConfig
from servelab.memory.base import BlockManager
from servelab.outputs import NO_WORK, ScheduledWork
from servelab.policies.base import SchedulerError
from servelab.policies.budget import StepBudget
from servelab.request import Request, Sequence

Admits = Callable[[int], bool]
"""admits(num_seqs): could a waiting request be admitted while that many sequences do
nothing but decode (free memory only shrinking)? The scheduler's admission rules."""


class DecodeBatch:
    """The batched plain decodes of one scheduler, and its fast-forward.

    `listed` arguments are the scheduler's running requests that are not members (the
    ones it schedules one by one, in any order); `dissolve` moves every member into it.
    `running` arguments are all its running requests, in admission order."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *,
                 enabled: bool) -> None:
        self.enabled = enabled
        """May requests join? Decided by the scheduler (see Scheduler.__init__)."""
        self.pending = False
        """The members decode in a step that was scheduled and not yet updated."""
        self.num_members = 0
        """Batched sequences (one per member request)."""
        self._bm = block_manager
        self._bs = block_manager.block_size
        self._max_model_len = config.max_model_len
        self._chunk = config.chunked_prefill or (1 << 62)
        self._max_run_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self._members: dict[int, _Member] = {}     # in joining order
        self._rows: dict[int, tuple] = {}          # their ScheduledWork rows
        self._rows_tuple: tuple | None = ()        # cached tuple(self._rows.values())
        self._buckets: list[dict[int, _Member]] = [{} for _ in range(self._bs)]
        self._finishes: list[tuple[int, int, int]] = []  # (finish tick, join no, request id)
        self._tick = 0
        self._base_sum = 0
        self._joins = 0
        self._synced_tick = 0                      # every member written back at this tick
        self._step_rows: tuple = ()                # the rows of the pending step
        self.run_offloads: OffloadRun | None = None
        """The host-tier copies of the run the last `run_bound` allowed (None: none)."""

    # ------------------------------------------------------------------ within a step
    def take_step(self, listed: dict[int, Request], step: StepBudget, prefill: bool | None,
                  copies: list) -> bool:
        """Called before the scheduler's pass over running requests (`prefill`: the pass
        takes prefilling requests only (True), decoding ones only (False), or both (None)).
        True if the members need nothing more in this pass — they decode one token each
        now (their copy-on-write pairs, if any, go to `copies`), or, in a prefill-only
        pass, wait for the decode pass — and the scheduler lists `listed` alone. False
        after handing every member back into `listed`: the one-by-one path could have
        to preempt, so it takes the whole step.

        The test: would the one-by-one path give every running request its whole work
        (every member its token, every listed request its full next chunk or decodes)
        with no preemption? A one-token append takes at most one block (a new one at a
        boundary, or the copy of a shared partial last block). A prefill-only pass gives
        the budget to listed requests alone, as the one-by-one path does: only a sample
        that decodes beside its prefilling siblings (multi-sample recompute) can need
        memory there. O(listed sequences)."""
        bm = self._bm
        if prefill is True:
            need = sum(1 for r in listed.values() for s in r.seqs
                       if not s.finished and not s.is_prefilling)
            if need <= bm.num_free_blocks:
                return True
            self.dissolve(listed)
            return False
        n = self.num_members
        tokens = seqs = blocks = 0
        chunk = self._chunk
        for req in listed.values():
            for s in req.seqs:
                if s.finished:
                    continue
                seqs += 1
                if s.is_prefilling:
                    tokens += min(s.num_tokens - s.num_computed_tokens, chunk)
                else:
                    tokens += 1
                    blocks += 1
        tick = self._tick
        bucket = self._buckets[tick % self._bs].values()
        if n + tokens > step.tokens or n + seqs > step.seqs \
                or blocks + len(bucket) > bm.num_free_blocks:
            self.dissolve(listed)
            return False
        # every member decodes one token; those whose token starts a new block get
        # their slots since they last grew
        if bucket:
            grown = bm.append_slots_many(
                [(m.seq.seq_id, m.base + tick + 1 - m.bm_tokens) for m in bucket])
            if grown:
                copies.extend(grown)
            for m in bucket:
                m.bm_tokens = m.base + tick + 1
        rows = self._rows_tuple
        if rows is None:
            rows = self._rows_tuple = tuple(self._rows.values())
        self._step_rows = rows
        self.pending = True
        step.tokens -= n
        step.seqs -= n
        return True

    def work(self, listed: list) -> ScheduledWork:
        """The step's work: the members' decodes (when this step scheduled them), then
        the listed entries."""
        if not self.pending:
            return ScheduledWork(listed) if listed else NO_WORK
        rows, tick = self._step_rows, self._tick
        return ScheduledWork(listed, rows, tick, self._base_sum + len(rows) * (tick + 1))

    def update(self, sampled, stopped, ended: list[Request], freed: list) -> None:
        """Every member drew a token: advance the tick, take sampled tokens and stops one
        by one if the executor has them, and finish the members whose last token this was
        (off the heap; they leave, their requests go to `ended`, their seq ids to
        `freed`)."""
        self.pending = False
        self._tick = tick = self._tick + 1
        members = self._members
        done: list[_Member] = []
        if sampled is not None or stopped:
            for rid, sid, _ in self._step_rows:
                m = members[rid]
                if sampled is not None:
                    m.seq.output_token_ids.append(sampled[sid][0])
                if stopped and sid in stopped and m.finish_tick > tick:
                    done.append(m)
        finishes = self._finishes
        while finishes and finishes[0][0] <= tick:
            _, join_no, rid = heapq.heappop(finishes)
            m = members.get(rid)
            if m is not None and m.join_no == join_no:
                done.append(m)
        for m in done:
            self._leave(m)
            m.seq.finished = True
            freed.append(m.seq.seq_id)
            ended.append(m.req)

    # ------------------------------------------------------------------ membership
    def join(self, req: Request) -> None:
        """Batch a running single-sample request that has just drawn a token and goes on
        decoding (its Sequence and block table are up to date)."""
        seq = req.seqs[0]
        tick = self._tick
        base = seq.num_computed_tokens - tick
        out_base = seq.num_output_tokens - tick
        finish = min(req.output_len - out_base, self._max_model_len - base - 1)
        self._joins += 1
        m = _Member(req, seq, base, out_base, seq.num_tokens - 1, finish, self._joins)
        rid = req.request_id
        self._members[rid] = m
        self.num_members += 1
        self._rows[rid] = (rid, seq.seq_id, base)
        self._rows_tuple = None
        self._buckets[-base % self._bs][rid] = m
        heapq.heappush(self._finishes, (finish, m.join_no, rid))
        self._base_sum += base

    def _write_back(self, m: _Member) -> None:
        """Bring a member's Sequence, and its slots in the block manager, up to the tick."""
        seq, tick = m.seq, self._tick
        seq.num_computed_tokens = m.base + tick
        seq.num_tokens = m.base + tick + 1
        seq.num_output_tokens = m.out_base + tick
        behind = m.base + tick - m.bm_tokens
        if behind > 0:
            if self._bm.append_slots(seq.seq_id, behind):
                raise SchedulerError(f"catching up {seq.seq_id} needed a block copy")
            m.bm_tokens += behind

    def _leave(self, m: _Member) -> None:
        """A member finishes: written back, out of the batch (its heap entry goes stale)."""
        rid = m.req.request_id
        self._write_back(m)
        del self._members[rid]
        self.num_members -= 1
        del self._rows[rid]
        self._rows_tuple = None
        del self._buckets[-m.base % self._bs][rid]
        self._base_sum -= m.base

    def release(self, req: Request) -> None:
        """Take `req` out of the batch, written back (it is about to be preempted); a
        request that is not a member is left alone. O(1)."""
        m = self._members.get(req.request_id)
        if m is not None:
            self._leave(m)

    def dissolve(self, listed: dict[int, Request]) -> None:
        """Write every member back and hand it to `listed`. O(members)."""
        self.pending = False  # a step scheduled before this cannot be updated
        for m in self._members.values():
            self._write_back(m)
            listed[m.req.request_id] = m.req
        self._members.clear()
        self.num_members = 0
        self._rows.clear()
        self._rows_tuple = ()
        for bucket in self._buckets:
            bucket.clear()
        self._finishes.clear()
        self._base_sum = 0

    def sync(self) -> None:
        """Write every member's lengths back to its Sequence and block table (they stay
        members). O(members), once per tick."""
        if self._synced_tick != self._tick:
            for m in self._members.values():
                self._write_back(m)
            self._synced_tick = self._tick

    # ------------------------------------------------------------------ fast-forward
    def run_bound(self, running: dict[int, Request], listed: dict[int, Request], limit: int,
                  admits: Admits, offloads: bool = False) -> int:
        """How many of the next steps (at most `limit`) are certain to be plain decode
        steps for every running sequence — none finishes, none is short of memory or
        copies a block, all of them fit in one step, and nothing waiting can be admitted
        (`admits`). A run is taken with every running request a member (O(block_size))
        or none (O(sequences)): members that decode beside listed requests are dissolved
        into `listed` first (when no listed request is prefilling: no run then).

        `offloads`: the caller prices the copies to a host tier that a run's growth makes
        once the free list is spent (`run_offloads`); then a run of members may take
        evictable blocks too (`offload_room`). Otherwise it stops where the free list
        does: such a step's price is not the run's."""
        self.run_offloads = None
        if self._members and listed:
            if any(s.is_prefilling for r in listed.values() for s in r.seqs):
                return 0
            self.dissolve(listed)
        if self._members:  # O(block_size): the earliest finish off the heap, blocks by bucket
            finishes, members = self._finishes, self._members
            while finishes and (finishes[0][2] not in members
                                or members[finishes[0][2]].join_no != finishes[0][1]):
                heapq.heappop(finishes)  # stale: that member left
            tick, n = self._tick, len(members)
            k = min(limit, finishes[0][0] - tick - 1)
            if k <= 0 or n > self._max_run_seqs or admits(n):
                return 0
            # Step j of the run (at tick + j) takes one block per member of bucket
            # (tick + j) % block_size.
            free = self._bm.num_free_blocks_without_offload
            if k <= free // n * self._bs:
                return k  # memory for whole cycles of growth: the finish comes first
            served = self._steps_served(free, n, tick)
            if k <= served:
                return k
            room = self._bm.offload_room if offloads else 0
            if room:
                more = self._steps_served(free + room, n, tick)
                if more > served:
                    self.run_offloads = OffloadRun(
                        [len(self._buckets[(tick + j) % self._bs]) for j in range(self._bs)],
                        free, served)
                    return min(k, more)
            return served
        k = limit
        seq_ids = []
        max_len = self._max_model_len
        for req in running.values():
            if len(req.seqs) < req.n:
                return 0
            fresh_fork = req.n > 1
            for s in req.seqs:
                if s.finished:
                    continue
                if s.num_computed_tokens != s.num_tokens - 1 or s.num_computed_tokens < s.prefill_len:
                    return 0  # still prefilling
                if s.num_output_tokens > 1:
                    fresh_fork = False
                # a sample finishes in the step that draws its last token
                k = min(k, req.output_len - s.num_output_tokens - 1, max_len - s.num_tokens - 1)
                seq_ids.append(s.seq_id)
            if fresh_fork:
                return 0  # its first decode copies the shared last block
        if k <= 0 or len(seq_ids) > self._max_run_seqs or admits(len(seq_ids)):
            return 0
        uniform_growth = getattr(self._bm, "max_uniform_growth", None)   # a capability
        return uniform_growth(seq_ids, k) if uniform_growth is not None else 0

    def _steps_served(self, blocks: int, n: int, tick: int) -> int:
        """How many steps from `tick` the n members' growth takes at most `blocks` blocks
        in all: k = q·block_size + r steps take q·n blocks plus the first r buckets of
        the cycle."""
        bs, buckets = self._bs, self._buckets
        q, spare = divmod(blocks, n)
        r = 0
        while r < bs - 1:
            spare -= len(buckets[(tick + r) % bs])
            if spare < 0:
                break
            r += 1
        return q * bs + r

    def advance(self, num_steps: int, running: dict[int, Request],
                on_service: Callable[[Request, int, int], None] | None) -> None:
        """Apply `num_steps` plain decode steps at once (`run_bound` allowed at least that
        many, and no step since). Per-sequence cost O(1), not O(steps); `on_service`,
        if given, is charged each request's tokens when none is a member."""
        bm = self._bm
        if self._members:
            # run_bound allows a run with members only when nothing else runs
            start = self._tick
            self._tick = tick = start + num_steps
            bs = self._bs
            # only members whose slots crossed a block boundary during the run grow now
            growing = self._members.values() if num_steps >= bs else [
                m for j in range(num_steps) for m in self._buckets[(start + j) % bs].values()]
            growing = [m for m in growing if m.base + tick > m.bm_tokens]
            if bm.append_slots_many([(m.seq.seq_id, m.base + tick - m.bm_tokens) for m in growing]):
                raise SchedulerError("a fast-forward needed a block copy")
            for m in growing:
                m.bm_tokens = m.base + tick
            return
        for req in running.values():
            live = 0
            for s in req.seqs:
                if s.finished:
                    continue
                if bm.append_slots(s.seq_id, num_steps):
                    raise SchedulerError(f"fast-forward of {s.seq_id} needed a block copy")
                s.num_tokens += num_steps
                s.num_computed_tokens += num_steps
                s.num_output_tokens += num_steps
                live += 1
            if on_service is not None:
                on_service(req, 0, live * num_steps)

    def decode_shape(self, running: dict[int, Request]) -> tuple[int, int]:
        """(sequences, Σ (context + 1)) of the next step if every running sequence
        decodes one token: the first step of a decode run (after `run_bound`: all
        running requests are members, or none). O(1) when all are members."""
        if self._members:
            n = len(self._members)
            return n, self._base_sum + n * (self._tick + 1)
        num_seqs = context = 0
        for req in running.values():
            for seq in req.seqs:
                if not seq.finished:
                    num_seqs += 1
                    context += seq.num_computed_tokens
        return num_seqs, context + num_seqs


class _Member:
    """A batched decoding sequence. At tick t (the batch's count of steps) its Sequence
    holds num_computed_tokens = base + t, num_tokens = base + t + 1 and
    num_output_tokens = out_base + t; the fields are written back only when needed.
    `bm_tokens` is what the block manager holds (it catches up at block boundaries);
    the update that moves the tick to `finish_tick` draws its last token."""

    __slots__ = ("req", "seq", "base", "out_base", "bm_tokens", "finish_tick", "join_no")

    def __init__(self, req: Request, seq: Sequence, base: int, out_base: int, bm_tokens: int,
                 finish_tick: int, join_no: int) -> None:
        self.req, self.seq, self.base, self.out_base = req, seq, base, out_base
        self.bm_tokens, self.finish_tick, self.join_no = bm_tokens, finish_tick, join_no


class OffloadRun:
    """The copies to the host tier of a decode run whose growth outlasts the free list
    (`DecodeBatch.run_bound` with offloads): step j of the run takes counts[j % cycle]
    blocks; the first `free` blocks of the run come off the free list, every later one
    is an evictable block copied to the host before its step. A step's copies are one
    batched transfer, as `CostModel.step_time` prices them: the link's latency plus a
    time per block. O(cycle) to build, O(1) per question."""

    __slots__ = ("_cycle", "_per_cycle", "_taken", "_copying", "_free", "_first")

    def __init__(self, counts: list[int], free: int, first: int) -> None:
        self._cycle = len(counts)
        self._taken = list(accumulate(counts, initial=0))
        self._per_cycle = self._taken[-1]
        self._copying = list(accumulate((c > 0 for c in counts), initial=0))
        self._free = free
        self._first = first
        """The run's first step that copies (the free list serves the steps before it)."""

    def blocks(self, num_steps: int) -> int:
        """Blocks the first `num_steps` steps copy to the host."""
        q, r = divmod(num_steps, self._cycle)
        return max(0, q * self._per_cycle + self._taken[r] - self._free)

    def copying_steps(self, num_steps: int) -> int:
        """How many of the first `num_steps` steps copy anything: from the first that
        does, every one that takes a block."""
        return max(0, self._copying_before(num_steps) - self._copying_before(self._first))

    def _copying_before(self, num_steps: int) -> int:
        q, r = divmod(num_steps, self._cycle)
        return q * self._copying[-1] + self._copying[r]

    def seconds(self, num_steps: int, latency_s: float, block_s: float) -> float:
        """The copies' time over the first `num_steps` steps."""
        return self.copying_steps(num_steps) * latency_s + self.blocks(num_steps) * block_s
