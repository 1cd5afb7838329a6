"""Admission's memory side: can a request get its KV blocks, and could any waiting one?

The scheduler decides when to try (policy order, token budget, seats: `Scheduler._admit`);
`KVAdmission` answers whether memory allows it, in the block manager's terms:

- `never_fits`: at arrival, a request that could not fit even in an empty cache;
- `allocate`: blocks for every live sequence of a request, all or nothing;
- `known_later`: a memo of the last request refused for memory (LATER), so a waiting head
  is not re-checked step after step while free memory does not grow;
- `none_fits`: no waiting candidate can be admitted while running sequences only decode
  (what a fast-forward run must be sure of);
- `would_fit`, `freeable_blocks`: for a preemptive policy's waiting head, whether it would
  get its blocks, counted without cache hits, in the free memory or in what preempting
  some running requests would free;
- `can_swap_in`, `swap_in`: a swapped request's return to the GPU, its blocks offered to
  the prefix cache again.

An import is a waiting sequence that already holds its blocks: its KV was computed
elsewhere and written into blocks allocated for it before it was added (a disaggregated
decode replica's request: `simulator/kv_handoff.py`). Admission takes it as it
is, with the computed tokens its importer set, and it needs no free memory.

With prefix caching, each waiting sequence's block keys and their chain hashes are built
once (`BlockKeys`) and extended only when the sequence has grown, instead of at every
look-up; the block manager is handed the same object each time, so it can remember what
it found for it.

The memo is used only where LATER is monotone in free blocks: a block manager that
`grows_by_block` says LATER exactly when free < need + watermark. Without a prefix cache
a request's need does not change; with one, a hit appearing can shrink it, so the memo
also asks the block manager whether its own memo of the answer for the request's keys
still stands (`BlockManager.known_later`). Property tests check that it never changes a
decision (tests/test_scheduler_properties.py).
"""
from __future__ import annotations

from typing import Iterable

from servelab.config import SchedulerConfig
from servelab.memory.base import AllocStatus, BlockManager
from servelab.memory.block_keys import BlockKeys
from servelab.policies.base import SchedulerError
from servelab.request import Request, SeqId, Sequence


class KVAdmission:
    """The memory checks of one scheduler's admission (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *,
                 prefix_caching: bool) -> None:
        self._config = config
        self._bm = block_manager
        self._prefix_caching = prefix_caching
        self._use_memo = block_manager.grows_by_block
        self.later: tuple[Request, int, int] | None = None
        """The last request whose allocation was LATER: (request, tokens, free blocks
        then), or None. With prefix caching a hit can shorten the need without freeing
        anything, so the block manager's own memo of that answer must stand too."""
        self._keys: dict[SeqId, BlockKeys] = {}
        """Block keys of waiting sequences, kept between look-ups; a sequence's entry is
        handed to the block manager (and dropped here) when it is allocated."""

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
                if status is AllocStatus.LATER and not done and self._use_memo:
                    self.later = (req, s.num_tokens, bm.num_free_blocks)
                return status
            s.num_computed_tokens = bm.allocate(s.seq_id, s.num_tokens, contents,
                                                max_total_tokens=max_total,
                                                expected_total_tokens=expected_total)
            s.prefill_len = s.num_tokens
            done.append(s)
        for s in done:
            self._keys.pop(s.seq_id, None)
        if self._prefix_caching and req.cached_tokens is None:  # the first admission
            req.cached_tokens = sum(s.num_computed_tokens for s in done)
            req.cpu_cached_tokens = sum(bm.host_hit_tokens(s.seq_id) for s in done)
        return AllocStatus.OK

    def block_keys(self, req: Request, seq: Sequence) -> BlockKeys:
        """The sequence's block keys, extended to its current length. O(new blocks)."""
        keys = self._keys.get(seq.seq_id)
        if keys is None:
            keys = self._keys[seq.seq_id] = BlockKeys()
        bs = self._bm.block_size
        if len(keys) < seq.num_tokens // bs:
            req.extend_block_keys(keys, seq, bs)
        return keys

    def cached_tokens(self, req: Request) -> int:
        """Tokens of the live sequences of a waiting `req` that the prefix cache would
        serve if it were admitted now (0 without prefix caching). O(blocks hit), the keys
        built once (`block_keys`)."""
        if not self._prefix_caching:
            return 0
        bm = self._bm
        return sum(bm.cached_prefix_tokens(s.num_tokens, self.block_keys(req, s))
                   for s in req.seqs if not s.finished)

    def forget(self, req: Request) -> None:
        """Drop a request's kept keys (it was rejected while waiting)."""
        for s in req.seqs:
            self._keys.pop(s.seq_id, None)

    def known_later(self, req: Request) -> bool:
        """Is `req` known not to fit (LATER) with the memory free now? True when its
        allocation already failed with as many free blocks or more, it has not grown
        since and, with prefix caching, the block manager's memo of that answer for its
        keys stands (no hit has appeared since). Single-sequence requests only. O(1)."""
        if self.later is None:
            return False
        memo_req, tokens, free = self.later
        if memo_req is not req or len(req.seqs) != 1:
            return False
        seq = req.seqs[0]
        if seq.num_tokens != tokens or seq.finished or self._bm.num_free_blocks > free:
            return False
        if not self._prefix_caching:
            return True
        keys = self._keys.get(seq.seq_id)
        return keys is not None and self._bm.known_later(tokens, keys)

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

    def none_fits(self, candidates: Iterable[Request], num_seqs: int) -> bool:
        """True if none of the waiting `candidates` can be admitted while `num_seqs`
        running sequences only decode (free memory only shrinks, the step budget stays
        as full): the rules of `Scheduler._admit`, for a fast-forward run."""
        cfg = self._config
        if cfg.batching == "static":
            return True
        if num_seqs >= cfg.max_num_seqs:
            return True  # no seat
        if num_seqs >= cfg.max_num_batched_tokens and cfg.step_composition == "decode_first":
            return True  # decodes take the whole budget before admission is tried
        for head in candidates:
            if self.known_later(head):
                continue
            reserve = dict(max_total_tokens=head.prompt_len + head.max_tokens,
                           expected_total_tokens=head.prompt_len + head.output_len)
            for s in head.seqs:
                if s.finished:
                    continue
                if self._bm.has_seq(s.seq_id):
                    return False   # an import: it needs no memory
                contents = self.block_keys(head, s) if self._prefix_caching else ()
                if self._bm.can_allocate(s.num_tokens, contents, **reserve) is AllocStatus.OK:
                    return False
        return True

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
