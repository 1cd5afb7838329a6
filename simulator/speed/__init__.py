"""The simulator's speed layer: faster pieces that decide exactly as the plain ones in
`policies/` and `memory/` (which the real backend runs), chosen by constructor.

| speed piece | replaces | what it saves |
|---|---|---|
| `scheduler.BatchingScheduler` | `policies.scheduler.Scheduler` | plain decodes advanced in bulk; runs of decode steps in closed form (the fast-forward); memo of refused preemptions |
| `decode_batch.DecodeBatch` | listing each decode (inside `BatchingScheduler`) | O(block-boundary crossings) per step instead of O(sequences) |
| `admission.MemoKVAdmission` | `policies.admission.KVAdmission` | block keys hashed once per waiting sequence; memo of the last admission refused for memory; the admission test of a fast-forward run |
| `paged.RunPagedBlockManager` | `memory.paged.PagedBlockManager` | prefix cache (`prefix_runs`) and host tier (`host_runs`) kept per run of blocks, not per block; bulk growth (`paged_growth`); memo of LATER answers (`later_memo`) |

Each names the capabilities it needs and steps aside, explicitly, where a run lacks them
(`BatchingScheduler.batching_off`). What it reads of a block manager beyond the
`BlockManager` protocol, by name (`RunPagedBlockManager` has all of them; a manager
without one gets the plain path for what needs it):

- `grows_by_block = True`: block use follows the paging law. A sequence whose last block
  is unshared holds exactly ceil(tokens / block_size) blocks, takes one free block each
  time its length crosses a block boundary and none otherwise, whatever else is held;
  appending n slots in one call takes the same blocks as n calls of one; and whether a
  new sequence without cached contents fits depends only on its block count against
  `num_free_blocks`, so it does not turn from LATER to OK while free blocks do not
  grow. Decodes may then be batched and grown lazily, and admission memoised
  (tests/test_memory_properties.py holds a manager that declares it to the law). With
  it: `append_slots_many(growth)` (the same blocks and copies as `append_slots` in
  turn), `num_free_blocks_without_offload` (free blocks takeable without a copy to a
  host tier), `offload_room` (how many more a decode run may take, each copied to the
  host tier: `DecodeBatch.run_bound` then hands the run's copies to the caller to price)
  and `known_later(num_tokens, keys)` (does a LATER answer for these very keys still
  stand?).
- `max_uniform_growth(seq_ids, limit)`: the largest k <= limit such that every listed
  sequence can append k slots, one at a time, with no failure and no copy; it may
  under-estimate, never over-estimate. Without it no decode run is fast-forwarded
  (`memory/contiguous.py` has one of its own). A property test per pair holds the fast piece to the
plain one (tests/test_scheduler_properties.py, tests/test_plain_paged.py).
"""
from __future__ import annotations

from servelab.memory import BlockManager
from servelab.memory.registry import make_block_manager as make_plain_block_manager
from servelab.policies import Policy, make_policy

from .paged import RunPagedBlockManager
from .scheduler import BatchingScheduler, waiting_candidates

__all__ = ["BatchingScheduler", "RunPagedBlockManager", "build_scheduler", "make_block_manager",
           "waiting_candidates"]


def make_block_manager(cache, max_model_len: int) -> BlockManager:
    """The block manager `cache.block_manager` names, as the simulator runs it: the
    speed layer's `RunPagedBlockManager` for `paged`, the registered one otherwise."""
    if cache.block_manager == "paged":
        return RunPagedBlockManager.from_config(cache, max_model_len)
    return make_plain_block_manager(cache, max_model_len)


def build_scheduler(scheduler_config, cache_config, policy: str | Policy = "fcfs",
                    policy_options: dict | None = None, **scheduler_kwargs) -> BatchingScheduler:
    """The simulator's scheduler over a fresh block manager built from the cache config:
    `policies.build_scheduler`, with the speed layer's scheduler."""
    if isinstance(policy, str):
        policy = make_policy(policy, **(policy_options or {}))
    bm = make_block_manager(cache_config, scheduler_config.max_model_len)
    return BatchingScheduler(scheduler_config, bm, policy,
                             enable_prefix_caching=cache_config.enable_prefix_caching,
                             **scheduler_kwargs)
