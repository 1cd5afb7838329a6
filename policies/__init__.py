"""Scheduling policies and the scheduler core (pure Python: no torch, triton or simpy)."""
from servelab.policies.base import KeyedQueue, Policy, make_policy, policy_names, register_policy
from servelab.policies.fair import FairSharePolicy
from servelab.policies.fcfs import FCFSPolicy
from servelab.policies.priority import PriorityPolicy
from servelab.policies.scheduler import Scheduler, SchedulerError
from servelab.policies.sjf import OutputLengthPredictor, SJFPolicy

__all__ = [
    "FCFSPolicy", "FairSharePolicy", "KeyedQueue", "OutputLengthPredictor", "Policy",
    "PriorityPolicy", "SJFPolicy", "Scheduler", "SchedulerError", "build_scheduler",
    "make_policy", "policy_names", "register_policy",
]


def build_scheduler(scheduler_config, cache_config, policy: str | Policy = "fcfs",
                    policy_options: dict | None = None, **scheduler_kwargs) -> Scheduler:
    """A scheduler over a fresh block manager built from the cache config."""
    from servelab.memory import make_block_manager

    if isinstance(policy, str):
        policy = make_policy(policy, **(policy_options or {}))
    bm = make_block_manager(cache_config, scheduler_config.max_model_len)
    return Scheduler(scheduler_config, bm, policy,
                     enable_prefix_caching=cache_config.enable_prefix_caching, **scheduler_kwargs)
