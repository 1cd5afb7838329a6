"""What moves between a prefill pool and a decode pool, and how each side sees it.

- `prefill_part`: a request as its prefill replica serves it (its prompt, one output
  token: vLLM's disaggregated prefill produces the first token there).
- `HeldKV`: the prefill replica's block manager, which keeps a finished prefill's blocks
  until its transfer completes (vLLM's connector `delay_free_blocks`).
- `landing_status`, `land`: a decode replica's check and allocation of the blocks a
  prompt's KV and first token will occupy (the decode side's admission of its KV).
- `decode_part`: the request as its decode replica's scheduler receives it, an import
  (`policies/admission.py`): prompt computed, first token sampled.
- `Handoff`: the record of one request's way between them (a row of handoffs.csv).

Used by `simulator/disaggregated_cluster.py`, and by tests that replay a decode replica's
imports on a lone engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from servelab.memory.base import AllocStatus, BlockManager
from servelab.records import RequestRecord
from servelab.request import Request, Sequence


@dataclass(slots=True)
class Handoff:
    """One request's way from its prefill replica to a decode replica: a row of
    handoffs.csv. Times are simulated seconds; None until reached."""

    request_id: int
    prefill_replica: int
    prompt_tokens: int
    kv_bytes: int
    held_blocks: int
    """Blocks the prompt holds on the prefill replica until its transfer completes."""
    arrival_s: float
    scheduled_s: float
    """First step of its prefill."""
    prefill_end_s: float
    """End of the step that computed its last prompt token and sampled its first token."""
    decode_replica: int | None = None
    landed_s: float | None = None
    """When a decode replica allocated its blocks (the decode side admitted its KV)."""
    transfer_start_s: float | None = None
    transfer_end_s: float | None = None
    released_s: float | None = None
    """When the prefill replica freed its blocks: the transfer's end, or the moment it
    was found to fit no decode replica ever (`decode_replica` None)."""


def landing_status(block_manager: BlockManager, req: Request) -> AllocStatus:
    """Would `block_manager` take `req`'s prompt and first token now (OK), once others
    free memory (LATER), or never? The check of any admission, watermark and reservations
    for growth included."""
    return block_manager.can_allocate(req.prompt_len + 1, (), max_total_tokens=req.prompt_len + req.max_tokens,
                                      expected_total_tokens=req.prompt_len + req.output_len)


def land(block_manager: BlockManager, req: Request) -> None:
    """Allocate the blocks `req`'s prompt KV and first token will occupy on a decode
    replica (`landing_status` must be OK), under its sequence id: its scheduler will
    admit it as an import."""
    block_manager.allocate((req.request_id, 0), req.prompt_len + 1, (),
                           max_total_tokens=req.prompt_len + req.max_tokens,
                           expected_total_tokens=req.prompt_len + req.output_len)


def decode_part(req: Request, first: RequestRecord, *, keep_token_times: bool = False) -> Request:
    """`req` as a decode replica receives it after `first`, its prefill part's record:
    prompt computed, first token sampled (its KV still to compute: one token), and the
    times and counts of its prefill carried over (arrival, first scheduled, first token,
    preemptions, prefix-cache hits), so that its record is the whole request's."""
    part = Request(req.request_id, req.arrival_s, req.prompt_len, req.output_len,
                   req.max_tokens, 1, req.priority, req.tenant, req.slo_ttft_ms,
                   req.slo_tpot_ms, req.prompt_token_ids, req.prefix_hashes,
                   req.prefix_block_size, seed=req.seed)
    seq = part.seqs[0]
    seq.num_tokens = seq.prefill_len = req.prompt_len + 1
    seq.num_computed_tokens = req.prompt_len
    seq.num_output_tokens = 1
    part.scheduled_s, part.first_token_s = first.scheduled_s, first.first_token_s
    part.num_preemptions = first.num_preemptions
    part.cached_tokens, part.cpu_cached_tokens = first.cached_tokens, first.cpu_cached_tokens
    if keep_token_times:
        part.token_times = [first.first_token_s]
    return part


def prefill_part(req: Request) -> Request:
    """`req` as its prefill replica serves it: the prompt and one output token."""
    return Request(req.request_id, req.arrival_s, req.prompt_len, 1, 1, 1, req.priority,
                   req.tenant, req.slo_ttft_ms, req.slo_tpot_ms, req.prompt_token_ids,
                   req.prefix_hashes, req.prefix_block_size, seed=req.seed)


class HeldKV:
    """A prefill replica's block manager as its scheduler sees it: every call goes to the
    manager, except that freeing the finished prefill of a request awaiting a transfer
    (`expect`) holds its blocks until `release`. Held blocks stay allocated in the
    manager, so everything it reports counts them."""

    def __init__(self, block_manager) -> None:
        self._bm = block_manager
        self._expected: dict[Hashable, Sequence] = {}
        self._held: dict[Hashable, int] = {}
        self.num_held_blocks = 0

    def __getattr__(self, name: str):
        return getattr(self._bm, name)

    def expect(self, seq: Sequence) -> None:
        """`seq`'s blocks are to be held when it finishes."""
        self._expected[seq.seq_id] = seq

    def forget(self, seq_id: Hashable) -> None:
        """A request expected to finish here was rejected: nothing will be held."""
        self._expected.pop(seq_id, None)

    def free(self, seq_id: Hashable) -> None:
        seq = self._expected.get(seq_id)
        if seq is None or not seq.finished:   # preempted, aborted, or not awaited
            self._bm.free(seq_id)
            return
        del self._expected[seq_id]
        blocks = len(self._bm.block_table(seq_id))
        self._held[seq_id] = blocks
        self.num_held_blocks += blocks

    def held_blocks(self, seq_id: Hashable) -> int:
        return self._held[seq_id]

    def release(self, seq_id: Hashable) -> None:
        """The held sequence's transfer completed: free its blocks."""
        self.num_held_blocks -= self._held.pop(seq_id)
        self._bm.free(seq_id)
