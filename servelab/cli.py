"""The `servelab` command line.

Each subcommand lives beside the component it drives, in a module with a
`register(subparsers)` function; importing that module must stay cheap (heavy imports
happen inside the command's handler), so `servelab --help` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys

from servelab import __version__

#: Modules that contribute subcommands, in the order they appear in --help.
COMMAND_MODULES = (
    "servelab.simulator.cli",
    "servelab.sweeps.cli",
    "servelab.sweeps.capacity_cli",
    "servelab.sweeps.plan_cli",
    "servelab.backends.cli",
    "servelab.validation.cli",
    "servelab.validation.calibrate_cli",
    "servelab.simulator.cost_cli",
    "servelab.traces.cli",
)


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, with a bad option reported as one line and a pointer to --help instead of
    the whole usage first (thirty lines for `compare`, which buried the message), and no
    abbreviated options (`servelab run --gpu h100-sxm` was taken for --gpu-memory-utilization
    and refused as "expected a number"; it is an unknown option there).
    Subcommand parsers are made of this class too (argparse's default)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


_NEGATIVE = re.compile(r"-\.?\d")


_COMMAND_LINES = frozenset({"--vllm-args"})
"""Options whose value is a command line of another program: `--vllm-args --enforce-eager`
passes "--enforce-eager" as the value (argparse would take it for an option)."""


def join_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Write `--flag -5,8` as `--flag=-5,8` when --flag takes a value, so that a negative
    value reaches the flag's validator ("expected a finite number > 0, got '-5'") instead
    of argparse taking it for an option (it only recognises a lone number like -5)."""
    takes_value = _value_options(parser)
    out = []
    for token in argv:
        if out and out[-1] in takes_value and (_NEGATIVE.match(token) or out[-1] in _COMMAND_LINES):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Long option strings that take a value, in the parser and all its subcommands."""
    options = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _value_options(sub)
        elif action.nargs != 0:
            options |= {o for o in action.option_strings if o.startswith("--")}
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
    _remember_parsers(parser)
    return parser


def _remember_parsers(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's namespace gets `command_parser`: the parser of the command given."""
    parser.set_defaults(command_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _remember_parsers(sub)


def main(argv: list[str] | None = None) -> int:
    from servelab.registry import import_plugins

    try:   # the user's own entries, before the parser offers the registries' names
        import_plugins()
    except ValueError as exc:
        print(f"servelab: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(join_negative_values(parser, list(sys.argv[1:] if argv is None else argv)))
    command_parser = vars(args).pop("command_parser")
    if extra:   # reported by the subcommand that was given them, with its --help
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"servelab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader of stdout went away (`servelab trace stats T | head`): stop quietly
        # with the shell's status for SIGPIPE, and keep Python's final flush of stdout from
        # raising again (the Python docs' recipe). Any other broken pipe is a real error.
        try:            # is stdout the broken pipe? (one more byte tells: EPIPE if so)
            sys.stdout.write("\n")
            sys.stdout.flush()
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
        raise
    except KeyboardInterrupt as exc:
        # A second Ctrl-C while Python winds down (worker pools, atexit hooks) ends it at once.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print(str(exc) or "interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
