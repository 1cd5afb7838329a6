"""A speculating engine's decode steps: verify steps and the lookahead slots they need.

With speculative decoding (`SchedulerConfig.speculative`, `servelab/speculative.py`) a
running single-sample request does not decode one token a step: a proposer guesses K
tokens, and one forward pass verifies the last sampled token and the K proposed ones,
keeping the longest accepted prefix plus one token it samples itself (Leviathan et al.,
"Fast Inference from Transformers via Speculative Decoding", 2023; vLLM's spec-decode
scheduling reserves the KV slots of the proposed tokens ahead, "lookahead slots").

The scheduler reserves those K' + 1 slots before the step (`_schedule_verify`) and keeps
the slots of rejected positions for the next step (`Scheduler._ahead`: seq id -> slots
held beyond its computed tokens); after the step it advances the request by the tokens
produced (`_advance_verified`). The methods here are part of `Scheduler`
(policies/scheduler.py), kept apart because they are one idea of their own.
"""
from __future__ import annotations

from servelab.outputs import ScheduledSeq, StepResult
from servelab.policies.base import SchedulerError

__all__ = ["SpeculativeSteps"]


class SpeculativeSteps:
    """The verify-step part of `Scheduler` (a mixin: it uses the scheduler's `bm`,
    `config`, `_ahead` and `_make_room`)."""

    def _schedule_verify(self, req, s, k, order, i, end, now, out, step) -> int | None:
        """A speculating engine's decode of a single-sample request: the last sampled token
        and K' = min(k, tokens left to produce - 1, room below max_model_len, budget) proposed
        ones, K' + 1 tokens verified in one pass (K' = 0: a plain decode). Their KV slots are
        reserved ahead (`_ahead`); where they cannot be had without preempting, the step
        decodes plainly instead. Returns the new end of `order` (see `_make_room`), or None
        when `req` itself had to go."""
        sid = s.seq_id
        q = 1 + max(0, min(k, req.output_len - s.num_output_tokens - 1,
                           self.config.max_model_len - s.num_tokens - 1, step.tokens - 1))
        ahead = self._ahead.get(sid, 0)
        bm = self.bm
        if q > 1 and q > ahead and not bm.can_append_slots(sid, q - ahead):
            q = 1
        if q > ahead:
            if not bm.can_append_slots(sid, q - ahead):
                end = self._make_room(sid, req, order, i, end, now, out, allow_swap=True, slots=q - ahead)
                if end is None:
                    return None
            copies = bm.append_slots(sid, q - ahead)
            if copies:
                out.copies.extend(copies)
            self._ahead[sid] = q
        step.entries[req.request_id] = [ScheduledSeq(req.request_id, sid, q, s.num_computed_tokens, 1, False)]
        step.tokens -= q
        step.seqs -= 1
        return end

    def _advance_verified(self, req, seq, e, result: StepResult, t_end, ended, freed, service) -> None:
        """A speculating engine's decode of a single-sample request (`_schedule_verify`):
        it produced p tokens, 1 <= p <= its verified tokens (`StepResult.produced`, or the
        tokens sampled); their KV is now computed, the slots of rejected positions stay
        reserved as lookahead. Every produced token is an output token timed at the
        step's end; the request finishes at its length, at max_model_len or at a stop."""
        sid = seq.seq_id
        tokens = result.sampled[sid] if result.sampled is not None else None
        p = len(tokens) if tokens is not None else (result.produced or {}).get(sid, 1)
        if not 1 <= p <= e.num_tokens:
            raise SchedulerError(f"a step of {e.num_tokens} verified tokens produced {p} tokens for "
                                 f"sequence {sid}")
        seq.num_computed_tokens += p
        left = self._ahead.get(sid, 0) - p
        if left > 0:
            self._ahead[sid] = left
        else:
            self._ahead.pop(sid, None)
        if service is not None:
            acc = service.get(req.request_id)
            if acc is None:
                acc = service[req.request_id] = [0, 0]
            acc[1] += p
        stopped, max_len = result.stopped, self.config.max_model_len
        for i in range(p):
            seq.num_tokens += 1
            seq.num_output_tokens += 1
            if tokens is not None:
                seq.output_token_ids.append(tokens[i])
            if seq.num_output_tokens >= req.output_len or seq.num_tokens >= max_len \
                    or (stopped and sid in stopped and i == p - 1):
                seq.finished = True
                freed.append(sid)
                ended.append(req)
                break
        if req.first_token_s is None:
            req.first_token_s = t_end
        if self.keep_token_times:
            if req.token_times is None:
                req.token_times = []
            req.token_times.extend([t_end] * (i + 1))
