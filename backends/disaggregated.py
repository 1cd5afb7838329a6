"""One prefill engine and one decode engine in one process: disaggregated serving, for real.

    servelab run --model tiny-llama --trace T --prefill-replicas 1 --decode-replicas 1 \\
        --prefill-kv-blocks 256 --decode-kv-blocks 64 --out runs/pd-real

What the simulator models (`simulator/disaggregated_cluster.py`, docs/disaggregation.md)
run on the model: each engine has its own `Scheduler`, block manager, KV cache and
`RealExecutor`, and both runners share one model object (the same weight tensors,
`decode_runner`). A request goes the simulator's way, through the same pieces
(`simulator/kv_handoff.py`):

1. The prefill engine serves `prefill_part` (the prompt and one output token: the first
   token is sampled there, as vLLM's disaggregated prefill does). When it finishes,
   `HeldKV` keeps its blocks (vLLM's connector `delay_free_blocks`).
2. Finished prefills are landed in completion order (FIFO) once the decode engine's block
   manager would admit the prompt and first token now (`landing_status`) and no request
   preempted by recompute waits there for memory. Until then the KV stays held on the
   prefill engine (back-pressure); a prefill engine kept idle only by held blocks waits for
   a release instead of rejecting its head.
3. `land` allocates the decode blocks, and the prompt's blocks are copied from the prefill
   cache (its block table there) into the decode cache (its block table there) by
   `KVCache.copy_blocks_to`: on the device on CUDA, tensor copies on a CPU. The copy is
   timed with the executor's `StepTimer`; copies go one at a time (one link, FIFO).
4. When the transfer ends the prefill blocks are freed, and the decode scheduler receives
   `decode_part`, an import (`policies/admission.py`) holding the first token, whose
   random streams follow it (`RealExecutor.hand_over`).

Time. Steps and transfers run one after another on one thread, in the order of their
start times on the run's clock (a small event queue; at one instant, ends of steps and
transfers come before starts, so a step sees every import delivered when it starts). On
the virtual clock each engine advances by its own measured steps, as if each had a device
of its own; on the wall clock the two share real time, so each also waits for the
other's steps and the timeline is that of one device running both.

A request of one output token, one that draws EOS as its first token (without replay) or
one rejected by the prefill engine ends there; one whose prompt can never fit the decode
cache is rejected by the decode scheduler with its reason.
"""
from __future__ import annotations

import collections
import copy
import heapq
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from servelab._validate import check_int
from servelab.config import CacheConfig, SchedulerConfig
from servelab.engine import engine_step
from servelab.memory.base import AllocStatus
from servelab.outputs import PreemptionMode
from servelab.record_table import RecordLog, RecordTable
from servelab.records import RequestRecord, StepRecord
from servelab.request import Request, RequestStatus
from servelab.simulator.kv_handoff import (Handoff, HeldKV, decode_part, land, landing_status,
                                           prefill_part)

if TYPE_CHECKING:
    from servelab.backends.executor import RealExecutor
    from servelab.backends.model import ModelRunner

__all__ = ["LINK", "RealDisaggregation", "DisaggregatedServer", "add_arguments",
           "build_schedulers", "check_requests", "decode_cache_config", "decode_runner",
           "pool_blocks"]

KV_TRANSFER = "after-prefill"
"""When the KV moves: once the prefill has ended (the simulator's default mode)."""
LINK = "in-process copy"
"""What disaggregation.json names as the link: the caches share one process and device."""
_END, _START = 0, 1
"""Event priorities at one instant: ends of steps and transfers, then starts of steps."""


@dataclass(frozen=True)
class RealDisaggregation:
    """A real run's disaggregation: one prefill engine and one decode engine in one
    process. A None block count takes the run's (`--kv-blocks`), or else a share of what
    one engine would derive (`pool_blocks`)."""

    prefill_kv_blocks: int | None = None
    decode_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefill_kv_blocks", "decode_kv_blocks"):
            if getattr(self, name) is not None:
                check_int("RealDisaggregation", name, getattr(self, name), 1)

    def to_dict(self) -> dict:
        return {"prefill_replicas": 1, "decode_replicas": 1, "kv_transfer": KV_TRANSFER,
                "prefill_kv_blocks": self.prefill_kv_blocks,
                "decode_kv_blocks": self.decode_kv_blocks}

    @classmethod
    def from_args(cls, args) -> "RealDisaggregation | None":
        """The disaggregation `servelab run`'s flags ask for (the simulator's flags,
        `simulator.disaggregation`), None for none; ValueError, in one line, for a flag
        the real backend cannot honour."""
        from servelab.simulator.disaggregation import disaggregation_from_args

        d = disaggregation_from_args(args)
        if d is None:
            return None
        if d.prefill.replicas != 1 or d.decode.replicas != 1:
            raise ValueError(f"--prefill-replicas {d.prefill.replicas} --decode-replicas "
                             f"{d.decode.replicas}: the real backend runs one prefill engine and "
                             "one decode engine in one process (1 and 1); simulate larger pools "
                             "with servelab simulate")
        for flag, value in (("--prefill-tp", d.prefill.tp), ("--decode-tp", d.decode.tp)):
            if value is not None:
                raise ValueError(f"{flag}: the real backend runs each engine on one device, "
                                 "without tensor parallelism")
        for flag, value in (("--prefill-gpu", d.prefill.gpu), ("--decode-gpu", d.decode.gpu)):
            if value is not None:
                raise ValueError(f"{flag}: the real backend runs both engines on --device")
        if args.kv_link is not None:
            raise ValueError("--kv-link prices a link in the simulator; the real backend copies "
                             "the KV between its two caches in one process and measures the "
                             "copy: drop --kv-link")
        if d.kv_transfer != KV_TRANSFER:
            raise ValueError(f"--kv-transfer {d.kv_transfer}: the real backend sends the KV "
                             f"once the prefill has ended ({KV_TRANSFER})")
        return cls(d.prefill.kv_blocks, d.decode.kv_blocks)


def add_arguments(parser) -> None:
    """`servelab run`'s disaggregation flags: the simulator's
    (`simulator.disaggregation.add_disaggregation_arguments`), so that a simulated and a
    real run are spelled alike; `RealDisaggregation.from_args` refuses those that only a
    simulated pool or link has. Cheap to import: no torch."""
    from servelab.simulator.disaggregation import add_disaggregation_arguments

    add_disaggregation_arguments(
        parser, "one prefill and one decode engine in one process, the KV copied between "
                "their caches (--prefill-replicas 1 --decode-replicas 1; --prefill-kv-blocks and "
                "--decode-kv-blocks size them, else --kv-blocks, else they share one engine's); the pool "
                "TP, GPU, link and layer-wise transfer flags are the simulator's and refused here",
        simulated_only_hidden=True)


# --------------------------------------------------------------------------- setup


def pool_blocks(d: RealDisaggregation, run_blocks: int | None,
                derive: Callable[[], int]) -> tuple[int, int, str]:
    """(prefill blocks, decode blocks, "given" or "derived"). A pool's count is its own
    flag, else the run's `run_blocks`; without either, both caches being on one device,
    the blocks one engine would get (`derive()`) are shared: what the other pool's count
    leaves, or half each. ValueError when a pool would get none."""
    p, q = d.prefill_kv_blocks or run_blocks, d.decode_kv_blocks or run_blocks
    if p and q:
        return p, q, "given"
    total = derive()
    if p or q:
        left = total - (p or q)
        if left < 1:
            raise ValueError(f"{p or q} KV blocks for the {'prefill' if p else 'decode'} engine "
                             f"leave none of the {total} that fit for the other: give "
                             f"--{'decode' if p else 'prefill'}-kv-blocks")
        return (p, left, "derived") if p else (left, q, "derived")
    if total < 2:
        raise ValueError(f"only {total} KV block fits: give --prefill-kv-blocks and "
                         "--decode-kv-blocks, or use a smaller model")
    return total // 2, total // 2, "derived"


def decode_cache_config(prefill: CacheConfig, num_blocks: int) -> CacheConfig:
    """The decode engine's cache: the prefill engine's, with its own block count and no
    prefix cache (prompts arrive computed; the prefix cache and its CPU tier serve the
    prefill engine, as in the simulator)."""
    return replace(prefill, num_gpu_blocks=num_blocks, enable_prefix_caching=False,
                   num_host_blocks=0)


def decode_runner(prefill: "ModelRunner", num_blocks: int, num_cpu_blocks: int = 0,
                  poison_kv: bool = False) -> "ModelRunner":
    """A runner over `prefill`'s model (the same weight tensors, not a copy) with a KV
    cache of its own, of the same layout (`KVCache.like`)."""
    runner = copy.copy(prefill)
    runner.kv_cache = prefill.kv_cache.like(num_blocks, num_cpu_blocks, poison=poison_kv)
    return runner


def build_schedulers(config: SchedulerConfig, prefill_cache: CacheConfig,
                     decode_cache: CacheConfig, policy: str, policy_options: dict):
    """(prefill scheduler, its block manager held through a `HeldKV`; decode scheduler),
    each with its own policy object, emitting block tables and keeping token times."""
    from servelab.memory import make_block_manager
    from servelab.policies import Scheduler, build_scheduler, make_policy

    kwargs = dict(emit_block_tables=True, keep_token_times=True)
    prefill = Scheduler(config, HeldKV(make_block_manager(prefill_cache, config.max_model_len)),
                        make_policy(policy, **policy_options),
                        enable_prefix_caching=prefill_cache.enable_prefix_caching, **kwargs)
    return prefill, build_scheduler(config, decode_cache, policy, policy_options, **kwargs)


def check_requests(requests, prefill_blocks: int, decode_blocks: int, block_size: int) -> None:
    """ValueError, in one line, for requests a disaggregated run does not serve: several
    samples, or none that an engine's cache could ever hold (the simulator's
    `_check_pool_holds`: a prompt on the prefill engine, prompt + output on the decode one)."""
    several = next((r.request_id for r in requests if r.n != 1), None)
    if several is not None:
        raise ValueError(f"request {several} asks for n > 1 samples: disaggregated serving runs "
                         "single-sample requests (n=1)")
    for name, blocks, needs, what in (
            ("prefill", prefill_blocks, [r.prompt_len for r in requests], "its prompt"),
            ("decode", decode_blocks, [r.prompt_len + r.output_len - 1 for r in requests
                                       if r.output_len > 1], "prompt + output")):
        if needs and min(needs) > blocks * block_size:
            raise ValueError(f"{name} engine: a KV cache of {blocks:,} blocks ({blocks * block_size:,} "
                             f"tokens) cannot hold any request: the smallest needs {min(needs):,} "
                             f"tokens ({what}); give more --{name}-kv-blocks")


# --------------------------------------------------------------------------- the engines


@dataclass(eq=False)
class _Engine:
    """One engine: its scheduler and executor, what it emitted, and its place in time."""

    scheduler: object
    executor: "RealExecutor"
    records: list[RequestRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    preempted: dict = field(default_factory=lambda: dict.fromkeys(PreemptionMode, 0))
    busy: bool = False
    """A step is under way (its end is a pending event)."""
    wake_at: float | None = None
    """When its pending step start is, if one is pending."""


class DisaggregatedServer:
    """Serves `requests` on a prefill engine and a decode engine (see the module
    docstring). The prefill scheduler's block manager must be a `HeldKV`; each executor's
    `requests` must be a dict this server may fill. `run()` once, then read `records`,
    `steps`, `outputs()`, `handoffs()` and `report()`."""

    def __init__(self, prefill: tuple, decode: tuple, requests: list[Request], clock, progress,
                 *, replay: bool) -> None:
        from servelab.backends.executor import StepTimer

        self.prefill, self.decode = _Engine(*prefill), _Engine(*decode)
        self.held = self.prefill.scheduler.bm
        if not isinstance(self.held, HeldKV):
            raise ValueError("the prefill scheduler must hold its blocks through a HeldKV")
        self.clock, self.progress, self.replay = clock, progress, replay
        self.pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.num_requests = len(requests)
        self._next_arrival = 0
        self._events: list = []
        self._order = itertools.count()
        self._originals: dict[int, Request] = {}
        """Requests in their prefill, by id."""
        self._parts: dict[int, Request] = {}
        """Each request's last part: what its outputs are read from."""
        self._waiting: collections.deque = collections.deque()
        """(Handoff, original, prefill record): finished prefills not landed yet, FIFO."""
        self._imports: list[Request] = []
        self._link_free_s = 0.0
        self._timer = StepTimer(self.prefill.executor.runner.device)
        self._handoffs = RecordLog(Handoff)
        self.decode_rejections_for_memory = 0
        """Decode-side rejections for memory of requests the decode cache could hold whole:
        blocks held by landed imports not yet running, which the scheduler does not count
        as freeable (it rejects a waiting head that finds no room with nothing running,
        and aborts a lone running request that cannot grow), kept them out."""
        cache = self.prefill.executor.runner.kv_cache
        self.block_bytes = cache.bytes_per_block

    # ------------------------------------------------------------------ the event loop
    def _at(self, t: float, priority: int, action, *args) -> None:
        heapq.heappush(self._events, (t, priority, next(self._order), action, args))

    def run(self) -> None:
        """Serve every request; RuntimeError if some are left undone (a bug)."""
        if self.pending:
            self._wake(self.prefill, self.pending[0].arrival_s)
        while self._events:
            t, _, _, action, args = heapq.heappop(self._events)
            self.clock.wait_until(t)
            action(*args, self.clock.now())
        done = len(self.prefill.records) + len(self.decode.records)
        self.progress.update(done, self.clock.now(), len(self.prefill.steps) + len(self.decode.steps),
                             _Counts(self), force=True)
        self.progress.close()
        if done != self.num_requests:
            raise RuntimeError(f"disaggregated run ended with {self.num_requests - done} requests "
                               f"undone ({len(self._waiting)} awaiting a decode engine; a bug in "
                               "servelab)")

    def _wake(self, engine: _Engine, t: float) -> None:
        """Start a step of `engine` at `t`, unless one is under way or starts by then."""
        if engine.busy or (engine.wake_at is not None and engine.wake_at <= t):
            return
        engine.wake_at = t
        self._at(t, _START, self._start, engine, t)

    def _start(self, engine: _Engine, planned: float, now: float) -> None:
        if engine.wake_at != planned:   # replaced by an earlier start
            return
        engine.wake_at = None
        sched = engine.scheduler
        if engine is self.prefill:
            pending = self.pending
            while self._next_arrival < len(pending) and pending[self._next_arrival].arrival_s <= now:
                self._arrive(pending[self._next_arrival], now)
                self._next_arrival += 1
            if self._blocked(now):   # a release wakes it
                return
        bm = sched.bm
        step = engine_step(sched, engine.executor, now, bm.num_gpu_blocks, lambda: bm.num_used_blocks)
        for _, mode in step.output.preempted:
            engine.preempted[mode] += 1
        if step.result is None:
            self._took(engine, step.records, now)
            return
        engine.steps.append(step.step)
        engine.busy = True
        self._at(now + step.result.duration_s, _END, self._end, engine, step.records)

    def _end(self, engine: _Engine, records: list[RequestRecord], now: float) -> None:
        engine.busy = False
        self._took(engine, records, now)

    def _took(self, engine: _Engine, records: list[RequestRecord], now: float) -> None:
        """A step's records are out: take them, hand finished prefills off, and plan the
        engine's next step (at once while it has work; the prefill engine's at the next
        arrival; the decode engine's when an import is delivered)."""
        if engine is self.prefill:
            self._prefilled(records, now)
        else:
            bm = self.decode.scheduler.bm
            for rec in records:
                self.decode.executor.release(rec.request_id)
                part = self._parts[rec.request_id]
                if rec.status == "rejected" and "KV cache" in rec.reject_reason \
                        and part.prompt_len + part.output_len - 1 <= bm.num_gpu_blocks * bm.block_size:
                    self.decode_rejections_for_memory += 1
            self.decode.records += records
        if self._waiting:
            self._hand_off(now)
        if engine.scheduler.has_unfinished():
            self._wake(engine, now)
        elif engine is self.prefill and self._next_arrival < len(self.pending):
            self._wake(engine, max(now, self.pending[self._next_arrival].arrival_s))
        self.progress.update(len(self.prefill.records) + len(self.decode.records), now,
                             len(self.prefill.steps) + len(self.decode.steps), _Counts(self))

    # ------------------------------------------------------------------ prefill side
    def _arrive(self, req: Request, now: float) -> None:
        if req.output_len == 1:   # served whole by the prefill engine
            part = req
        else:
            part = prefill_part(req)
            self._originals[req.request_id] = req
            self.held.expect(part.seqs[0])
        self._parts[req.request_id] = part
        self.prefill.executor.requests[req.request_id] = part
        self.prefill.scheduler.add_request(part, now)

    def _blocked(self, now: float) -> bool:
        """As `PrefillReplica._blocked` of the simulator: nothing runs, requests wait,
        blocks are held, and the waiting request the policy picks now does not fit. Asked
        at each start of a prefill step; a release or an arrival starts the next."""
        sched, bm = self.prefill.scheduler, self.held
        if sched.num_running or sched.num_swapped or not sched.num_waiting or not bm.num_held_blocks:
            return False
        head = sched.policy.peek(now)
        return head is not None and bm.can_allocate(
            head.seqs[0].num_tokens, (), max_total_tokens=head.prompt_len + head.max_tokens,
            expected_total_tokens=head.prompt_len + head.output_len) is not AllocStatus.OK

    def _prefilled(self, records: list[RequestRecord], now: float) -> None:
        """Queue finished prefills for a decode engine; keep the other records as final."""
        executor = self.prefill.executor
        for rec in records:
            rid = rec.request_id
            if rec.status == "rejected" and "empty KV cache" in rec.reject_reason \
                    and self.held.num_held_blocks:
                raise RuntimeError(f"the prefill engine rejected request {rid} while held blocks "
                                   "were to be released (a bug in servelab)")
            req = self._originals.pop(rid, None)
            part = self._parts[rid]
            tokens = part.seqs[0].output_token_ids
            stopped = not self.replay and bool(tokens) and tokens[-1] in executor.eos_ids
            if req is None or rec.status != "finished" or stopped:   # it ends here
                if req is not None and rec.status == "finished":
                    self.held.release((rid, 0))
                elif req is not None:
                    self.held.forget((rid, 0))
                self.prefill.records.append(rec)
                executor.release(rid)
                continue
            executor.hand_over(rid, self.decode.executor)
            executor.release(rid)
            copied = -(-req.prompt_len // self.held.block_size)
            h = Handoff(rid, 0, req.prompt_len, copied * self.block_bytes,
                        self.held.held_blocks((rid, 0)), req.arrival_s, rec.scheduled_s,
                        rec.first_token_s)
            self._waiting.append((h, req, rec))

    # ------------------------------------------------------------------ handoffs
    def _hand_off(self, now: float) -> None:
        """Land waiting prefills, oldest first, while the decode engine has room; copy
        each one's prompt KV at once and deliver it when the copy's time has passed."""
        dbm = self.decode.scheduler.bm
        while self._waiting:
            h, req, rec = self._waiting[0]
            status = landing_status(dbm, req)
            if status is AllocStatus.OK and self._decode_has_preempted_waiting():
                status = AllocStatus.LATER
            if status is AllocStatus.LATER:
                return
            self._waiting.popleft()
            part = decode_part(req, rec, keep_token_times=True)
            part.seqs[0].output_token_ids = list(self._parts[req.request_id].seqs[0].output_token_ids)
            self._parts[req.request_id] = part
            if status is AllocStatus.NEVER:   # the decode scheduler rejects it, with its reason
                self._release(h, now)
                self._deliver(part, now)
                continue
            land(dbm, req)
            h.decode_replica, h.landed_s = 0, now
            seconds = self._copy(req)
            h.transfer_start_s = max(now, self._link_free_s)
            h.transfer_end_s = self._link_free_s = h.transfer_start_s + seconds
            self._at(h.transfer_end_s, _END, self._transfer_done, h, part)

    def _copy(self, req: Request) -> float:
        """Copy the prompt's blocks, prefill table to decode table; the measured seconds."""
        seq_id = (req.request_id, 0)
        n = -(-req.prompt_len // self.held.block_size)
        pairs = list(zip(self.held.block_table(seq_id)[:n],
                         self.decode.scheduler.bm.block_table(seq_id)[:n]))
        source = self.prefill.executor.runner.kv_cache
        self._timer.start()
        source.copy_blocks_to(self.decode.executor.runner.kv_cache, pairs)
        return self._timer.stop()

    def _transfer_done(self, h: Handoff, part: Request, now: float) -> None:
        self._release(h, now)
        self._deliver(part, now)

    def _release(self, h: Handoff, now: float) -> None:
        """Free the prefill blocks of a request whose KV was sent (or can never be)."""
        self.held.release((h.request_id, 0))
        h.released_s = now
        self._handoffs.append(h)
        if self.prefill.scheduler.has_unfinished():
            self._wake(self.prefill, now)

    def _deliver(self, part: Request, now: float) -> None:
        """The decode scheduler receives `part` (an import, unless it never fits)."""
        sched, seq_id = self.decode.scheduler, (part.request_id, 0)
        self.decode.executor.requests[part.request_id] = part
        self._imports.append(part)
        if not sched.add_request(part, now) and sched.bm.has_seq(seq_id):
            sched.bm.free(seq_id)   # refused at arrival (admission control): drop its blocks
        self._wake(self.decode, now)

    def _decode_has_preempted_waiting(self) -> bool:
        """Does a request other than a not-yet-admitted import wait on the decode engine
        (one preempted by recompute, which needs free memory)? `DecodeReplica`'s rule."""
        waiting = self.decode.scheduler.num_waiting
        if not waiting:
            self._imports.clear()
            return False
        self._imports = [r for r in self._imports if r.status is RequestStatus.WAITING]
        return waiting > len(self._imports)

    # ------------------------------------------------------------------ results
    @property
    def records(self) -> list[RequestRecord]:
        """Every request's final record, by id: the decode engine's for a handed-off
        request, the prefill engine's for the others."""
        return sorted(self.prefill.records + self.decode.records, key=lambda r: r.request_id)

    @property
    def steps(self) -> list[StepRecord]:
        """Both engines' steps by start time (ties: the prefill engine's first)."""
        return sorted(self.prefill.steps + self.decode.steps, key=lambda s: s.start_s)

    @property
    def preempted(self) -> dict[PreemptionMode, int]:
        return {m: self.prefill.preempted[m] + self.decode.preempted[m] for m in PreemptionMode}

    def outputs(self) -> dict[int, list[list[int]]]:
        """request_id -> its sample's token ids (empty for a rejected request)."""
        status = {r.request_id: r.status for r in self.records}
        return {rid: [list(part.seqs[0].output_token_ids) if status[rid] == "finished" else []]
                for rid, part in sorted(self._parts.items())}

    def handoffs(self) -> RecordTable:
        """Completed handoffs, by request id."""
        return self._handoffs.table().sorted_by("request_id")

    def run_outputs(self, summary: dict, device: str):
        """handoffs.<format> and disaggregation.json as the simulator writes them: its
        `DisaggregationOutputs`, holding `handoffs()` and `report(summary, device)`."""
        from servelab.simulator.disaggregated_run import DisaggregationOutputs

        return DisaggregationOutputs(self.handoffs(), self.report(summary, device))

    def report(self, summary: dict, device: str) -> dict:
        """disaggregation.json: the simulator's keys (`simulator.disaggregated_run`)
        where they apply, in ms, bytes and blocks; the link is the in-process copy."""
        from servelab.simulator.disaggregated_run import handoff_statistics

        span = summary.get("duration") or 0.0
        stats = handoff_statistics(self.handoffs(), self.block_bytes, span)
        transfers = stats["transfers"]   # measured copies
        seconds = transfers["seconds"]
        transfers.update(blocks=transfers["bytes"] // self.block_bytes,
                         bytes_per_s=transfers["bytes"] / seconds if seconds > 0 else None,
                         link_busy_fraction=seconds / span if span else None)
        engines = (("prefill", self.prefill), ("decode", self.decode))
        return {
            "layout": {name: {"replicas": 1, "kv_blocks": e.scheduler.bm.num_gpu_blocks}
                       for name, e in engines}
                      | {"device": device, "kv_link": LINK, "kv_transfer": KV_TRANSFER,
                         "block_bytes": self.block_bytes},
            "requests": {"handed_off": stats["requests"]["handed_off"],
                         "ended_on_prefill_pool": len(self.prefill.records),
                         "fit_no_decode_replica": stats["requests"]["fit_no_decode_replica"],
                         "decode_rejections_for_memory": self.decode_rejections_for_memory},
            "ttft_ms": stats["ttft_ms"],
            "handoff_ms": stats["handoff_ms"],
            "transfers": transfers,
            "back_pressure": stats["back_pressure"],
            "utilisation": {name: _use(e.steps, span) for name, e in engines},
        }


def _use(steps: list[StepRecord], span: float) -> dict[str, float | None]:
    """An engine's busy fraction (its step time over the run's span) and KV use (blocks
    used over total, weighted by step time), as `simulator.disaggregated_run` counts them."""
    busy = sum(s.duration_s for s in steps)
    kv = sum(s.kv_blocks_used / s.kv_blocks_total * s.duration_s for s in steps)
    return {"gpu_busy_fraction": busy / span if span > 0 else 0.0,
            "mean_kv_usage": kv / busy if busy else None}


class _Counts:
    """What the progress line shows of both engines together."""

    def __init__(self, server: DisaggregatedServer) -> None:
        p, d = server.prefill.scheduler, server.decode.scheduler
        self.num_running = p.num_running + d.num_running
        self.num_waiting = p.num_waiting + d.num_waiting
        self.num_swapped = p.num_swapped + d.num_swapped
