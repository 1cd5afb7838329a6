"""The real executor: one scheduler step on the model runner, timed.

`RealExecutor.execute(output)` does what the scheduler decided, in the order the block
manager assumes: offloads of evicted prefix blocks to the CPU tier (first of all: the
step's other moves may write the GPU blocks they read, a load into a block evicted in the
same step included), swap-outs (GPU -> CPU), swap-ins (CPU -> GPU), loads of CPU-tier
prefix hits (into blocks the swap-outs may have freed), copy-on-write block copies, then
one forward pass over the flattened batch, then sampling. It answers with the tokens
drawn per sequence, the samples that drew EOS, and how long the step took — the same
`StepResult` the simulator's cost model produces, so `engine_step` drives both alike.

What a step computes for a scheduled entry is the sequence's tokens at positions
[context_len, context_len + num_tokens), where a sample's tokens are the prompt followed by
that sample's own output tokens. A request with n samples is prefilled once by sample 0;
the entry that completes its prompt asks for n tokens, drawn from the same logits row, each
with its own generator.

Randomness: sample i of request r draws from a CPU generator seeded with `r.seed + i`
(`Request.seed`) or, for requests without a seed, `derive_seed(run_seed, r, i)`. Each
draw uses one number of its own stream, so tokens do not depend on batch mates.

Speculative decoding (`servelab.backends.speculative`): a decode entry of K' + 1 > 1 tokens
is a verify step. The proposer (which also sees the step's prefill chunks) proposes K'
tokens after the sequence's last sampled token, the target computes [last, proposals] in
the same forward pass as everything else, with logits at each position, and rejection
sampling keeps the accepted proposals and one token more; `acceptance` counts them per
request. Without a proposer the step is computed exactly as it always was.

Timing: on a GPU the step is bracketed by two CUDA events and the host waits once, on
the sampled token ids it needs anyway; on a CPU, perf_counter. Either way the duration
covers the block moves, the batch assembly, the forward pass and sampling (and the
proposer's work when speculating).
"""
from __future__ import annotations

import itertools
import time
from typing import Iterable, Mapping

import numpy as np
import torch

from servelab.backends.attention import SeqWork
from servelab.backends.model import ModelRunner
from servelab.backends.sampling import (SamplingParams, derive_seed, make_generator,
                                        probabilities, sample)
from servelab.backends.speculative import (AcceptanceCounts, Proposal, Proposer, VerifyTask,
                                           rejection_sample, verify_greedy)
from servelab.outputs import ScheduledSeq, SchedulerOutput, StepResult
from servelab.request import Request, SeqId

__all__ = ["RealExecutor", "StepTimer", "synthetic_prompt", "with_prompt_tokens"]

_PROMPT_STREAM = 0x5EED_0F_70CE  # separates prompt seeds from sampling seeds


# --------------------------------------------------------------------------- prompts


def synthetic_prompt(req: Request, vocab_size: int, seed: int) -> tuple[int, ...]:
    """Deterministic prompt token ids for a request that has only a length.

    Tokens inside the trace's hashed prefix blocks (`prefix_hashes`, each covering
    `prefix_block_size` tokens) depend only on the block's hash, so equal hashes give equal
    tokens and the prefix cache sees the sharing the trace describes; the rest depends on
    (seed, request_id). Cost: one numpy draw per hashed block plus one for the tail."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    tokens: list[int] = []
    if req.prefix_hashes is not None:
        block = req.prefix_block_size
        for h in req.prefix_hashes:
            if len(tokens) >= req.prompt_len:
                break
            rng = np.random.default_rng(derive_seed(seed ^ _PROMPT_STREAM, h, 1))
            tokens.extend(rng.integers(0, vocab_size, block).tolist())
        tokens = tokens[:req.prompt_len]
    rest = req.prompt_len - len(tokens)
    if rest:
        rng = np.random.default_rng(derive_seed(seed ^ _PROMPT_STREAM, req.request_id, 0))
        tokens.extend(rng.integers(0, vocab_size, rest).tolist())
    return tuple(tokens)


def with_prompt_tokens(req: Request, vocab_size: int, seed: int) -> Request:
    """`req` if it has prompt token ids, else a fresh copy holding synthetic ones (ids out of
    the vocabulary are an error: the model cannot embed them)."""
    if req.prompt_token_ids is not None:
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {req.request_id}: prompt token id(s) {bad[:5]} outside "
                             f"the model's vocabulary [0, {vocab_size})")
        return req
    fresh = req.fresh_copy()
    fresh.prompt_token_ids = synthetic_prompt(req, vocab_size, seed)
    return fresh


# --------------------------------------------------------------------------- timing


class StepTimer:
    """Measures one step: CUDA events on a GPU (read after the step's one host wait),
    perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since `start`. On a GPU call it after the step's results reached the host,
        so the wait here is for an already-finished stream."""
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


# --------------------------------------------------------------------------- executor


class RealExecutor:
    """Executes scheduler outputs on a `ModelRunner` (see the module docstring).

    `requests` is the live mapping request_id -> Request the scheduler serves (the executor
    reads prompts and each sample's output tokens from it, never writes it). `sampling`
    holds the run's temperature / top-k / top-p. With `replay=True` EOS is ignored and a
    request runs to its trace length; otherwise a sample that draws one of
    `eos_token_id` stops. `proposer` serves the verify steps of a speculating scheduler.
    """

    def __init__(self, runner: ModelRunner, requests: Mapping[int, Request],
                 sampling: SamplingParams = SamplingParams(), *, replay: bool,
                 eos_token_id: int | Iterable[int] | None, seed: int,
                 proposer: Proposer | None = None) -> None:
        self.runner = runner
        self.requests = requests
        self.sampling = sampling
        self.replay = replay
        if eos_token_id is None:
            self.eos_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_ids = frozenset((eos_token_id,))
        else:
            self.eos_ids = frozenset(int(t) for t in eos_token_id)
        self.seed = seed
        self.timer = StepTimer(runner.device)
        self._generators: dict[SeqId, torch.Generator] = {}
        self._prompts: dict[int, tuple[int, ...]] = {}
        self.proposer = proposer
        self.runners = (runner,) if proposer is None else (runner, *proposer.runners)
        """Every runner whose KV cache follows the scheduler's block tables."""
        self.acceptance: dict[int, AcceptanceCounts] = {}
        """request_id -> its speculation counts (kept after the request finishes)."""

    # ------------------------------------------------------------------ one step
    def execute(self, out: SchedulerOutput) -> StepResult:
        runner = self.runner
        self.timer.start()
        for cache_owner in self.runners:   # each cache in the order the docstring gives
            cache_owner.offload(out.offload)
            cache_owner.swap_out(out.swap_out)
            cache_owner.swap_in(out.swap_in)
            cache_owner.load(out.load)
            cache_owner.copy_blocks(out.copies)
        sampled: dict[SeqId, list[int]] = {}
        stopped: set[SeqId] = set()
        if out.scheduled:
            entries = list(out.scheduled)
            work = [self._work(e, out.block_tables) for e in entries]
            verify = self._propose(entries, work) if self.proposer is not None else {}
            counts = [work[i].num_tokens if i in verify else 1 for i in range(len(work))]
            logits = runner.run(work, counts if verify else None)
            first = list(itertools.accumulate(counts, initial=0))   # each entry's first row
            rows, params, generators, owners = [], [], [], []
            for row, e in enumerate(entries):
                if row in verify:
                    continue
                for i in range(e.num_samples):
                    rows.append(first[row])
                    params.append(self.sampling)
                    generators.append(self._generator(e.request_id, i))
                    owners.append(e)
            if rows:
                index = torch.tensor(rows, device=logits.device)
                tokens = sample(logits.index_select(0, index), params, generators)
                for e, token in zip(owners, tokens):
                    drawn = sampled.setdefault(e.seq_id, [])
                    if not self.replay and token in self.eos_ids:
                        stopped.add((e.request_id, len(drawn)) if e.num_samples > 1 else e.seq_id)
                    drawn.append(token)
            for row, (task, proposal) in verify.items():
                e = entries[row]
                drawn = self._verify(logits[first[row]:first[row + 1]], task, proposal)
                eos = next((j for j, t in enumerate(drawn) if t in self.eos_ids), None)
                if eos is not None and not self.replay:
                    drawn = drawn[:eos + 1]
                    stopped.add(e.seq_id)
                sampled[e.seq_id] = drawn
        return StepResult(self.timer.stop(), sampled, stopped)

    # ------------------------------------------------------------------ speculation
    def _propose(self, entries: list[ScheduledSeq],
                 work: list[SeqWork]) -> dict[int, tuple[VerifyTask, Proposal]]:
        """Asks the proposer for the step's verify entries (showing it the prefill chunks
        too) and extends each one's work by its proposal; returns entry index -> (task,
        proposal) for the verify entries. Counts every decode entry's step in `acceptance`."""
        prefills, tasks, where = [], [], []
        for i, e in enumerate(entries):
            if e.is_prefill:
                prefills.append((e.seq_id, work[i]))
                continue
            self.acceptance.setdefault(e.request_id, AcceptanceCounts()).decode_steps += 1
            if e.num_tokens > 1:
                req = self.requests[e.request_id]
                tasks.append(VerifyTask(e.seq_id, e.context_len, e.num_tokens - 1,
                                        work[i].block_table, self._prompt(req),
                                        req.seqs[e.seq_id[1]].output_token_ids,
                                        self._generator(e.request_id, e.seq_id[1])))
                where.append(i)
        proposals = self.proposer.propose(prefills, tasks, self.sampling)
        for i, proposal in zip(where, proposals):
            w = work[i]
            tokens = w.token_ids + proposal.tokens
            work[i] = SeqWork(tokens, w.context_len, w.block_table, len(tokens) > 1)
        return dict(zip(where, zip(tasks, proposals)))

    def _verify(self, logits: torch.Tensor, task: VerifyTask, proposal: Proposal) -> list[int]:
        """The tokens a verify step produces from the target's logits [k + 1, V] at
        [last, proposals], counted in `acceptance`."""
        if self.sampling.is_greedy:
            drawn = verify_greedy(logits, proposal.tokens)
        else:
            target = probabilities(logits, [self.sampling] * logits.shape[0])
            drawn = rejection_sample(target, proposal.probs, proposal.tokens, task.generator)
        if proposal.tokens:
            counts = self.acceptance[task.seq_id[0]]
            counts.verify_steps += 1
            counts.proposed += len(proposal.tokens)
            counts.accepted += len(drawn) - 1
        return drawn

    def _work(self, e: ScheduledSeq, tables: Mapping[SeqId, list[int]]) -> SeqWork:
        req = self.requests[e.request_id]
        table = tables.get(e.seq_id)
        if table is None:
            raise ValueError(f"scheduler output has no block table for {e.seq_id}: build the "
                             "scheduler with emit_block_tables=True")
        start, stop = e.context_len, e.context_len + e.num_tokens
        if not e.is_prefill and e.num_tokens > 1:   # a verify step: the proposals come later
            if self.proposer is None:
                raise ValueError(f"scheduler output verifies {e.num_tokens - 1} speculative "
                                 f"tokens of {e.seq_id} but the executor has no proposer")
            stop = start + 1
        return SeqWork(self._tokens(req, e.seq_id[1], start, stop), start, table, e.is_prefill)

    def _tokens(self, req: Request, sample_index: int, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of one sample: the prompt, then that sample's outputs."""
        prompt = self._prompt(req)
        outputs = req.seqs[sample_index].output_token_ids
        p = len(prompt)
        if stop > p + len(outputs):
            raise ValueError(f"request {req.request_id} sample {sample_index}: step computes "
                             f"up to position {stop} but the sequence holds "
                             f"{p + len(outputs)} tokens")
        if stop <= p:
            return list(prompt[start:stop])
        if start >= p:
            return outputs[start - p:stop - p]
        return list(prompt[start:]) + outputs[:stop - p]

    def _prompt(self, req: Request) -> tuple[int, ...]:
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        prompt = self._prompts.get(req.request_id)
        if prompt is None:
            prompt = self._prompts[req.request_id] = synthetic_prompt(
                req, self.runner.spec.vocab_size, self.seed)
        return prompt

    def _generator(self, request_id: int, sample_index: int) -> torch.Generator | None:
        if self.sampling.is_greedy:
            return None
        key = (request_id, sample_index)
        gen = self._generators.get(key)
        if gen is None:
            req = self.requests[request_id]
            seed = (req.seed + sample_index if req.seed is not None
                    else derive_seed(self.seed, request_id, sample_index))
            gen = self._generators[key] = make_generator(seed)
        return gen

    def hand_over(self, request_id: int, to: "RealExecutor") -> None:
        """Moves a request's random streams to the executor that continues it (a
        disaggregated run's decode engine, `backends/disaggregated.py`), so that its
        samples go on drawing the numbers they would have drawn on one engine."""
        req = self.requests.get(request_id)
        for i in range(req.n if req is not None else 1):
            generator = self._generators.pop((request_id, i), None)
            if generator is not None:
                to._generators[(request_id, i)] = generator

    def release(self, request_id: int) -> None:
        """Forget a finished or rejected request's random streams and synthetic prompt."""
        self._prompts.pop(request_id, None)
        req = self.requests.get(request_id)
        for i in range(req.n if req is not None else 0):
            self._generators.pop((request_id, i), None)
            if self.proposer is not None:
                self.proposer.release((request_id, i))
