"""The scheduler core: iteration-level (continuous) batching under a token budget.

Every step, `schedule(now)` decides which sequences compute how many tokens (as much of
each request's work as fits in what is left of the step: `StepBudget`, policies/budget.py),
which running requests are preempted, and which waiting requests are admitted; the
executor runs that; `update(output, result)` advances the requests. The scheduler is
pure: it never reads a clock or a random source, so the same calls give the same outputs.

Step composition (SchedulerConfig.step_composition): decode_first (Sarathi-Serve's
stall-free batching: running requests first, waiting ones admitted into what is left) or
prefill_first (vLLM v0 without chunking: a step with prefill work holds only prefills).

An arrival passes the admission stage first (policies/admission_control.py: tenant limits
and rates, shedding by tier). A request is admitted only if its whole prompt (after a
recompute preemption, prompt + generated tokens) gets blocks (`KVAdmission`); decodes
append one slot per step. When a running sequence cannot get its slot, the policy's victim
is preempted (policies/preempting.py) by recompute or swap (policies/preemption.py); a
step that preempted anything admits nothing new and swaps nothing in.

This is the plain scheduler, which the real backend runs. The simulator runs its
speed-layer subclass, simulator/speed/scheduler.py `BatchingScheduler`, which advances
plain decodes in bulk and fast-forwards runs of decode steps while deciding exactly as
this one does (tests/test_scheduler_properties.py); the methods it overrides are marked
"speed layer hook" below.
"""
from __future__ import annotations

from servelab.config import SchedulerConfig
from servelab.memory.base import AllocStatus, BlockManager
from servelab.outputs import NO_WORK, ScheduledSeq, ScheduledWork, SchedulerOutput, StepResult
from servelab.policies.admission import KVAdmission
from servelab.policies.admission_control import AdmissionControl
from servelab.policies.base import Policy, SchedulerError
from servelab.policies.budget import StepBudget
from servelab.policies.kv_imports import KVImports
from servelab.policies.lookahead import SpeculativeSteps
from servelab.policies.preempting import Preempting
from servelab.policies.preemption import make_preemption
from servelab.records import RequestRecord
from servelab.request import Request, RequestStatus, Sequence

__all__ = ["Scheduler", "SchedulerError"]


class Scheduler(Preempting, SpeculativeSteps, KVImports):
    """Continuous batching over a block manager, ordered by a policy (preemption and
    swap-in: `Preempting`, policies/preempting.py; a speculating engine's verify steps:
    `SpeculativeSteps`, policies/lookahead.py; requests whose KV was imported:
    `KVImports`, policies/kv_imports.py).

    `emit_block_tables=True` fills SchedulerOutput.block_tables (the real backend needs
    them; the simulator does not, and copying tables costs O(blocks) per sequence).
    `keep_token_times=True` records every token time of sample 0 (for exact ITL).
    """

    _admission_class: type[KVAdmission] = KVAdmission
    """The memory side of admission (speed layer hook: a memo of refusals)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, policy: Policy, *,
                 enable_prefix_caching: bool = False, emit_block_tables: bool = False,
                 keep_token_times: bool = False) -> None:
        self.config = config
        self.bm = block_manager
        self.policy = policy
        self.prefix_caching = enable_prefix_caching
        self.emit_block_tables = emit_block_tables
        self.keep_token_times = keep_token_times
        self._charges_service = policy.charges_service
        self._preemption = make_preemption(config.preemption)
        self.block_size = block_manager.block_size
        self._requests: dict[int, Request] = {}    # added, not yet finished or rejected
        self._imports: set[int] = set()            # waiting imports: they hold blocks already
        self._running: dict[int, Request] = {}     # insertion order = admission order
        self.swapped: dict[int, Request] = {}      # insertion order = swap-out order
        self._admit_seq: dict[int, int] = {}
        self._next_admit = 0
        self._growth_preempted = False
        self._pending_rejects: list[tuple[int, str]] = []
        self._finished_records: list[RequestRecord] = []
        self._scheduled: SchedulerOutput | None = None   # the step update() expects
        self._scheduled_listed: list[ScheduledSeq] = []
        self.num_preemptions = 0
        # A static batch runs until all its members finish: nothing preempts it for a
        # waiting request (which could not join it anyway).
        self._may_preempt = policy.preemptive and config.batching != "static"
        spec = config.speculative
        self._spec_k = spec.num_speculative_tokens if spec.enabled else 0
        """K of a speculating engine (0: no speculation)."""
        self._ahead: dict = {}
        """Speculation: seq id -> lookahead slots it holds (policies/lookahead.py)."""
        self._kv = self._admission_class(config, block_manager, prefix_caching=enable_prefix_caching)
        # the admission stage before the policy: rate limits and shedding, when configured
        self._control = AdmissionControl(config.admission) if config.admission.enabled else None
        if policy.reads_prefix_cache:
            policy.attach_prefix_probe(self._kv.cached_tokens)
        self._host_tier = block_manager.num_host_blocks > 0

    # ------------------------------------------------------------------ arrivals
    def add_request(self, req: Request, now: float) -> bool:
        """Admission control at arrival: a request that can never fit, the waiting-queue
        limit, then the admission stage. Returns False if the request was rejected (it
        then appears in the next SchedulerOutput.rejected and in the records)."""
        if req.request_id in self._requests:
            raise SchedulerError(f"request {req.request_id} was already added")
        if req.status is not RequestStatus.WAITING:
            raise SchedulerError(f"request {req.request_id} is {req.status.value}, not new")
        reason = self._kv.never_fits(req)
        if reason is None and self.config.waiting_queue_limit is not None \
                and len(self.policy) >= self.config.waiting_queue_limit:
            reason = f"waiting queue full ({self.config.waiting_queue_limit} requests)"
        if reason is None and self._control is not None:
            reason = self._control.refusal(req, now)
        if reason is not None:
            self._reject(req, reason, now)
            return False
        self._requests[req.request_id] = req
        if req.seqs[0].num_computed_tokens and self.bm.has_seq(req.seqs[0].seq_id):
            self._imports.add(req.request_id)   # KV computed elsewhere (policies/admission.py)
        self.policy.add(req, now)
        return True

    def _reject(self, req: Request, reason: str, now: float,
                out: SchedulerOutput | None = None) -> None:
        """Reject for good; reported in `out` (or in the next output) and the records."""
        self._requests.pop(req.request_id, None)
        self._imports.discard(req.request_id)
        req.status = RequestStatus.REJECTED
        req.reject_reason = reason
        req.finish_s = now
        (out.rejected if out is not None else self._pending_rejects).append((req.request_id, reason))
        self._finished_records.append(RequestRecord.from_request(req))

    # ------------------------------------------------------------------ queries
    @property
    def running(self) -> dict[int, Request]:
        """Running requests in admission order (speed layer hook: it brings their
        sequences up to date first)."""
        return self._running

    @property
    def requests(self) -> dict[int, Request]:
        """Every request added and not yet finished or rejected, by id (speed layer hook,
        as `running`). A request is let go once its record is out."""
        return self._requests

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self._running or self.swapped or len(self.policy))

    def pop_records(self) -> list[RequestRecord]:
        """Records of requests that finished or were rejected since the last call."""
        out, self._finished_records = self._finished_records, []
        return out

    # ------------------------------------------------------------------ schedule
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(now)
        if self._pending_rejects:
            out.rejected, self._pending_rejects = self._pending_rejects, []
        self._growth_preempted = False
        step = StepBudget(self.config)
        # memory freed for the waiting head is not handed to swapped requests first
        freed_for_head = self._preempt_for_waiting(now, out)
        if self.config.step_composition == "prefill_first":
            self._schedule_running(now, out, step, prefill=True)
            self._admit(now, out, step)
            if not step.entries:
                self._schedule_running(now, out, step, prefill=False)
                if not freed_for_head:
                    self._swap_in(now, out, step)
        else:
            self._schedule_running(now, out, step, prefill=None)
            if not freed_for_head:
                self._swap_in(now, out, step)
            self._admit(now, out, step)
        listed: list[ScheduledSeq] = []
        for entries in step.entries.values():
            listed.extend(entries)
        out.scheduled = self._work(listed)
        if self._host_tier:   # the copies this step's allocations and evictions imply
            out.offload, out.load = self.bm.take_transfers()
        if self.emit_block_tables:
            table = self.bm.block_table
            out.block_tables = {e.seq_id: table(e.seq_id) for e in out.scheduled}
        if not (out.scheduled or out.swap_in or out.preempted or out.rejected) \
                and self.has_unfinished():
            self._stalled(now)
        self._scheduled, self._scheduled_listed = out, listed
        return out

    def _work(self, listed: list[ScheduledSeq]) -> ScheduledWork:
        """The step's work, one entry per sequence (speed layer hook)."""
        return ScheduledWork(listed) if listed else NO_WORK

    def _step_order(self, step: StepBudget, prefill: bool | None, out: SchedulerOutput) -> list[Request]:
        """The running requests a pass of `_schedule_running` lists, most protected first
        (speed layer hook: it takes its batched decodes' part of `step` first)."""
        return self._running_order(self._running)

    def _running_order(self, requests: dict[int, Request]) -> list[Request]:
        """Running requests, most protected first (ascending victim key), so that the
        victim — taken from the end — is always one not yet scheduled this step."""
        adm = self._admit_seq
        if self.policy.victims_by_admission:
            if requests is self._running:
                return list(requests.values())  # admission order is the victim order
            return sorted(requests.values(), key=lambda r: adm[r.request_id])
        key = self.policy.victim_key
        return sorted(requests.values(), key=lambda r: key(r, adm[r.request_id]))

    def _schedule_running(self, now, out, step: StepBudget, prefill) -> None:
        """Schedule running requests; `prefill` selects those still prefilling (True),
        decoding (False) or both (None). A sequence that cannot get its next slot makes
        the scheduler preempt from the end of the order — possibly the request itself."""
        order = self._step_order(step, prefill, out)
        end = len(order)
        spec_k = self._spec_k
        if spec_k and self.config.speculative.max_batch is not None \
                and len(self._running) > self.config.speculative.max_batch:
            spec_k = 0   # above the batch size where speculation stops paying: plain decodes
        i = 0
        while i < end:
            req = order[i]
            i += 1
            if req.request_id in step.entries:
                continue
            if prefill is not None and any(s.is_prefilling for s in req.seqs
                                           if not s.finished) != prefill:
                continue
            if step.tokens <= 0 or step.seqs <= 0:
                break
            seqs = req.seqs
            if self._spec_k and len(seqs) == 1 and not seqs[0].is_prefilling and not seqs[0].finished:
                end = self._schedule_verify(req, seqs[0], spec_k, order, i, end, now, out, step)
                if end is None:
                    return
                continue
            entries = step.plan(req, allocated=True)
            if entries is None:
                continue
            end = self._grow(req, entries, order, i, end, now, out)
            if end is None:
                break  # the request preempted itself: nothing left to free
            step.commit(req, entries)

    def _grow(self, req, entries, order, i, end, now, out) -> int | None:
        """Give each decoding sequence of `req` its next slot (see `_make_room`).
        A multi-sample request that runs out halfway, with some samples already grown,
        is preempted by recompute (a swapped copy would keep slots its samples never
        used)."""
        bm = self.bm
        grown = 0
        for e in entries:
            if e.is_prefill:
                continue
            if not bm.can_append_slots(e.seq_id, 1):
                end = self._make_room(e.seq_id, req, order, i, end, now, out, allow_swap=grown == 0)
                if end is None:
                    return None
            out.copies.extend(bm.append_slots(e.seq_id, 1))
            grown += 1
        return end

    def _set_running(self, req: Request) -> None:
        """(speed layer hook)"""
        req.status = RequestStatus.RUNNING
        self._running[req.request_id] = req
        self._admit_seq[req.request_id] = self._next_admit
        self._next_admit += 1

    def _stop_running(self, rid: int) -> None:
        """Forget a running request (finished or preempted; speed layer hook)."""
        del self._running[rid]
        del self._admit_seq[rid]

    # ------------------------------------------------------------------ admission
    def _admit(self, now, out, step: StepBudget) -> None:
        """Admit waiting requests in policy order while they fit; stop at the first
        that does not (no skipping ahead: the policy's order is a guarantee). A step in
        which running requests ran out of memory admits nothing (vLLM's rule); memory
        freed by a preemptive policy for the waiting head is used at once."""
        if self._growth_preempted:
            return
        if self.config.batching == "static" and (self._running or self.swapped):
            return
        policy, kv = self.policy, self._kv
        seats = None
        while step.tokens > 0 and step.seqs > 0:
            req = policy.peek(now)
            if req is None:
                return
            if seats is None:
                # max_num_seqs bounds the running sequences, scheduled this step or not
                seats = self.config.max_num_seqs - self._num_running_seqs()
            live = sum(1 for s in req.seqs if not s.finished)
            if live > seats:
                return
            if (self._running or self.swapped) and kv.known_later(req):
                return  # still waiting for memory: allocating would say LATER again
            if step.plan(req, allocated=False) is None:
                return
            status = kv.allocate(req)
            if status is AllocStatus.LATER and (self._running or self.swapped):
                return
            if status is AllocStatus.LATER and self._imports:
                self._start_imports(now, step, seats)   # they hold what the head needs
                return
            if status is not AllocStatus.OK:
                # NEVER, or LATER with nothing running that could free memory.
                policy.remove(req)
                kv.forget(req)
                if self._control is not None:
                    self._control.left(req)
                self._reject(req, "needs more KV blocks than the cache holds"
                             if status is AllocStatus.NEVER else
                             "does not fit in an empty KV cache", now, out)
                continue
            policy.remove(req)
            self._start(req, now, step)
            seats -= live

    def _start(self, req: Request, now, step: StepBudget) -> None:
        """A waiting request whose blocks are allocated starts running this step."""
        self._imports.discard(req.request_id)
        self._set_running(req)
        if self._control is not None:
            self._control.started(req, now)
        entries = step.plan(req, allocated=True)  # prefix hits cut the work
        step.commit(req, entries)

    def _num_running_seqs(self) -> int:
        """Live sequences of the running requests (speed layer hook)."""
        return sum(1 for r in self._running.values() for s in r.seqs if not s.finished)

    def _stalled(self, now: float) -> None:
        """A step with nothing to run while requests remain would spin forever: with
        correct admission control it cannot happen, so it is reported as a bug."""
        head = self.policy.peek(now)
        raise SchedulerError(
            f"no progress at t={now}: {len(self._running)} running, {len(self.swapped)} "
            f"swapped, {len(self.policy)} waiting (head: "
            f"{head.request_id if head else None}), {self.bm.num_free_blocks} free blocks")

    # ------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, result: StepResult) -> list[RequestRecord]:
        """Advance every scheduled sequence by the step's work; returns the records of
        requests that finished or were rejected in this step. `out` must be the output
        of the last schedule(), updated once. O(scheduled sequences). Sequences that
        finish in one step free their blocks in seq-id order (with prefix caching, that
        order is the LRU order of their blocks), however the step listed them."""
        self._take_scheduled(out)
        ended: list[Request] = []
        freed: list = []
        service: dict[int, list[int]] | None = {} if self._charges_service else None
        t_end = out.now + result.duration_s
        self._advance_listed(out, result, t_end, ended, freed, service)
        self._end(ended, freed, service, t_end)
        return self.pop_records()

    def _take_scheduled(self, out: SchedulerOutput) -> None:
        if out is not self._scheduled:
            raise SchedulerError("update() for an output that is not the one the last "
                                 "schedule() made, or that was updated already")
        self._scheduled = None

    def _advance_listed(self, out: SchedulerOutput, result: StepResult, t_end: float,
                        ended: list[Request], freed: list, service: dict | None) -> None:
        """Advance the sequences the step listed; those that finish go to `ended` (their
        requests) and `freed` (their seq ids); `service` collects (prefill tokens, tokens
        drawn) per request when the policy charges service."""
        bm, running = self.bm, self._running
        sampled, stopped = result.sampled, result.stopped
        max_len = self.config.max_model_len
        commit = self.prefix_caching
        keep_times = self.keep_token_times
        for e in self._scheduled_listed:
            rid = e.request_id
            req = running.get(rid)
            if req is None:
                raise SchedulerError(f"update() for request {rid}, which is not running")
            if req.scheduled_s is None:
                req.scheduled_s = out.now
            seq = req.seqs[e.seq_id[1]]
            if self._spec_k and not e.is_prefill and req.n == 1:
                self._advance_verified(req, seq, e, result, t_end, ended, freed, service)
                continue
            seq.num_computed_tokens += e.num_tokens
            if service is not None:
                acc = service.get(rid)
                if acc is None:
                    acc = service[rid] = [0, 0]
                if e.is_prefill:
                    acc[0] += e.num_tokens
                acc[1] += e.num_samples
            if e.is_prefill and commit:
                bm.mark_computed(seq.seq_id, seq.num_computed_tokens)
            if not e.num_samples:
                continue
            if e.num_samples > 1:
                self._fork(req, seq)
                targets = req.seqs
            else:
                targets = (seq,)
            tokens = sampled[e.seq_id] if sampled is not None else None
            for i, s in enumerate(targets):
                s.num_tokens += 1
                s.num_output_tokens += 1
                if tokens is not None:
                    s.output_token_ids.append(tokens[i])
                if s.num_output_tokens >= req.output_len or s.num_tokens >= max_len \
                        or (stopped and s.seq_id in stopped):
                    s.finished = True
                    freed.append(s.seq_id)
                    ended.append(req)
            if req.first_token_s is None:
                req.first_token_s = t_end
            if keep_times and seq.seq_id[1] == 0:
                if req.token_times is None:
                    req.token_times = []
                req.token_times.append(t_end)

    def _end(self, ended: list[Request], freed: list, service: dict | None, t_end: float) -> None:
        """Free the finished sequences, charge service, and finish the requests whose
        every sample has ended."""
        if freed:
            for sid in sorted(freed) if len(freed) > 1 else freed:
                self.bm.free(sid)
            if self._ahead:
                for sid in freed:
                    self._ahead.pop(sid, None)
        if service:
            requests, on_service = self._requests, self.policy.on_service
            for rid, (pre, drawn) in service.items():
                on_service(requests[rid], pre, drawn)
        running = self._running
        for req in ended:
            if req.request_id in running and len(req.seqs) == req.n \
                    and all(s.finished for s in req.seqs):
                req.status = RequestStatus.FINISHED
                req.finish_s = t_end
                self._stop_running(req.request_id)
                del self._requests[req.request_id]
                self._finished_records.append(RequestRecord.from_request(req))

    def _fork(self, req: Request, parent: Sequence) -> None:
        for i in range(len(req.seqs), req.n):
            child = Sequence((req.request_id, i), parent.num_tokens, parent.num_computed_tokens,
                             parent.prefill_len)
            self.bm.fork(parent.seq_id, child.seq_id)
            req.seqs.append(child)
