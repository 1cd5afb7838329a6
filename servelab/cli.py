"""The `servelab` command line.

Each subcommand lives beside the component it drives, in a module with a
`register(subparsers)` function; importing that module must stay cheap (heavy imports
happen inside the command's handler), so `servelab --help` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from servelab import __version__

#: Modules that contribute subcommands, in the order they appear in --help.
COMMAND_MODULES = (
    "servelab.simulator.cli",
    "servelab.sweeps.cli",
    "servelab.backends.cli",
    "servelab.validation.cli",
    "servelab.validation.calibrate_cli",
    "servelab.simulator.cost_cli",
    "servelab.traces.cli",
)


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servelab",
        description="A lab for LLM-serving scheduling: simulate, compare and validate "
                    "scheduling policies, preemption modes and KV-cache managers.")
    parser.add_argument("--version", action="version", version=f"servelab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # component not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"servelab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
