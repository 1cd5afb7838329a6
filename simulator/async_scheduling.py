"""vLLM's asynchronous scheduling, as an arriving request meets it.

Under asynchronous scheduling (vLLM's `--async-scheduling`, on by default in vLLM V1
releases from 0.14: `servelab.engines`) the engine core keeps two batches in flight: it
forms batch k+1 while batch k runs on the GPU, from what it knew when k was launched
(`EngineCore.step_with_batch_queue`, `vllm/v1/engine/core.py`; `max_concurrent_batches`
is 2 under `async_scheduling`, `vllm/config/vllm.py`; the tokens k will produce are
placeholders that k+1 reads on the GPU, `vllm/v1/core/sched/async_scheduler.py`). The
engine core takes new requests between steps, when its busy loop drains its input queue
(`EngineCore._process_input_queue`). So:

- a request that arrives while a step runs is queued when that step ends (the engine's
  `queued_ts`), and since the batch after it was formed already, it is first scheduled
  one step later: it waits a whole step that a synchronous engine does not make it wait;
- a request that reaches an engine with nothing in flight is scheduled at once;
- decode steps follow each other as before (the next token is a placeholder).

`AsyncScheduling` holds the requests kept back so. Its owner (a `Replica`, or the
lock-step group of a data-parallel deployment) calls `step_started` when a step (or a
fast-forward run) is launched, `step_ended` at each step boundary, and `nothing_in_flight`
when a boundary launches nothing; each hands back the requests that may now be
scheduled, which the owner adds to its scheduler with the boundary's time.

Not modelled: the batch formed a step early also decides preemptions and finishes a
step early (vLLM skips a request whose output is certain to be complete, so with known
output lengths no step is wasted); and the CPU time the overlap hides stays in the
profile's fitted step overhead. Pipeline stages run without the lag (their virtual
engines keep batches in flight their own way; `SimulationConfig` refuses it there).
Disaggregated pools run it: vLLM does not turn it off for a KV connector, and a decode
replica's import, submitted when its KV has arrived, waits for a boundary like any
arrival.
"""
from __future__ import annotations

from servelab.request import Request


class AsyncScheduling:
    """The arrivals an engine with two batches in flight keeps back: `arrived` came while
    the step under way runs (they are queued at its end), `queued` were queued at the
    last boundary (they may be scheduled from the next one)."""

    __slots__ = ("in_step", "arrived", "queued")

    def __init__(self) -> None:
        self.in_step = False
        """A step, or a fast-forward run of steps, is in flight."""
        self.arrived: list[Request] = []
        self.queued: list[Request] = []

    def hold(self, req: Request) -> bool:
        """Keep `req` back if a step is in flight (True); else it may be scheduled now."""
        if self.in_step:
            self.arrived.append(req)
            return True
        return False

    def step_started(self) -> None:
        self.in_step = True

    def step_ended(self) -> list[Request]:
        """The step in flight ended: those queued at the previous boundary may be
        scheduled now; those that arrived during the step are queued now."""
        ready, self.queued, self.arrived = self.queued, self.arrived, []
        self.in_step = False
        return ready

    def nothing_in_flight(self) -> list[Request]:
        """A boundary launched no batch: every request kept back may be scheduled now."""
        ready = self.queued + self.arrived
        self.queued, self.arrived = [], []
        self.in_step = False
        return ready

    @property
    def keeps_any(self) -> bool:
        return bool(self.queued or self.arrived)
