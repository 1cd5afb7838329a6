"""Speed layer for `policies/scheduler.py` `Scheduler`: batched plain decodes, the
closed-form fast-forward, and memos of refusals.

`BatchingScheduler` decides exactly as the plain `Scheduler` it extends (property tests:
tests/test_scheduler_properties.py) and only changes what a decision costs:

- plain decodes (single-sample requests computing one token) are handed to a
  `DecodeBatch` (decode_batch.py) between steps, which advances them in bulk while the
  one-by-one path would give every running request its whole work, and hands them back
  whenever it would not;
- runs of plain decode steps are applied in closed form (`decode_run_bound`,
  `advance_decodes`, `decode_shape`): the simulator's fast-forward (simulator/engine.py);
- a waiting head that no running request may be preempted for is remembered
  (`_Refusals`), and so is the last admission refused for memory (`MemoKVAdmission`).

Capabilities it needs, checked by name: batching needs a block manager that declares
`grows_by_block` (block use then follows each sequence's length), and steps aside — every
request listed one by one, as the plain scheduler does — when the executor needs block
tables or token times per sequence, when the policy charges service per request, or when
the engine speculates (the reason in `batching_off`). The fast-forward needs to know which
waiting requests the policy could pick next: the head, for a policy with static keys, or
what a policy whose `order_moves` says through `candidates(now)`; without that it steps
aside (`waiting_candidates`), as it does for a speculating engine.
Requests are current whenever the scheduler shows them: to a policy, or through
`running` and `requests`.
"""
from __future__ import annotations

import math
from typing import Iterable

from servelab.config import SchedulerConfig
from servelab.memory.base import BlockManager
from servelab.outputs import ScheduledSeq, ScheduledWork, SchedulerOutput, StepResult
from servelab.policies.base import Policy, SchedulerError
from servelab.policies.budget import StepBudget
from servelab.policies.scheduler import Scheduler
from servelab.records import RequestRecord
from servelab.request import Request

from .admission import MemoKVAdmission
from .decode_batch import DecodeBatch, OffloadRun

__all__ = ["BatchingScheduler", "tokens_until_preemptible", "waiting_candidates"]


def waiting_candidates(policy: Policy, now: float) -> list[Request] | None:
    """Every waiting request `policy.peek` could return while no request is added or
    removed (time and service may pass), or None if the policy cannot say: the head of a
    policy with static keys; `candidates(now)` of one whose `order_moves`
    (policies/base.py), where it defines it."""
    if not policy.order_moves:
        head = policy.peek(now)
        return [head] if head is not None else []
    candidates = getattr(policy, "candidates", None)
    return candidates(now) if candidates is not None else None


def tokens_until_preemptible(policy: Policy, heads: list[Request], running: Iterable[Request]) -> float:
    """How many more tokens every running request may draw before one of the waiting
    `heads` may preempt one of them: unbounded under a policy whose `may_preempt_for`
    does not change as requests draw tokens; what a policy that `reorders_running` says
    (`tokens_until_preemptible`, policies/base.py), or 0 if it cannot say."""
    if not policy.reorders_running:
        return math.inf
    until = getattr(policy, "tokens_until_preemptible", None)
    return until(heads, running) if until is not None else 0


class _Refusals:
    """The scheduler's memory of the last waiting head that no running request may be
    preempted for (`Scheduler._preempt_for_waiting`), kept while that cannot change
    (`Policy.may_preempt_for` depends on the two requests alone): the same head waits;
    no request was admitted or swapped in since (`admissions`: a new running request may
    be a victim, one that leaves cannot make one); and, under a policy that
    `reorders_running`, no running request can have drawn the tokens it must draw before
    it may be preempted. `clock` counts those tokens: the most a running sequence can have
    drawn since the scheduler began (each step adds the most that one sequence draws in
    it: 1, or 1 + K when speculating; a fast-forwarded run adds its steps)."""

    __slots__ = ("clock", "_head", "_admissions", "_until")

    def __init__(self) -> None:
        self.clock = 0
        self._head: Request | None = None
        self._admissions = self._until = 0

    def remember(self, head: Request, admissions: int, tokens: float) -> None:
        """`head` may preempt no running request until one has drawn `tokens` more."""
        self._head, self._admissions, self._until = head, admissions, self.clock + tokens

    def holds(self, head: Request, admissions: int) -> bool:
        return head is self._head and admissions == self._admissions and self.clock < self._until


class BatchingScheduler(Scheduler):
    """The plain scheduler with plain decodes batched and runs of them fast-forwarded.
    `batch_decodes=False` lists every decode one by one (for comparison)."""

    _admission_class = MemoKVAdmission

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, policy: Policy, *,
                 enable_prefix_caching: bool = False, emit_block_tables: bool = False,
                 keep_token_times: bool = False, batch_decodes: bool = True) -> None:
        super().__init__(config, block_manager, policy, enable_prefix_caching=enable_prefix_caching,
                         emit_block_tables=emit_block_tables, keep_token_times=keep_token_times)
        self._listed: dict[int, Request] = {}   # running, not in the batch (any order)
        self._refusals = _Refusals()
        self.batching_off = _batching_off(config, block_manager, policy, emit_block_tables,
                                          keep_token_times, batch_decodes)
        """Why plain decodes are listed one by one in this scheduler, or None."""
        self._batch = DecodeBatch(config, block_manager, enabled=self.batching_off is None)

    # ------------------------------------------------------------------ hooks
    @property
    def running(self) -> dict[int, Request]:
        """Running requests in admission order, their sequences current (batched ones
        are written back first: O(batched sequences) once per step)."""
        self._batch.sync()
        return self._running

    @property
    def requests(self) -> dict[int, Request]:
        self._batch.sync()
        return self._requests

    def schedule(self, now: float) -> SchedulerOutput:
        self._batch.pending = False  # a step that was never updated is forgotten
        return super().schedule(now)

    def _work(self, listed: list[ScheduledSeq]) -> ScheduledWork:
        return self._batch.work(listed)

    def _step_order(self, step: StepBudget, prefill: bool | None, out: SchedulerOutput) -> list[Request]:
        """The batch takes its members' part first, or hands them back to be listed."""
        batch = self._batch
        if batch.num_members and batch.take_step(self._listed, step, prefill, out.copies):
            return self._running_order(self._listed) if self._listed else []
        return self._running_order(self._running)

    def _victims_for(self, head: Request) -> list[Request]:
        """A head that no running request may be preempted for is remembered
        (`_Refusals`): asking again costs O(running) and gets the same answer until
        something it depends on changes."""
        if self._refusals.holds(head, self._next_admit):
            return []
        victims = super()._victims_for(head)
        if not victims:
            tokens = tokens_until_preemptible(self.policy, [head], self.running.values())
            self._refusals.remember(head, self._next_admit, tokens)
        return victims

    def _preempt(self, req: Request, now, out: SchedulerOutput, allow_swap: bool = True) -> None:
        self._batch.release(req)  # a member leaves the batch, written back
        super()._preempt(req, now, out, allow_swap)

    def _set_running(self, req: Request) -> None:
        super()._set_running(req)
        self._listed[req.request_id] = req

    def _stop_running(self, rid: int) -> None:
        super()._stop_running(rid)
        self._listed.pop(rid, None)

    def _num_running_seqs(self) -> int:
        return self._batch.num_members + sum(
            1 for r in self._listed.values() for s in r.seqs if not s.finished)

    def update(self, out: SchedulerOutput, result: StepResult) -> list[RequestRecord]:
        """As the plain update; O(listed sequences + batched sequences that finish), or
        O(all scheduled) when the executor returns sampled tokens or stops. A plain
        decode that drew a token and goes on joins the batch."""
        self._take_scheduled(out)
        self._refusals.clock += 1 + self._spec_k
        ended: list[Request] = []
        freed: list = []
        service: dict[int, list[int]] | None = {} if self._charges_service else None
        t_end = out.now + result.duration_s
        batch = self._batch
        if batch.pending:
            batch.update(result.sampled, result.stopped, ended, freed)
        self._advance_listed(out, result, t_end, ended, freed, service)
        self._end(ended, freed, service, t_end)
        if batch.enabled:
            running, listed = self._running, self._listed
            for e in self._scheduled_listed:
                if e.num_samples == 1:
                    req = running.get(e.request_id)
                    if req is not None and req.n == 1 and not req.seqs[0].finished:
                        del listed[req.request_id]
                        batch.join(req)
        return self.pop_records()

    # ------------------------------------------------------------------ fast-forward
    def decode_run_bound(self, now: float, limit: int, offloads: bool = False) -> int:
        """How many of the next steps (at most `limit`) are certain to be plain decode
        steps — every running sequence decodes one token, and nothing is admitted,
        swapped, preempted, copied or finished — whatever time they take. Such a run can
        be advanced in closed form by `advance_decodes`, with exactly the effect of
        scheduling it step by step. Call it between update() and the next schedule().
        O(block_size + waiting candidates) when every running sequence is batched,
        otherwise O(running sequences) (see DecodeBatch.run_bound); O(running sequences)
        too under a preemptive policy that `reorders_running` while requests wait.

        `offloads`: the caller prices a run's copies to the host tier
        (`decode_run_offloads`), so the run may outlast the free list (see
        DecodeBatch.run_bound)."""
        self._batch.run_offloads = None
        self._check_between_steps("decode_run_bound")
        if self.swapped or self._pending_rejects or not self._running or limit <= 0 or self._spec_k:
            return 0   # a speculating engine's steps produce a drawn number of tokens each
        policy = self.policy
        candidates = waiting_candidates(policy, now) if len(policy) else []
        if candidates is None:
            return 0   # the policy cannot say which waiting request could come next
        k = self._batch.run_bound(self._running, self._listed, limit,
                                  lambda num_seqs: self._admits_while_decoding(candidates, num_seqs),
                                  offloads)
        if k > 0 and self._may_preempt and policy.reorders_running and candidates:
            # the run ends before a running request sinks to where a waiting one may preempt it
            k = min(k, tokens_until_preemptible(policy, candidates, self.running.values()))
        return k

    @property
    def decode_run_offloads(self) -> OffloadRun | None:
        """The host-tier copies of the run the last `decode_run_bound` allowed, step by
        step (None: it makes none)."""
        return self._batch.run_offloads

    def advance_decodes(self, num_steps: int) -> None:
        """Apply `num_steps` plain decode steps at once (`decode_run_bound` must have
        allowed at least that many). Per-sequence cost O(1), not O(steps). The run's
        copies to the host tier (`decode_run_offloads`) are the caller's to price: they
        are taken here, not handed to the next step."""
        self._check_between_steps("advance_decodes")
        self._refusals.clock += num_steps
        self._batch.advance(num_steps, self._running,
                            self.policy.on_service if self._charges_service else None)
        if self._host_tier:
            offloads, loads = self.bm.take_transfers()
            run = self._batch.run_offloads
            expected = run.blocks(num_steps) if run is not None else 0
            if len(offloads) != expected or len(loads):
                raise SchedulerError(f"a fast-forward of {num_steps} steps copied {len(offloads)} "
                                     f"blocks to the host tier and {len(loads)} back, not "
                                     f"{expected} and 0")
        self._batch.run_offloads = None

    def decode_shape(self) -> tuple[int, int]:
        """(sequences, Σ (context + 1)) of the next step if every running sequence
        decodes one token: the first step of a decode run. O(1) when all are batched."""
        return self._batch.decode_shape(self._running)

    def _check_between_steps(self, op: str) -> None:
        if self._batch.pending:
            raise SchedulerError(f"{op}() between schedule() and update(): the scheduled "
                                 "step must be updated first")

    def _admits_while_decoding(self, candidates: list[Request], num_seqs: int) -> bool:
        """Could one of the waiting `candidates` be admitted while `num_seqs` running
        sequences only decode? The rules of `_preempt_for_waiting` and `_admit`, for a
        fast-forward run."""
        if not candidates:
            return False
        # (a policy that reorders its running requests answered in decode_run_bound)
        if self._may_preempt and candidates and not self.policy.reorders_running:
            running, policy = self.running, self.policy  # current sequences for the policy
            # a preemptive policy may evict for a candidate once memory runs short
            if any(policy.may_preempt_for(head, r) for head in candidates for r in running.values()):
                return True
        return not self._kv.none_fits(candidates, num_seqs)


def _batching_off(config: SchedulerConfig, block_manager: BlockManager, policy: Policy,
                  emit_block_tables: bool, keep_token_times: bool, batch_decodes: bool) -> str | None:
    """Why plain decodes cannot be batched in this scheduler, or None if they can."""
    if not batch_decodes:
        return "turned off (batch_decodes=False)"
    if not getattr(block_manager, "grows_by_block", False):
        return f"the block manager ({type(block_manager).__name__}) does not grow by block"
    if emit_block_tables:
        return "the executor needs block tables per sequence"
    if keep_token_times:
        return "every token time is kept"
    if policy.charges_service:
        return f"the policy ({type(policy).__name__}) charges service per request"
    if config.speculative.enabled:
        return "the engine speculates"
    return None
