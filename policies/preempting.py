"""How the scheduler makes room: preemption, and bringing swapped requests back.

A running sequence that cannot get its next KV slot makes the scheduler preempt running
requests from the end of the step's order (the policy's victims, not yet scheduled this
step) until it can (`_make_room`); alone and still too big for the whole cache, the
request is aborted. A preemptive policy may also preempt, before anything runs, for the
waiting head (`_preempt_for_waiting`), only when that frees enough for the head to be
admitted. What a victim gets, recompute or swap, is the preemption strategy's choice
(policies/preemption.py). Swapped requests come back oldest first (`_swap_in`).

The methods here are part of `Scheduler` (policies/scheduler.py), kept apart because
they are one idea of their own; `_victims_for` is a speed layer hook
(simulator/speed/scheduler.py).
"""
from __future__ import annotations

from servelab.outputs import PreemptionMode, SchedulerOutput
from servelab.policies.budget import StepBudget
from servelab.request import Request, RequestStatus

__all__ = ["Preempting"]


class Preempting:
    """The preemption and swap-in part of `Scheduler` (a mixin: it uses the scheduler's
    `bm`, `policy`, `_kv`, `_running`, `swapped`, `_preemption` and bookkeeping)."""

    def _make_room(self, sid, req, order, i, end, now, out, allow_swap, slots: int = 1) -> int | None:
        """Preempt from the end of `order` (positions i..end-1 are not scheduled yet)
        until `sid` can get `slots` more slots. Returns the new end, or None if `req`
        itself had to go: preempted, or aborted when it is alone and still cannot grow (it
        outgrew the whole cache and would otherwise be preempted forever) — unless waiting
        imports hold blocks, which they give back once they have run."""
        self._growth_preempted = True
        while not self.bm.can_append_slots(sid, slots):
            if end > i:
                end -= 1
                self._preempt(order[end], now, out)
            elif len(self._running) == 1 and not self._imports:
                self._abort(req, now, out)
                return None
            else:
                self._preempt(req, now, out, allow_swap=allow_swap)
                return None
        return end

    def _preempt(self, req: Request, now, out: SchedulerOutput, allow_swap: bool = True) -> None:
        """Preempt a running request not scheduled in this step, as the preemption
        strategy decides: swap its KV out, or recompute (free the KV; back to the
        waiting queue, where its unchanged key puts it ahead of later arrivals)."""
        rid = req.request_id
        self._stop_running(rid)
        seq_ids = [s.seq_id for s in req.seqs if not s.finished]
        mode = self._preemption.outcome(req, seq_ids, self.bm, allow_swap)
        if mode is PreemptionMode.SWAP:
            out.swap_out.extend(self.bm.swap_out(seq_ids))
            req.status = RequestStatus.SWAPPED
            self.swapped[rid] = req
        else:
            for s in req.seqs:
                if not s.finished:
                    self.bm.free(s.seq_id)
                    s.num_computed_tokens = 0
                    if self._ahead:
                        self._ahead.pop(s.seq_id, None)
            req.status = RequestStatus.PREEMPTED
            self.policy.requeue(req, now)
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append((rid, mode))

    def _abort(self, req: Request, now, out: SchedulerOutput) -> None:
        """End a running request that outgrew the whole KV cache."""
        self._stop_running(req.request_id)
        for s in req.seqs:
            if not s.finished:
                self.bm.free(s.seq_id)
                self._ahead.pop(s.seq_id, None)
        tokens = max(s.num_tokens for s in req.seqs)
        self._reject(req, f"grew to {tokens} tokens, beyond what the whole KV cache holds", now, out)

    def _preempt_for_waiting(self, now, out) -> bool:
        """Preemptive policies: before anything runs, free memory for the waiting head
        by preempting running requests the policy allows, worst victim first — only if
        that frees enough for the head to be admitted (a preemption that cannot make room
        would be repeated step after step for nothing). True if anything was preempted."""
        if not self._may_preempt:
            return False
        head = self.policy.peek(now)
        if head is None or not self._running or self._kv.would_fit(head):
            return False
        victims = self._victims_for(head)
        if not victims:
            return False
        running, policy = self.running, self.policy
        key, adm, kv = policy.victim_key, self._admit_seq, self._kv
        if not kv.would_fit(head, extra_free=kv.freeable_blocks(victims, running)):
            return False
        preempted = False
        # the worst victim first, as long as the head does not fit (nothing runs meanwhile,
        # so the keys stay as they are: one sort, not a max per victim)
        for victim in sorted(running.values(), key=lambda r: key(r, adm[r.request_id]), reverse=True):
            if kv.would_fit(head) or not policy.may_preempt_for(head, victim):
                break
            self._preempt(victim, now, out)
            preempted = True
        return preempted

    def _victims_for(self, head: Request) -> list[Request]:
        """Running requests the policy allows to be preempted for `head` (speed layer
        hook: it remembers a head that may preempt none). O(running)."""
        policy = self.policy
        return [r for r in self.running.values() if policy.may_preempt_for(head, r)]

    def _swap_in(self, now, out, step: StepBudget) -> None:
        """Bring swapped requests back, oldest swap first, unless running requests ran
        out of memory this step. Under a preemptive policy, while the waiting head fits in
        the free memory, a request it may preempt stays out (and so do those swapped after
        it): the memory is the head's, and a request brought back into it would only be
        preempted again for the head, step after step."""
        if self._growth_preempted or not self.swapped:
            return
        bm, kv = self.bm, self._kv
        head = self.policy.peek(now) if self._may_preempt else None
        if head is not None and not kv.would_fit(head):
            head = None
        for rid in list(self.swapped):
            req = self.swapped[rid]
            if head is not None and self.policy.may_preempt_for(head, req):
                return
            if not kv.can_swap_in(req, beside_running=bool(self._running)):
                return
            entries = step.plan(req, allocated=True)
            if entries is None:
                return
            out.swap_in.extend(kv.swap_in(req))
            del self.swapped[rid]
            self._set_running(req)
            ran = []
            for e in entries:
                if not e.is_prefill and not (self._spec_k and self._ahead.get(e.seq_id, 0)):
                    if not bm.can_append_slots(e.seq_id, 1):
                        continue  # back on the GPU but no room to grow: next step
                    out.copies.extend(bm.append_slots(e.seq_id, 1))
                    if self._spec_k and req.n == 1:
                        self._ahead[e.seq_id] = 1
                ran.append(e)
            if ran:
                step.commit(req, ran)
