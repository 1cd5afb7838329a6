"""The simulator's speed layer: faster pieces that decide exactly as the plain ones in
`policies/` and `memory/` (which the real backend runs), chosen by constructor.

| speed piece | replaces | what it saves |
|---|---|---|
| `scheduler.BatchingScheduler` | `policies.scheduler.Scheduler` | plain decodes advanced in bulk; runs of decode steps in closed form (the fast-forward); memo of refused preemptions |
| `decode_batch.DecodeBatch` | listing each decode (inside `BatchingScheduler`) | O(block-boundary crossings) per step instead of O(sequences) |
| `admission.MemoKVAdmission` | `policies.admission.KVAdmission` | memo of the last admission refused for memory; the admission test of a fast-forward run |

Each names the capabilities it needs and steps aside, explicitly, where a run lacks them
(`BatchingScheduler.batching_off`). A property test per pair holds the fast piece to the
plain one (tests/test_scheduler_properties.py).
"""
from __future__ import annotations

from servelab.policies import Policy, make_policy

from .scheduler import BatchingScheduler, waiting_candidates

__all__ = ["BatchingScheduler", "build_scheduler", "waiting_candidates"]


def build_scheduler(scheduler_config, cache_config, policy: str | Policy = "fcfs",
                    policy_options: dict | None = None, **scheduler_kwargs) -> BatchingScheduler:
    """The simulator's scheduler over a fresh block manager built from the cache config:
    `policies.build_scheduler`, with the speed layer's scheduler."""
    from servelab.memory import make_block_manager

    if isinstance(policy, str):
        policy = make_policy(policy, **(policy_options or {}))
    bm = make_block_manager(cache_config, scheduler_config.max_model_len)
    return BatchingScheduler(scheduler_config, bm, policy,
                             enable_prefix_caching=cache_config.enable_prefix_caching,
                             **scheduler_kwargs)
