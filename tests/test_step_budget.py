"""StepBudget (policies/budget.py): how much of a request's work fits in what is left of
a step, on its own. The scheduler's use of it is covered by the golden timelines and the
property tests."""
from __future__ import annotations

from servelab.config import SchedulerConfig
from servelab.outputs import ScheduledSeq
from servelab.policies.budget import StepBudget
from servelab.request import Request, Sequence


def budget(tokens: int, seqs: int, chunked_prefill: int | None) -> StepBudget:
    return StepBudget(SchedulerConfig(max_num_batched_tokens=tokens, max_num_seqs=seqs,
                                      chunked_prefill=chunked_prefill, max_model_len=64))


def test_a_prompt_runs_in_chunks_and_commits_take_tokens_and_seats():
    step = budget(10, 4, chunked_prefill=4)
    req = Request(7, 0.0, prompt_len=10, output_len=5)
    entries = step.plan(req, allocated=False)
    assert entries == [ScheduledSeq(7, (7, 0), 4, 0, 0, True)]   # a chunk draws no token
    step.commit(req, entries)
    assert (step.tokens, step.seqs, step.entries) == (6, 3, {7: entries})
    req.seqs[0].num_computed_tokens = 8                            # the last chunk draws
    assert step.plan(req, allocated=False) == [ScheduledSeq(7, (7, 0), 2, 8, 1, True)]


def test_without_chunking_a_fresh_prompt_runs_whole_and_a_recompute_is_split():
    step = budget(10, 4, chunked_prefill=None)
    fresh = Request(1, 0.0, prompt_len=12, output_len=5)
    assert step.plan(fresh, allocated=False) is None
    recompute = Request(2, 0.0, prompt_len=8, output_len=5,
                        seqs=[Sequence((2, 0), 12, prefill_len=12, num_output_tokens=4)])
    assert step.plan(recompute, allocated=True) == [ScheduledSeq(2, (2, 0), 10, 0, 0, True)]


def test_samples_run_partly_each_whole():
    step = budget(10, 2, chunked_prefill=4)
    req = Request(3, 0.0, prompt_len=4, output_len=5, n=3, seqs=[
        Sequence((3, i), 6, 5, prefill_len=4, num_output_tokens=2) for i in range(3)])
    req.seqs[0].finished = True
    # a finished sample takes nothing; two seats left for the two decoding samples
    assert step.plan(req, allocated=True) == [ScheduledSeq(3, (3, 1), 1, 5, 1, False),
                                              ScheduledSeq(3, (3, 2), 1, 5, 1, False)]
    step.seqs = 1
    assert step.plan(req, allocated=True) == [ScheduledSeq(3, (3, 1), 1, 5, 1, False)]
    step.tokens = 0
    assert step.plan(req, allocated=True) is None
