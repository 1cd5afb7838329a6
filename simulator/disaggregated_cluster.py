"""A prefill pool and a decode pool joined by KV links, in one SimPy environment.

    arrival ─(router)─► prefill replica: the prompt, and its first token, under that
        pool's scheduler ─► handoff: wait for a decode replica with room (the prompt's KV
        stays held on the prefill replica meanwhile) ─► land: blocks allocated there ─►
        the link (one SimPy resource per prefill replica, FIFO) ─► release the prefill
        blocks; the decode replica's scheduler admits the request as an import ─► decode

Both pools run the shared engine loop over the same `Scheduler`, policies and block
managers as a co-located cluster (`simulator/engine.py`). What is particular to each side
is small and stated here:

- Prefill side. A request whose output is longer than one token runs there as its
  prompt with one output token (vLLM's disaggregated prefill: the prefill instance
  produces the first token). When it finishes, its blocks are not freed but held
  (`HeldKV`, vLLM's connector `delay_free_blocks`) until its transfer completes: the
  back-pressure a full decode pool puts on the prefill pool. A prefill replica whose
  waiting requests cannot be admitted only because of held blocks, with nothing running,
  waits for a release (its scheduler would otherwise reject the head as not fitting an
  empty cache, which it is not).
- Decode side. A request is handed off in prefill-completion order (FIFO, no overtaking)
  to the least-loaded decode replica (outstanding requests, transfers to it included)
  whose block manager would admit its prompt and first token now (`can_allocate`, the
  check any admission makes: watermark or reservation for growth included), skipping a
  replica whose scheduler has a preempted request waiting for memory. Blocks are
  allocated there for it (it "lands"), the KV is sent, and on arrival the request joins
  that scheduler as an import (`policies/admission.py`): prompt computed, first token
  sampled, one token left to compute (the first token's KV), with its arrival, first
  token and preemption count carried over. Its record is the request's record.

A request of one output token finishes on its prefill replica; a request rejected there
is final there; one whose prompt can never fit a decode replica is rejected by a decode
scheduler (`never_fits`). Decode replicas step one by one (no fast-forward: an import may
land at any prefill step's end, which a closed-form run would have to foresee).
"""
from __future__ import annotations

import collections
from typing import Iterator, Sequence

import numpy as np
from simpy import Environment, Resource
from simpy.events import NORMAL, Event

from servelab.engine import EngineStep
from servelab.memory.base import AllocStatus
from servelab.policies import Scheduler
from servelab.record_table import RecordLog, RecordTable
from servelab.records import RequestRecord, StepRecord
from servelab.request import Request, RequestStatus
from servelab.simulator.cost_model import CostModel
from servelab.simulator.engine import (ArrivalFeed, PriorityTimeout, Progress, Replica, simulate_to_end,
                                       arrival_process)
from servelab.simulator.kv_handoff import (Handoff, HeldKV, decode_part, land, landing_status,
                                           prefill_part)
from servelab.simulator.links import LinkSpec
from servelab.simulator.router import Router, least_loaded
from servelab.traces.requests import TraceRequests


class PrefillReplica(Replica):
    """A replica of the prefill pool: hands finished prefills to the cluster, and waits
    for a release rather than step while only held blocks keep its queue out."""

    def __init__(self, env, index, scheduler, cost_model, feed, cluster, *,
                 async_scheduling: bool = False) -> None:
        if not isinstance(scheduler.bm, HeldKV):
            raise ValueError("a prefill replica's scheduler must hold its blocks through a HeldKV")
        super().__init__(env, index, scheduler, cost_model, feed, fast_forward=False,
                         async_scheduling=async_scheduling)
        self.cluster = cluster
        self.held: HeldKV = scheduler.bm
        self._released: Event | None = None

    def finished(self, step: EngineStep) -> Event | None:
        super().finished(step)
        self.cluster.prefilled(self, step.records)
        return self.env.process(self._until_unblocked()) if self._blocked() else None

    def ran_nothing(self, step: EngineStep) -> None:
        super().ran_nothing(step)
        self.cluster.prefilled(self, step.records)

    def idle(self) -> Iterator[Event]:
        yield from super().idle()
        yield from self._until_unblocked()

    def released(self) -> None:
        """Held blocks were freed: wake the engine if it waits for them."""
        wake, self._released = self._released, None
        if wake is not None:
            wake.succeed()

    def _until_unblocked(self) -> Iterator[Event]:
        while self._blocked():
            self._released = self.env.event()
            yield self._released

    def _blocked(self) -> bool:
        """Nothing runs, requests wait, blocks are held, and some waiting request the
        policy may pick next does not fit now (counted without prefix-cache hits, so a
        hit can at worst make it wait for one more release)."""
        sched = self.scheduler
        if sched.num_running or sched.num_swapped or not sched.num_waiting \
                or not self.held.num_held_blocks:
            return False
        bm = self.held
        return any(bm.can_allocate(r.seqs[0].num_tokens, (), max_total_tokens=r.prompt_len + r.max_tokens,
                                   expected_total_tokens=r.prompt_len + r.output_len)
                   is not AllocStatus.OK for r in _next_candidates(sched.policy, self.env.now))


def _next_candidates(policy, now: float) -> list:
    """The waiting requests the policy could pick next (all of them, if it cannot say)."""
    from servelab.simulator.speed import waiting_candidates
    candidates = waiting_candidates(policy, now)
    return candidates if candidates is not None else policy.waiting(now)


AFTER_DELIVERIES = NORMAL + 1
"""SimPy priority of a decode replica's step start: after every other event of its
instant, so a step at t admits every import delivered at t (as URGENT arrivals do for a
co-located replica), however many zero-length events the transfer chain took."""


class DecodeReplica(Replica):
    """A replica of the decode pool: after each step, handoffs waiting for room are
    tried again (its finished or preempted requests may have freed some); its next step
    starts after the imports delivered at the same instant."""

    def __init__(self, env, index, scheduler, cost_model, feed, cluster, *,
                 async_scheduling: bool = False) -> None:
        super().__init__(env, index, scheduler, cost_model, feed, fast_forward=False,
                         async_scheduling=async_scheduling)
        self.cluster = cluster
        self.imports: list[Request] = []
        """Requests submitted here, some of which may still wait to be admitted."""

    def finished(self, step: EngineStep) -> Event:
        super().finished(step)
        self.cluster.decoded(step.records)
        return PriorityTimeout(self.env, 0.0, AFTER_DELIVERIES)

    def ran_nothing(self, step: EngineStep) -> None:
        super().ran_nothing(step)
        self.cluster.decoded(step.records)

    def idle(self) -> Iterator[Event]:
        yield from super().idle()
        yield PriorityTimeout(self.env, 0.0, AFTER_DELIVERIES)

    def has_preempted_waiting(self) -> bool:
        """Does a request other than a not-yet-admitted import wait here (one preempted
        by recompute, which needs free memory)? O(imports kept)."""
        lag = self.lag
        held = {id(r) for r in lag.queued + lag.arrived} if lag is not None and lag.keeps_any \
            else None   # imports asynchronous scheduling keeps back: not in the scheduler yet
        waiting = self.scheduler.num_waiting
        if not waiting:
            self.imports = [r for r in self.imports if id(r) in held] if held else []
            return False
        self.imports = [r for r in self.imports if r.status is RequestStatus.WAITING]
        if held:
            return waiting > sum(1 for r in self.imports if id(r) not in held)
        return waiting > len(self.imports)


class DisaggregatedCluster:
    """Prefill and decode replicas, a router for arrivals over the prefill replicas, and
    one KV link per prefill replica (see the module docstring).

    The prefill schedulers' block managers must be `HeldKV`s. `kv_bytes_per_token` is
    what a decode replica's blocks hold per token (all its GPUs), `lanes` the links a
    transfer uses at once. `keep_token_times` carries each request's first token time to
    its decode part (for schedulers that keep token times).
    """

    def __init__(self, prefill: Sequence[Scheduler], prefill_cost: CostModel,
                 decode: Sequence[Scheduler], decode_cost: CostModel, router: Router,
                 requests: Sequence[Request], *, link: LinkSpec, kv_transfer: str,
                 kv_bytes_per_token: int, num_layers: int, lanes: int,
                 keep_token_times: bool = False, async_scheduling: bool = False) -> None:
        if len(prefill) != router.num_replicas:
            raise ValueError(f"router is for {router.num_replicas} replicas, got {len(prefill)}")
        if not decode:
            raise ValueError("a disaggregated cluster needs at least one decode replica")
        if not isinstance(requests, TraceRequests) and any(r.n != 1 for r in requests):
            raise ValueError("disaggregated serving is modelled for single-sample requests (n=1)")
        self.env = env = Environment()
        self.requests = requests
        self.num_requests = len(requests)
        arrivals = requests.arrival_s if isinstance(requests, TraceRequests) else \
            np.array([r.arrival_s for r in requests], dtype=np.float64)
        self.last_arrival_s = float(arrivals[-1]) if len(arrivals) else 0.0
        self.router = router
        self.link, self.kv_transfer, self.lanes = link, kv_transfer, lanes
        self.kv_bytes_per_token, self.num_layers = kv_bytes_per_token, num_layers
        self.keep_token_times = keep_token_times
        n = len(prefill)
        upfront = None if n == 1 else router.assign_upfront(requests)
        feeds = [ArrivalFeed() for _ in range(n)] if upfront is not None else [ArrivalFeed()] * n
        self.prefill = [PrefillReplica(env, i, s, prefill_cost, feeds[i], self,
                                       async_scheduling=async_scheduling) for i, s in enumerate(prefill)]
        self.decode = [DecodeReplica(env, i, s, decode_cost, ArrivalFeed(), self,
                                     async_scheduling=async_scheduling) for i, s in enumerate(decode)]
        self.links = [Resource(env, capacity=1) for _ in prefill]
        self._originals: dict[int, Request] = {}
        """Requests in their prefill, by id: what their decode part is made from."""
        self._waiting: collections.deque[tuple[Handoff, Request, RequestRecord]] = collections.deque()
        self._inbound = [0] * len(decode)
        """Transfers under way to each decode replica."""
        self.handoffs = RecordLog(Handoff)
        self.decode_rejections_for_memory = 0
        """Decode-side rejections of a request that found no room with nothing running
        there: only landed imports (waiting to be admitted) can have held the memory."""
        self._num_final_prefill = 0
        if n == 1:
            env.process(arrival_process(env, requests, self._arrive_at(0), feeds[0]))
        elif upfront is not None:
            for i in range(n):
                own = [j for j, r in enumerate(upfront) if r == i]
                env.process(arrival_process(env, map(requests.__getitem__, own), self._arrive_at(i), feeds[i]))
        else:
            env.process(arrival_process(env, requests, self._route, feeds[0]))
        for replica in self.prefill + self.decode:
            env.process(replica.run())

    # ------------------------------------------------------------------ arrivals
    def _route(self, req: Request) -> None:
        i = self.router.route(req, [r.outstanding for r in self.prefill])
        self._arrive_at(i)(req)

    def _arrive_at(self, i: int):
        replica = self.prefill[i]

        def arrive(req: Request) -> None:
            if req.output_len == 1:   # served whole by its prefill replica
                replica.submit(req)
                return
            part = prefill_part(req)
            self._originals[req.request_id] = req
            replica.held.expect(part.seqs[0])
            replica.submit(part)
        return arrive

    # ------------------------------------------------------------------ handoffs
    def prefilled(self, replica: PrefillReplica, records: list[RequestRecord]) -> None:
        """A prefill replica published `records`: hand finished prefills off."""
        for rec in records:
            if rec.status == "rejected" and "empty KV cache" in rec.reject_reason \
                    and replica.held.num_held_blocks:
                raise RuntimeError(f"prefill replica {replica.index} rejected request {rec.request_id} "
                                   "while held blocks were to be released (a bug in servelab)")
            req = self._originals.pop(rec.request_id, None)
            if req is None or rec.status != "finished":
                self._num_final_prefill += 1
                if req is not None:
                    replica.held.forget((rec.request_id, 0))
                continue
            blocks = replica.held.held_blocks((rec.request_id, 0))
            h = Handoff(rec.request_id, replica.index, req.prompt_len,
                        req.prompt_len * self.kv_bytes_per_token, blocks, req.arrival_s,
                        rec.scheduled_s, rec.first_token_s)
            self._waiting.append((h, req, rec))
        if records:
            self._hand_off()

    def decoded(self, records: list[RequestRecord]) -> None:
        """A decode replica ended a step: memory may have been freed."""
        for rec in records:
            if rec.status == "rejected" and "empty KV cache" in rec.reject_reason:
                self.decode_rejections_for_memory += 1
        if self._waiting:
            self._hand_off()

    def _hand_off(self) -> None:
        """Land waiting handoffs, oldest first, while a decode replica has room."""
        now = self.env.now
        waiting = self._waiting
        while waiting:
            h, req, rec = waiting[0]
            status, target = self._decode_replica_for(req)
            if status is AllocStatus.LATER:
                return
            waiting.popleft()
            if status is AllocStatus.NEVER:   # its decode scheduler rejects it, with its reason
                self._release(h)
                self.decode[0].submit(decode_part(req, rec))
                continue
            land(self.decode[target].scheduler.bm, req)
            h.decode_replica, h.landed_s = target, now
            self._inbound[target] += 1
            self.env.process(self._transfer(h, req, rec))

    def _decode_replica_for(self, req: Request) -> tuple[AllocStatus, int | None]:
        """(OK, the least-loaded decode replica that would admit `req`'s prompt and first
        token now), (LATER, None) while none would, (NEVER, None) if none ever could."""
        fits, never = [], 0
        for i, replica in enumerate(self.decode):
            status = landing_status(replica.scheduler.bm, req)
            if status is AllocStatus.NEVER:
                never += 1
            elif status is AllocStatus.OK and not replica.has_preempted_waiting():
                fits.append(i)
        if never == len(self.decode):
            return AllocStatus.NEVER, None
        if not fits:
            return AllocStatus.LATER, None
        load = [self.decode[i].outstanding + self._inbound[i] for i in fits]
        return AllocStatus.OK, fits[least_loaded(load)]

    def _transfer(self, h: Handoff, req: Request, rec: RequestRecord) -> Iterator[Event]:
        link, nbytes = self.link, h.kv_bytes
        if self.kv_transfer == "layerwise" and h.landed_s == h.prefill_end_s:
            seconds = link.layerwise_seconds(nbytes, self.lanes, self.num_layers,
                                             h.prefill_end_s - h.scheduled_s)
        else:   # after the prefill (or its decode replica was found late: nothing overlapped)
            seconds = link.seconds(nbytes, self.lanes)
        with self.links[h.prefill_replica].request() as turn:
            yield turn
            h.transfer_start_s = self.env.now
            yield self.env.timeout(seconds)
        h.transfer_end_s = self.env.now
        self._release(h)
        self._inbound[h.decode_replica] -= 1
        replica = self.decode[h.decode_replica]
        part = decode_part(req, rec, keep_token_times=self.keep_token_times)
        replica.imports.append(part)
        replica.submit(part)

    def _release(self, h: Handoff) -> None:
        replica = self.prefill[h.prefill_replica]
        replica.held.release((h.request_id, 0))
        h.released_s = self.env.now
        self.handoffs.append(h)
        replica.released()

    # ------------------------------------------------------------------ running
    @property
    def num_done(self) -> int:
        return self._num_final_prefill + sum(len(r.records) for r in self.decode)

    def run(self, progress: Progress | None = None, num_reports: int = 100) -> None:
        """Simulate until no event is left; raises EngineStalled if requests are left
        undone (`simulator.engine.simulate_to_end`)."""
        simulate_to_end(self, progress, num_reports)

    def request_records(self) -> RecordTable:
        """Every request's final record, by id: a handed-off request's from its decode
        replica, the others' from their prefill replica."""
        handed = set(self.handoff_table().column("request_id").tolist())
        tables = []
        for replica in self.prefill:
            table = replica.records.table()
            ids = table.column("request_id")
            tables.append(table.take(np.flatnonzero([i not in handed for i in ids.tolist()])))
        tables += [r.records.table() for r in self.decode]
        return RecordTable.concat(RequestRecord, tables).sorted_by("request_id")

    def step_records(self) -> RecordTable:
        """Both pools' steps by start time (ties: prefill replicas, then decode ones)."""
        steps = RecordTable.concat(StepRecord, [r.steps.table() for r in self.prefill + self.decode])
        return steps.sorted_by("start_s")

    def handoff_table(self) -> RecordTable:
        """Completed handoffs, by request id."""
        return self.handoffs.table().sorted_by("request_id")
