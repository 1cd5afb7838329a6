"""Speed layer for `policies/admission.py` `KVAdmission`: block keys built once, a memo
of refused admissions, and the admission test of a fast-forward run.

A waiting sequence is looked up in the prefix cache step after step, and a long prompt has
about a thousand blocks: building its keys and hashing their chain at every look-up is
what made prefix caching slow. `MemoKVAdmission` builds each waiting sequence's keys and
chain hashes once (`BlockKeys`, block_keys.py) and extends them only when the
sequence has grown; the block manager is handed the same object each time, so it can
remember what it found for it.

A waiting head that does not fit is asked again at every step while running requests
decode; with a long queue that is most steps of a busy run. `MemoKVAdmission` remembers
the last request whose allocation was LATER (request, tokens, free blocks then) and
answers LATER again, in O(1), while that cannot have changed: the request has not grown
and free memory has not grown, and, with prefix caching (where a hit appearing can shrink
the need without freeing anything), the block manager's own memo for the request's keys
still stands (`known_later` of the fast block manager).

The memo is used only where LATER is monotone in free blocks: a block manager that
`grows_by_block` says LATER exactly when free < need + watermark. Skipping a recording
never changes a decision (the memo only saves a look-up), so only single-sequence
requests, the only ones the memo answers for, are recorded. Property tests hold the
scheduler that uses it to the plain one (tests/test_scheduler_properties.py).
"""
from __future__ import annotations

from typing import Iterable

from servelab.config import SchedulerConfig
from servelab.memory.base import AllocStatus, BlockManager
from .block_keys import BlockKeys
from servelab.policies.admission import KVAdmission
from servelab.request import Request, SeqId, Sequence

__all__ = ["MemoKVAdmission"]


class MemoKVAdmission(KVAdmission):
    """`KVAdmission` with a memo of the last LATER, and `none_fits` for fast-forward."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *,
                 prefix_caching: bool) -> None:
        super().__init__(config, block_manager, prefix_caching=prefix_caching)
        self._keys: dict[SeqId, BlockKeys] = {}
        """Block keys of waiting sequences, kept between look-ups; a sequence's entry is
        handed to the block manager (and dropped here) when it is allocated."""
        self._use_memo = getattr(block_manager, "grows_by_block", False)
        self.later: tuple[Request, int, int] | None = None
        """The last request whose allocation was LATER: (request, tokens, free blocks
        then), or None."""

    def allocate(self, req: Request) -> AllocStatus:
        status = super().allocate(req)
        if status is AllocStatus.OK:
            if self._keys:
                self.forget(req)
        elif status is AllocStatus.LATER and self._use_memo and len(req.seqs) == 1:
            self.later = (req, req.seqs[0].num_tokens, self._bm.num_free_blocks)
        return status

    def block_keys(self, req: Request, seq: Sequence) -> BlockKeys:
        """The sequence's block keys, extended to its current length. O(new blocks)."""
        keys = self._keys.get(seq.seq_id)
        if keys is None:
            keys = self._keys[seq.seq_id] = BlockKeys()
        bs = self._bm.block_size
        if len(keys) < seq.num_tokens // bs:
            keys.extend_to(req, seq, bs)
        return keys

    def forget(self, req: Request) -> None:
        """Drop a request's kept keys (it was allocated, or rejected while waiting)."""
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

    def none_fits(self, candidates: Iterable[Request], num_seqs: int) -> bool:
        """True if none of the waiting `candidates` can be admitted, or would be rejected,
        while `num_seqs` running sequences only decode (free memory only shrinks, the step
        budget stays as full): the rules of `Scheduler._admit`, for a fast-forward run. A
        candidate the cache can never hold is rejected once the policy shows it (an
        overdue request under a starvation guard may become the head mid-run), so it
        ends the run as an admission would."""
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
                if self._bm.can_allocate(s.num_tokens, contents, **reserve) is not AllocStatus.LATER:
                    return False   # OK: admitted; NEVER: rejected
        return True
