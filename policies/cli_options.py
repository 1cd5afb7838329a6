"""The scheduler's command-line flags with the registries filled in: `servelab.options`'
builders, given the registered policies, preemption modes and block managers.

The flags themselves are defined once, in the core (`servelab.options`), which imports
nothing from `servelab.policies` or `servelab.memory` (DESIGN.md's import table, checked by
tests/test_imports.py): its builders take the registries as arguments. They are read here
because policies/ is the one folder that may import memory/ and that both commands running
the scheduler may import: `servelab simulate` (simulator/) and `servelab run` (backends/).
`servelab compare` (sweeps/, which may import neither) reaches `policy_flag_owners` through
`servelab.simulator.cli`.

    add_scheduler_options(parser, policies=policy_names())
    opts = configs_from_args(args)        # SchedulerOptions(scheduler, cache, policy, policy_options)
"""
from __future__ import annotations

import argparse
from typing import Sequence

from servelab import options
from servelab.memory import block_manager_names
from servelab.policies import policy_classes, preemption_names


def add_scheduler_options(parser: argparse.ArgumentParser,
                          policies: Sequence[str] | None = None) -> None:
    """`servelab.options.add_scheduler_options` over the registries: --preemption and
    --block-manager offer every registered mode and manager, `policies` limits --policy's
    choices (default: every registered policy), and every registered policy's own flags
    are offered, each applying to its policy only."""
    options.add_scheduler_options(parser, policy_classes=policy_classes(),
                                  preemptions=preemption_names(),
                                  block_managers=block_manager_names(), policies=policies)


def configs_from_args(args: argparse.Namespace, *, default_max_model_len: int | None = None,
                      device_memory_bytes: int = 0,
                      device_name: str = "") -> options.SchedulerOptions:
    """`servelab.options.configs_from_args` over the registered policies: the configs, policy
    and policy options the flags describe (a CLIError names the flag of a bad value)."""
    return options.configs_from_args(args, policy_classes=policy_classes(),
                                     default_max_model_len=default_max_model_len,
                                     device_memory_bytes=device_memory_bytes,
                                     device_name=device_name)


def policy_flag_owners() -> dict[str, str]:
    """Each registered policy flag's argparse dest -> the policy it configures."""
    return options.policy_flag_owners(policy_classes())
