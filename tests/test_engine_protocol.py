"""The engine loop's typed view of a scheduler (`servelab.engine.SchedulerLike`) names what
the loop and the step use, and the shared scheduler has every member of it: the core
depends on this protocol, not on policies/ or memory/ (DESIGN.md's import table)."""
from __future__ import annotations

import inspect

from servelab.config import SchedulerConfig
from servelab.engine import BlockCounts, SchedulerLike
from servelab.memory.paged import PagedBlockManager
from servelab.policies import Scheduler, make_policy


def members(protocol: type) -> set[str]:
    own = set(getattr(protocol, "__annotations__", {}))
    own |= {name for name, value in vars(protocol).items()
            if inspect.isfunction(value) and not name.startswith("_")}
    return own


def test_the_shared_scheduler_has_every_member_the_engine_uses():
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), PagedBlockManager(8, 4),
                          make_policy("fcfs"))
    assert members(SchedulerLike) == {"num_running", "num_waiting", "num_swapped", "bm",
                                      "add_request", "schedule", "update", "pop_records",
                                      "has_unfinished"}
    for name in members(SchedulerLike):
        assert hasattr(scheduler, name), name
    for name in members(BlockCounts):
        assert isinstance(getattr(scheduler.bm, name), int), name


def test_the_engine_module_reads_no_other_scheduler_member():
    """Every `scheduler.<name>` the engine module reads is in the protocol."""
    import re

    import servelab.engine as engine

    used = set(re.findall(r"\bscheduler\.(\w+)", inspect.getsource(engine)))
    assert used and used <= members(SchedulerLike), used - members(SchedulerLike)
