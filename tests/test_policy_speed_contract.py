"""The simulator scheduler's memory of a refused preemption (`simulator/speed/scheduler.py`,
`_Refusals`) against the plain scheduler, which asks the policy every step: the same
decisions, and the policy asked only when the answer may have changed."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from servelab.policies import MLFQPolicy, Policy, PriorityPolicy

from sched_harness import FakeExecutor, make_requests, simulate
from test_scheduler_properties import SETTINGS, _decisions, workloads

PREEMPTIVE = st.one_of(
    st.tuples(st.just("priority"), st.fixed_dictionaries({
        "preemptive": st.just(True), "aging_rate": st.sampled_from([0.0, 1.0])})),
    st.tuples(st.just("mlfq"), st.fixed_dictionaries({
        "quantum_tokens": st.sampled_from([1, 2, 8]), "quantum_ratio": st.sampled_from([1.0, 2.0]),
        "num_levels": st.sampled_from([2, 4]),
        "prefill_tokens_per_output_token": st.sampled_from([1.0, 16.0]),
        "max_wait_s": st.sampled_from([None, 0.01, 1.0])})))


@settings(SETTINGS, max_examples=80)
@given(workloads(), PREEMPTIVE, st.booleans())
def test_remembered_refusals_decide_as_asking_every_step(w, policy, fast_forward):
    """Every step's decisions and every record are the same with the memory of refused
    preemptions as when the policy is asked again each step (preemptive policies, with
    and without fast-forward)."""
    reqs, sched, cache, _, _ = w
    name, options = policy
    a, b = (simulate([r.fresh_copy() for r in reqs], sched, cache, name, options,
                     fast_forward=fast_forward and not plain, plain=plain) for plain in (False, True))
    _assert_same(a, b, fast_forward)


def _assert_same(fast, plain, fast_forward: bool) -> None:
    """The same records; the same decisions in every step, where no step was skipped."""
    by_id = lambda run: sorted(run.records, key=lambda r: r.request_id)  # noqa: E731
    assert by_id(fast) == by_id(plain)
    if not fast_forward:
        assert _decisions(fast) == _decisions(plain)


class _Counting:
    """Mixin: the scheduler steps (by their output's time) in which `may_preempt_for` was
    asked."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.asked_at: list[float] = []
        self.now = 0.0

    def peek(self, now):
        self.now = now
        return super().peek(now)

    def may_preempt_for(self, head, running):
        if not self.asked_at or self.asked_at[-1] != self.now:
            self.asked_at.append(self.now)
        return super().may_preempt_for(head, running)


class _CountingMLFQ(_Counting, MLFQPolicy):
    pass


class _CountingPriority(_Counting, PriorityPolicy):
    order_moves = False   # its peek only notes the time


def _asked(policy, memo: bool, reqs, sched, cache, fast_forward: bool = False):
    """Run the simulator's scheduler (`memo`) or the plain one (never fast-forwarded)."""
    run = simulate(reqs(), sched, cache, policy, fast_forward=fast_forward and memo, plain=not memo)
    return run, policy.asked_at


def test_mlfq_is_asked_again_when_the_running_request_sinks():
    """A (16-token prompt, 120 tokens) runs at level 1 when B (64-token prompt: level 1)
    arrives and does not fit: no victim. The memory lasts the 96 - drawn tokens A draws
    before it sinks to level 2; then B preempts it, and A, waiting at level 2, is refused
    once more (B stays at level 1). The plain path asks in every step from B's arrival
    until A is readmitted; the decisions are the same, with and without fast-forward."""
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, chunked_prefill=None,
                            max_model_len=512)
    cache = CacheConfig(block_size=16, num_gpu_blocks=10, watermark=0.0)
    reqs = lambda: make_requests([(0.0, 16, 120), (0.855, 64, 4)])  # noqa: E731
    options = dict(prefill_tokens_per_output_token=1.0, max_wait_s=None)
    for fast_forward in (True, False):
        remembered, asked = _asked(_CountingMLFQ(**options), True, reqs, sched, cache, fast_forward)
        plain, asked_plain = _asked(_CountingMLFQ(**options), False, reqs, sched, cache)
        _assert_same(remembered, plain, fast_forward)
    steps = [o.now for o in plain.outputs]   # step by step
    arrived = steps.index(asked_plain[0])
    preempted = next(i for i, o in enumerate(plain.outputs) if o.preempted)
    assert asked == [steps[arrived], steps[preempted], steps[preempted + 1]]
    readmitted = next(i for i in range(preempted + 1, len(steps))
                      if any(e.request_id == 0 for e in plain.outputs[i].scheduled))
    assert asked_plain == steps[arrived:readmitted] and preempted - arrived > 5


def test_mlfq_is_asked_again_after_an_admission():
    """Levels end at 2, 6, 14, 30, 62, ... tokens of service (a prompt token: 1/8 of one).
    R (level 0, 40 tokens) runs when H (200-token prompt: level 4) arrives and does not
    fit: no victim, and R would need 62 tokens to sink below H. X (100-token prompt: level
    3, 14 tokens of service skipped) arrives, is admitted before H, and sinks below H
    after 48 tokens, while R finishes first: the memory of H's refusal must end with X's
    admission, or H would be admitted only when R would have sunk (10 steps later)."""
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, chunked_prefill=None,
                            max_model_len=512)
    cache = CacheConfig(block_size=16, num_gpu_blocks=13, watermark=0.0)
    reqs = lambda: make_requests([(0.0, 8, 40), (0.025, 200, 4), (0.035, 100, 100)])  # noqa: E731
    options = dict(quantum_tokens=2, num_levels=6, prefill_tokens_per_output_token=8.0,
                   max_wait_s=None)
    remembered, asked = _asked(_CountingMLFQ(**options), True, reqs, sched, cache)
    plain, asked_plain = _asked(_CountingMLFQ(**options), False, reqs, sched, cache)
    assert _decisions(remembered) == _decisions(plain)
    steps = [o.now for o in plain.outputs]
    x_admitted = next(i for i, o in enumerate(plain.outputs)
                      if any(e.request_id == 2 for e in o.scheduled))
    x_preempted = next(i for i, o in enumerate(plain.outputs) if o.preempted)
    assert plain.outputs[x_preempted].preempted[0][0] == 2
    assert asked == [asked_plain[0], steps[x_admitted + 1], steps[x_preempted],
                     steps[x_preempted + 1]]


class _AcceptsAll(FakeExecutor):
    """A speculating engine's executor whose every proposed token is accepted: a verify
    step of K' + 1 tokens draws them all."""

    def execute(self, out):
        result = super().execute(out)
        result.produced = {e.seq_id: e.num_tokens for e in out.scheduled
                           if not e.is_prefill and e.num_tokens > 1}
        return result


def test_mlfq_memory_counts_every_token_a_speculating_step_draws():
    """With speculation (K = 3, every proposal accepted) A draws 4 tokens a step, so it
    sinks below B four times sooner than one token a step would say: the memory of B's
    refusal must end by then. The decisions equal the plain path's."""
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, chunked_prefill=None,
                            max_model_len=512, speculative=SpeculativeConfig(
                                method="ngram", num_speculative_tokens=3))
    cache = CacheConfig(block_size=16, num_gpu_blocks=10, watermark=0.0)
    reqs = [(0.0, 16, 120), (0.215, 64, 4)]
    options = dict(prefill_tokens_per_output_token=1.0, max_wait_s=None)
    remembered, plain = (simulate(make_requests(reqs), sched, cache, "mlfq", options,
                                  executor=_AcceptsAll(), plain=plain) for plain in (False, True))
    assert _decisions(remembered) == _decisions(plain)
    assert [rid for o in plain.outputs for rid, _ in o.preempted] == [0]


def test_priority_is_asked_once_while_nothing_changes():
    """Preemptive priority: a priority-1 head (3 blocks) arrives when two priority-1
    requests hold 10 of 12 blocks: no victim. It is asked once, not in every step until
    they finish, and admitted in the same step either way."""
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunked_prefill=None,
                            max_model_len=512)
    cache = CacheConfig(block_size=16, num_gpu_blocks=12, watermark=0.0)
    reqs = lambda: make_requests([(0.0, 80, 10), (0.0, 80, 10), (0.05, 48, 4)],  # noqa: E731
                                 priority=1)
    remembered, asked = _asked(_CountingPriority(preemptive=True), True, reqs, sched, cache)
    plain, asked_plain = _asked(_CountingPriority(preemptive=True), False, reqs, sched, cache)
    assert _decisions(remembered) == _decisions(plain)
    assert len(asked) == 1 and len(asked_plain) > 3


class _Alternating(Policy):
    """A policy whose head moves with time and that cannot say where it goes next: the
    earliest arrival in even 50 ms windows, the latest in odd ones (no `candidates`)."""

    order_moves = True

    def waiting_key(self, req):
        return (req.arrival_s, req.request_id)

    def peek(self, now):
        ordered = self._queue.ordered()
        if not ordered:
            return None
        return ordered[0] if int(now / 0.05) % 2 == 0 else ordered[-1]


def test_a_policy_whose_head_moves_must_say_so():
    with pytest.raises(TypeError, match="overrides peek but does not declare order_moves"):
        class _Silent(Policy):
            def waiting_key(self, req):
                return (req.request_id,)

            def peek(self, now):
                return None


def test_the_fast_forward_steps_aside_for_a_moving_order_it_cannot_follow():
    """With requests waiting, a policy whose order moves and that names no candidates gets
    no fast-forwarded steps; with none waiting the run is fast-forwarded as any other; the
    records equal the plain scheduler's."""
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    cache = CacheConfig(block_size=4, num_gpu_blocks=64)
    spec = [(0.0, 8, 30), (0.0, 8, 30), (0.001, 8, 5), (0.002, 8, 5)]
    fast = simulate(make_requests(spec), sched, cache, _Alternating(), fast_forward=True)
    plain = simulate(make_requests(spec), sched, cache, _Alternating(), plain=True)
    _assert_same(fast, plain, fast_forward=True)
    assert 0 < fast.fast_forwarded
    # the two short requests wait for a seat until a long one ends: no step skipped then
    last_admitted = max(min(o.now for o in plain.outputs if any(e.request_id == rid for e in o.scheduled))
                        for rid in (2, 3))
    stepped = [o.now for o in fast.outputs]
    assert [o.now for o in plain.outputs if o.now <= last_admitted] == \
        [t for t in stepped if t <= last_admitted]
    lone = simulate(make_requests(spec[:1]), sched, cache, _Alternating(), fast_forward=True)
    assert lone.fast_forwarded == 28


class _SinkingPriority(PriorityPolicy):
    """Preemptive priority whose running requests become preemptible once they have drawn
    8 tokens, and that does not say when (no `tokens_until_preemptible`)."""

    reorders_running = True

    def may_preempt_for(self, head, running):
        return running.num_output_tokens >= 8 or super().may_preempt_for(head, running)


def test_the_fast_forward_steps_aside_for_a_reordering_policy_that_cannot_say_when():
    """A long request runs; a lower-priority one that does not fit arrives and may
    preempt it only once it has drawn 8 tokens. The simulator's scheduler may neither
    skip steps nor keep its memory of the refusal past that point without being told
    when it comes: it steps one by one while the head waits, and decides as the plain
    scheduler does."""
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, chunked_prefill=None,
                            max_model_len=512)
    cache = CacheConfig(block_size=16, num_gpu_blocks=10, watermark=0.0)
    spec = [(0.0, 96, 40, {"priority": 0}), (0.02, 96, 4, {"priority": 1})]
    options = dict(preemptive=True)
    fast = simulate(make_requests(spec), sched, cache, _SinkingPriority(**options), fast_forward=True)
    plain = simulate(make_requests(spec), sched, cache, _SinkingPriority(**options), plain=True)
    _assert_same(fast, plain, fast_forward=True)
    preempted = next(o.now for o in plain.outputs if o.preempted)
    assert [o.now for o in plain.outputs if 0.02 <= o.now <= preempted] == \
        [o.now for o in fast.outputs if 0.02 <= o.now <= preempted]
