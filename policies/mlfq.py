"""FastServe's skip-join multi-level feedback queue: least attained service first, without
knowing output lengths."""
from __future__ import annotations

import bisect
import itertools
from typing import Iterable

from servelab._validate import check_float, check_int
from servelab.options import positive_float, positive_int
from servelab.policies.base import KeyedQueue, Policy, PolicyFlag, max_wait_flag, register_policy
from servelab.request import Request

NEVER = 1 << 62
"""`tokens_until_preemptible` when no running request can ever be preempted."""


@register_policy("mlfq")
class MLFQPolicy(Policy):
    """Skip-join MLFQ (Wu et al., "Fast Distributed Inference Serving for Large Language
    Models", arXiv:2305.05920, 2023; REFERENCE.md's "SJF / SRPT family"), with service
    counted in tokens.

    Levels 0 (served first) to `num_levels - 1`; level i's quantum is
    `quantum_tokens · quantum_ratio**i` output tokens, rounded (FastServe doubles it per
    level).
    Skip-join: a request joins the first level whose quantum covers its first iteration,
    the prefill, priced at `prompt_tokens / prefill_tokens_per_output_token` output tokens
    (FastServe compares the first iteration's time with the quanta; this engine's policies
    see tokens, not times: a prefill token costs a small fraction of a decode step, the
    ratio the flag sets). It is demoted one level each time it has drawn its level's
    quantum of output tokens; the last level has no end. A request's level is a function
    of its prompt and the tokens it has drawn, so it costs no accounting per step.

    Starvation (FastServe promotes a job that waited past a limit to the top queue): a
    request that has waited `max_wait_s` since it last entered the queue (arrival or
    preemption) is promoted: overdue requests are admitted before all others, longest
    waiting first, and once admitted it restarts at level 0, its demotions counted from the
    tokens it had then (while it waits, it preempts by the level it waits at).
    `max_wait_s=None` turns the guard off. The policy keeps the promoted requests' token
    counts for the run (one entry per promotion).

    Key: (level, arrival_s, request_id): FCFS within a level.
    Victim: the running request at the lowest level (largest number), then the most
    recently admitted.

    Preemption. FastServe preempts at token granularity: every iteration runs the jobs of
    the highest queues, and a preempted job's KV cache is kept (moved to host memory).
    The closest this engine allows, with `preemptive=True` (the default): when the waiting
    head does not fit in free memory, running requests at strictly lower levels are
    preempted for it (`may_preempt_for`), by the run's preemption mode — `--preemption swap`
    keeps their KV in the CPU pool as FastServe does; recompute drops it. A head that
    fits is admitted beside the running requests (continuous batching: there is room for
    both), so no request is preempted for a seat in the batch.

    Fast-forward: a running request's level grows as it draws tokens, so whom a waiting
    head may preempt changes during a run of decode steps. The policy declares it
    (`reorders_running`) and says how many tokens the running requests may draw before
    one sinks below the best waiting level (`tokens_until_preemptible`); a fast-forward
    run ends there (`Scheduler.decode_run_bound`), and so does the scheduler's memory of
    a waiting head it found no victim for. A waiting request's level does not change
    while it waits (promotion takes effect when it is admitted), so that bound is exact.
    Victim order alone may change within a run: nothing is preempted there.
    """

    victims_by_admission = False
    order_moves = True
    reorders_running = True
    flags = (
        PolicyFlag("mlfq-quantum-tokens", "quantum_tokens", "output tokens of the top level's "
                   "quantum", parse=positive_int, metavar="N"),
        PolicyFlag("mlfq-quantum-ratio", "quantum_ratio", "each level's quantum is this many "
                   "times the one above", parse=positive_float, metavar="R"),
        PolicyFlag("mlfq-levels", "num_levels", "number of levels", parse=positive_int,
                   metavar="N"),
        PolicyFlag("mlfq-prefill-ratio", "prefill_tokens_per_output_token", "prompt tokens "
                   "that cost as much as one output token (skip-join prices the prefill so)",
                   parse=positive_float, metavar="R"),
        max_wait_flag("mlfq-max-wait-s"),
        PolicyFlag("mlfq-no-preemption", "preemptive", "never preempt a running request for a "
                   "waiting one", switch=True, to_option=lambda given: not given),
    )

    def __init__(self, quantum_tokens: int = 32, quantum_ratio: float = 2.0, num_levels: int = 6,
                 prefill_tokens_per_output_token: float = 16.0,
                 max_wait_s: float | None = 30.0, preemptive: bool = True) -> None:
        super().__init__()
        o = "MLFQPolicy"
        check_int(o, "quantum_tokens", quantum_tokens, 1)
        check_float(o, "quantum_ratio", quantum_ratio, 1.0)
        check_int(o, "num_levels", num_levels, 1, 64)
        check_float(o, "prefill_tokens_per_output_token", prefill_tokens_per_output_token, 0.0,
                    lo_open=True)
        if max_wait_s is not None:
            check_float(o, "max_wait_s", max_wait_s, 0.0, lo_open=True)
        self.quantum_tokens, self.quantum_ratio = int(quantum_tokens), float(quantum_ratio)
        self.num_levels = int(num_levels)
        self.prefill_ratio = float(prefill_tokens_per_output_token)
        self.max_wait_s = max_wait_s
        self.preemptive = bool(preemptive)
        self.quanta = [max(1, round(quantum_tokens * quantum_ratio ** i)) for i in range(num_levels)]
        """Each level's quantum in whole output tokens."""
        self._through = list(itertools.accumulate(self.quanta))   # Σ quanta[0..i]
        # Levels by bisection without a cap: the last level's bound is left out, so no
        # search returns past it. _skipped[i]: the service a request joining level i skips.
        self._join_bounds = self.quanta[:-1]
        self._level_bounds = self._through[:-1]
        self._skipped = [0, *self._through[:-1]]
        self._by_wait = KeyedQueue()          # (entered the queue at, request id)
        self._since: dict[int, float] = {}    # waiting request id -> entered the queue at
        self._promoted: dict[int, int] = {}   # request id -> output tokens when promoted
        self._promoting: Request | None = None   # the overdue request `peek` last returned
        self._waiting_level: dict[int, int] = {}     # waiting request id -> its level

    # --- levels ----------------------------------------------------------------------
    def join_level(self, req: Request) -> int:
        """Skip-join: the first level whose quantum covers the prefill's price."""
        return bisect.bisect_left(self._join_bounds, req.prompt_len / self.prefill_ratio)

    def level(self, req: Request) -> int:
        """The level after the tokens drawn so far (since promotion, if promoted).
        O(log levels): the scheduler asks it of every running request it orders or
        looks at for a victim."""
        return bisect.bisect_right(self._level_bounds, self._service(req))

    def _service(self, req: Request) -> int:
        """Output tokens' worth of service counted so far, the service skipped at joining
        included: level i ends where the quanta of levels 0..i add up to."""
        seqs = req.seqs
        drawn = seqs[0].num_output_tokens if len(seqs) == 1 else req.num_output_tokens
        base = self._promoted.get(req.request_id)
        if base is not None:
            return drawn - base
        join = bisect.bisect_left(self._join_bounds, req.prompt_len / self.prefill_ratio)
        return self._skipped[join] + drawn

    # --- the waiting order -------------------------------------------------------------
    def waiting_key(self, req: Request) -> tuple:
        return (self.level(req), req.arrival_s, req.request_id)

    def _head_level(self, head: Request) -> int:
        """A waiting request's level (fixed while it waits)."""
        level = self._waiting_level.get(head.request_id)
        return self.level(head) if level is None else level

    def add(self, req: Request, now: float) -> None:
        super().add(req, now)
        self._enter(req, now)

    def requeue(self, req: Request, now: float) -> None:
        super().requeue(req, now)
        self._enter(req, now)

    def _enter(self, req: Request, now: float) -> None:
        self._since[req.request_id] = now
        self._waiting_level[req.request_id] = self.level(req)
        self._by_wait.push((now, req.request_id), req)

    def remove(self, req: Request) -> None:
        super().remove(req)
        self._by_wait.remove(req)
        self._since.pop(req.request_id, None)
        self._waiting_level.pop(req.request_id, None)
        if self._promoting is req:   # admitted as overdue: promoted from now on
            self._promoted[req.request_id] = req.num_output_tokens
            self._promoting = None

    def _overdue(self, now: float) -> Request | None:
        if self.max_wait_s is None:
            return None
        oldest = self._by_wait.peek()
        if oldest is None or now - self._since[oldest.request_id] < self.max_wait_s:
            return None
        return oldest

    def peek(self, now: float) -> Request | None:
        """The longest-waiting request once it is overdue (promoted when it is admitted:
        its level restarts at 0 then), else the head of the highest level."""
        overdue = self._overdue(now)
        if overdue is not None:
            self._promoting = overdue
            return overdue
        return self._queue.peek()

    def candidates(self, now: float) -> list[Request]:
        heads = [self._queue.peek(), self._by_wait.peek()]
        return [h for i, h in enumerate(heads) if h is not None and h not in heads[:i]]

    def waiting(self, now: float) -> list[Request]:
        ordered = self._queue.ordered()
        if self.max_wait_s is None:
            return ordered
        since = self._since
        overdue = [r for r in self._by_wait.ordered()
                   if now - since[r.request_id] >= self.max_wait_s]
        ids = {r.request_id for r in overdue}
        return overdue + [r for r in ordered if r.request_id not in ids]

    # --- preemption --------------------------------------------------------------------
    def victim_key(self, req: Request, admit_seq: int) -> tuple:
        return (self.level(req), admit_seq, req.request_id)

    def may_preempt_for(self, head: Request, running: Request) -> bool:
        return self.preemptive and self.level(running) > self._head_level(head)

    def tokens_until_preemptible(self, heads: list[Request], running: Iterable[Request]) -> int:
        """The fewest tokens one of `running` must draw before one of the waiting `heads`
        may preempt it: until its service passes the end of the highest-priority level
        among `heads` (a waiting request's level does not change). 0: one may be
        preempted now. O(running)."""
        if not self.preemptive or not heads:
            return NEVER
        top = min(self._head_level(h) for h in heads)
        if top == self.num_levels - 1:
            return NEVER   # nothing sinks below the last level
        most = max(map(self._service, running), default=None)
        return NEVER if most is None else max(0, self._through[top] - most)

    def describe(self) -> dict:
        return {"name": self.name, "quantum_tokens": self.quantum_tokens,
                "quantum_ratio": self.quantum_ratio, "num_levels": self.num_levels,
                "prefill_tokens_per_output_token": self.prefill_ratio,
                "max_wait_s": self.max_wait_s, "preemptive": self.preemptive}
