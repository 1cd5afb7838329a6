"""Scheduling policies, preemption strategies and the scheduler core (pure Python: no
torch, triton or simpy). Policies and strategies register themselves by name in the
module that defines them; every module of this package is imported here, so a new one is
one new file (docs/extending.md)."""
from servelab.registry import import_submodules
from servelab.policies.base import (KeyedQueue, Policy, PolicyFlag, SchedulerError, make_policy,
                                    nothing_to_act_on, policy_names, register_policy)
from servelab.policies.admission_control import AdmissionControl
from servelab.policies.edf import EDFPolicy
from servelab.policies.fair import FairSharePolicy
from servelab.policies.fcfs import FCFSPolicy
from servelab.policies.lpm import LongestPrefixMatchPolicy
from servelab.policies.lsf import LeastSlackFirstPolicy
from servelab.policies.mlfq import MLFQPolicy
from servelab.policies.preemption import (Preemption, make_preemption, preemption_names,
                                          register_preemption)
from servelab.policies.priority import PriorityPolicy
from servelab.policies.scheduler import Scheduler
from servelab.policies.sjf import OutputLengthPredictor, SJFPolicy

__all__ = [
    "AdmissionControl", "EDFPolicy", "FCFSPolicy", "FairSharePolicy", "KeyedQueue",
    "LeastSlackFirstPolicy", "LongestPrefixMatchPolicy", "MLFQPolicy", "OutputLengthPredictor", "Policy", "PolicyFlag", "Preemption", "PriorityPolicy", "SJFPolicy",
    "Scheduler", "SchedulerError", "build_scheduler", "make_policy", "make_preemption",
    "nothing_to_act_on", "policy_classes", "policy_names", "preemption_names", "register_policy", "register_preemption",
]


def policy_classes() -> dict[str, type[Policy]]:
    """Every registered policy class, by name (for the command-line flags they declare)."""
    from servelab.policies.base import POLICIES
    return dict(sorted(POLICIES.items()))


def build_scheduler(scheduler_config, cache_config, policy: str | Policy = "fcfs",
                    policy_options: dict | None = None, **scheduler_kwargs) -> Scheduler:
    """A scheduler over a fresh block manager built from the cache config."""
    from servelab.memory import make_block_manager

    if isinstance(policy, str):
        policy = make_policy(policy, **(policy_options or {}))
    bm = make_block_manager(cache_config, scheduler_config.max_model_len)
    return Scheduler(scheduler_config, bm, policy,
                     enable_prefix_caching=cache_config.enable_prefix_caching, **scheduler_kwargs)


import_submodules(__name__, __path__)
