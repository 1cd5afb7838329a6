"""Admission's memory side: can a request get its KV blocks, and could any waiting one?

The scheduler decides when to try (policy order, token budget, seats: `Scheduler._admit`);
`KVAdmission` answers whether memory allows it, in the block manager's terms:

- `never_fits`: at arrival, a request that could not fit even in an empty cache;
- `allocate`: blocks for every live sequence of a request, all or nothing;
- `would_fit`, `freeable_blocks`: for a preemptive policy's waiting head, whether it would
  get its blocks, counted without cache hits, in the free memory or in what preempting
  some running requests would free;
- `can_swap_in`, `swap_in`: a swapped request's return to the GPU, its blocks offered to
  the prefix cache again.

An import is a waiting sequence that already holds its blocks: its KV was computed
elsewhere and written into blocks allocated for it before it was added (a disaggregated
decode replica's request: `simulator/kv_handoff.py`). Admission takes it as it
is, with the computed tokens its importer set, and it needs no free memory.

With prefix caching, a sequence's block content keys are built from the request at each
look-up (`Request.block_contents`) and handed to the block manager, which hashes them.

The simulator's speed layer builds each waiting sequence's keys and chain hashes once,
and adds a memo of refused admissions and a test for fast-forward runs
(`simulator/speed/admission.py` `MemoKVAdmission`).
"""
from __future__ import annotations

from typing import Hashable, Sequence as Sequence_

from servelab.config import SchedulerConfig
from servelab.memory.base import AllocStatus, BlockManager
from servelab.policies.base import SchedulerError
from servelab.request import Request, Sequence


class KVAdmission:
    """The memory checks of one scheduler's admission (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *,
                 prefix_caching: bool) -> None:
        self._config = config
        self._bm = block_manager
        self._prefix_caching = prefix_caching

    def never_fits(self, req: Request) -> str | None:
        """Why `req` can never run (the reason a rejection gives), or None."""
        cfg = self._config
        if req.prompt_len + 1 > cfg.max_model_len:
            return f"prompt of {req.prompt_len} tokens + 1 exceeds max_model_len {cfg.max_model_len}"
        if cfg.chunked_prefill is None and req.prompt_len > cfg.max_num_batched_tokens:
            return (f"prompt of {req.prompt_len} tokens exceeds the step token budget "
                    f"{cfg.max_num_batched_tokens} and chunked prefill is off")
        if req.n > cfg.max_num_seqs:
            return f"n={req.n} samples exceed max_num_seqs {cfg.max_num_seqs}"
        status = self._bm.can_allocate(req.prompt_len + 1, (),
                                       max_total_tokens=req.prompt_len + req.max_tokens,
                                       expected_total_tokens=req.prompt_len + req.output_len)
        if status is AllocStatus.NEVER:
            return f"prompt of {req.prompt_len} tokens + 1 can never fit in the KV cache"
        return None

    def allocate(self, req: Request) -> AllocStatus:
        """Allocate blocks for every live sequence of a request, all or nothing; each
        allocated sequence's computed tokens are its prefix-cache hits."""
        bm = self._bm
        done: list[Sequence] = []
        max_total, expected_total = req.prompt_len + req.max_tokens, req.prompt_len + req.output_len
        for s in req.seqs:
            if s.finished or bm.has_seq(s.seq_id):   # an import holds its blocks already
                continue
            contents = self.block_keys(req, s) if self._prefix_caching else ()
            status = bm.can_allocate(s.num_tokens, contents, max_total_tokens=max_total,
                                     expected_total_tokens=expected_total)
            if status is not AllocStatus.OK:
                for d in done:
                    bm.free(d.seq_id)
                    d.num_computed_tokens = 0
                return status
            s.num_computed_tokens = bm.allocate(s.seq_id, s.num_tokens, contents,
                                                max_total_tokens=max_total,
                                                expected_total_tokens=expected_total)
            s.prefill_len = s.num_tokens
            done.append(s)
        if self._prefix_caching and req.cached_tokens is None:  # the first admission
            req.cached_tokens = sum(s.num_computed_tokens for s in done)
            req.cpu_cached_tokens = sum(bm.host_hit_tokens(s.seq_id) for s in done)
        return AllocStatus.OK

    def block_keys(self, req: Request, seq: Sequence) -> Sequence_[Hashable]:
        """The content keys of the sequence's full blocks (speed layer hook: it keeps
        them between look-ups). O(blocks)."""
        return req.block_contents(seq, self._bm.block_size)

    def cached_tokens(self, req: Request) -> int:
        """Tokens of the live sequences of a waiting `req` that the prefix cache would
        serve if it were admitted now (0 without prefix caching). O(blocks)."""
        if not self._prefix_caching:
            return 0
        bm = self._bm
        return sum(bm.cached_prefix_tokens(s.num_tokens, self.block_keys(req, s))
                   for s in req.seqs if not s.finished)

    def forget(self, req: Request) -> None:
        """`req` was rejected while waiting (speed layer hook: kept keys are dropped)."""

    def known_later(self, req: Request) -> bool:
        """Is `req` known not to get its blocks now, without looking? Never here (speed
        layer hook: a memo of the last refusal answers in O(1))."""
        return False

    def can_swap_in(self, req: Request, beside_running: bool) -> bool:
        """Can swapped `req` come back to the GPU now? Beside running requests it also
        needs a free block per sequence to grow into, or it would come back unable to
        grow and be preempted again. Raises SchedulerError if it never can."""
        bm = self._bm
        seq_ids = [s.seq_id for s in req.seqs if not s.finished]
        status = bm.can_swap_in(seq_ids)
        if status is AllocStatus.NEVER:
            raise SchedulerError(f"swapped request {req.request_id} can never return to the GPU")
        if status is not AllocStatus.OK:
            return False
        return not beside_running or bm.num_free_blocks >= sum(
            len(bm.block_table(sid)) + 1 for sid in seq_ids)

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Move swapped `req`'s blocks back to the GPU (`can_swap_in` said it can);
        returns the (cpu, gpu) block copies. With prefix caching, its blocks are offered
        to the cache again: they left it when they were swapped out."""
        bm = self._bm
        copies = bm.swap_in([s.seq_id for s in req.seqs if not s.finished])
        if self._prefix_caching:
            for s in req.seqs:
                if not s.finished:
                    bm.mark_computed(s.seq_id, s.num_computed_tokens)
        return copies

    def would_fit(self, req: Request, extra_free: int = 0) -> bool:
        """Would the request's live sequences get their blocks with `extra_free` more
        blocks free, the watermark kept (counting blocks, as admission of sequences
        without cached contents does)?"""
        bs, bm = self._bm.block_size, self._bm
        need = sum(-(-s.num_tokens // bs) for s in req.seqs
                   if not s.finished and not bm.has_seq(s.seq_id))   # an import needs none
        return bm.num_free_blocks + extra_free - need >= bm.watermark_blocks

    def freeable_blocks(self, victims: list[Request], running: dict[int, Request]) -> int:
        """GPU blocks that preempting every one of `victims` would free: those no other
        running request holds, each counted once (samples of one request share their
        prompt's blocks, and prefix caching shares blocks across requests). O(blocks of
        the running requests), paid only in a step whose waiting head does not fit."""
        table = self._bm.block_table
        chosen = {r.request_id for r in victims}
        freed: set[int] = set()
        for r in victims:
            for s in r.seqs:
                if not s.finished:
                    freed.update(table(s.seq_id))
        for r in running.values():
            if r.request_id not in chosen:
                for s in r.seqs:
                    if not s.finished:
                        freed.difference_update(table(s.seq_id))
        return len(freed)
