"""One step's budget: what is left of it, and how much of a request's work fits in it.

The scheduler (`policies/scheduler.py`) fills a step request by request — running requests,
then swapped ones, then waiting ones — asking the budget what each request's work would be
within what is left (`plan`) and committing what it runs (`commit`). The batch of plain
decodes (`policies/decode_batch.py`) takes its members' tokens out of the same budget.
A decode is one token; a prefill runs in chunks of at most `chunked_prefill` tokens, or
whole when chunking is off.
"""
from __future__ import annotations

from servelab.config import SchedulerConfig
from servelab.outputs import ScheduledSeq
from servelab.request import Request


class StepBudget:
    """What is left of one step's budget (`max_num_batched_tokens` tokens over
    `max_num_seqs` sequences), and what has been scheduled so far, by request id."""

    __slots__ = ("tokens", "seqs", "entries", "_chunk", "_whole_prompts")

    def __init__(self, config: SchedulerConfig) -> None:
        self.tokens = config.max_num_batched_tokens
        self.seqs = config.max_num_seqs
        self.entries: dict[int, list[ScheduledSeq]] = {}
        self._chunk = config.chunked_prefill or (1 << 62)
        self._whole_prompts = config.chunked_prefill is None

    def plan(self, req: Request, allocated: bool) -> list[ScheduledSeq] | None:
        """The work for a request this step within what is left of the budget, or None
        if none fits. The samples of a request may run partly (those that fit), each
        sample's work being whole (one decode, or one prefill chunk). Before allocation
        (`allocated=False`) every pending token counts as prefill."""
        tokens_left, seqs_left = self.tokens, self.seqs
        entries = []
        fork = len(req.seqs) < req.n
        rid = req.request_id
        for s in req.seqs:
            if s.finished:
                continue
            if tokens_left <= 0 or seqs_left <= 0:
                break
            if allocated and not s.is_prefilling:
                entries.append(ScheduledSeq(rid, s.seq_id, 1, s.num_computed_tokens, 1, False))
                tokens_left -= 1
                seqs_left -= 1
                continue
            pending = s.num_tokens - s.num_computed_tokens
            chunk = min(pending, self._chunk, tokens_left)
            # With chunking off a fresh prompt runs whole; a recompute longer than the
            # budget is still split, or it could never run again.
            if chunk < pending and self._whole_prompts and s.num_output_tokens == 0:
                break
            samples = (req.n if fork else 1) if chunk == pending else 0
            entries.append(ScheduledSeq(rid, s.seq_id, chunk, s.num_computed_tokens, samples, True))
            tokens_left -= chunk
            seqs_left -= 1
        return entries or None

    def commit(self, req: Request, entries: list[ScheduledSeq]) -> None:
        """`req` runs `entries` (a plan) this step: take their tokens and sequences."""
        self.entries[req.request_id] = entries
        self.tokens -= sum(e.num_tokens for e in entries)
        self.seqs -= len(entries)
