"""`servelab trace ...`: inspect and convert traces; plus the `--trace` options other commands share.

This is the entry layer: the only place that reads SERVELAB_TRACE_DIR. Importing it is
cheap (no numpy); handlers import what they need.

    servelab trace stats T [--rate R] [--on-bad-row drop] ...
    servelab trace convert IN OUT ...
    servelab trace datasets

T is a file path, a dataset name (see `servelab trace datasets`) or `default`.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from servelab.cli import CLIError
from servelab.options import GivenFlag, positive_int
from servelab.traces.formats import trace_format_names

TRACE_DIR_ENV = "SERVELAB_TRACE_DIR"


def trace_dir_from(cli_value: str | None, environ=os.environ) -> Path:
    """--trace-dir, else $SERVELAB_TRACE_DIR, else ~/.cache/servelab/traces."""
    from servelab.traces.datasets import DEFAULT_TRACE_DIR
    return Path(cli_value or environ.get(TRACE_DIR_ENV) or DEFAULT_TRACE_DIR).expanduser()


def _add_load_options(p: argparse.ArgumentParser, *, short_aliases: bool = False) -> None:
    """The trace loading flags, spelled alike in every command; `trace stats` and `trace
    convert` also take their older names (--format, --cv)."""
    aliases = {"--trace-format": ("--format",), "--arrival-cv": ("--cv",)} if short_aliases \
        else {"--trace-format": (), "--arrival-cv": ()}
    p.add_argument("--trace-dir", metavar="DIR",
                   help=f"where named datasets live (default: ${TRACE_DIR_ENV} or ~/.cache/servelab/traces)")
    p.add_argument("--trace-format", *aliases["--trace-format"], dest="trace_format",
                   choices=("auto", *trace_format_names()), default="auto",
                   help="trace file format (default: detected from the header)")
    p.add_argument("--on-bad-row", choices=("error", "drop"), default="error",
                   help="stop at the first malformed row (default) or drop and count such rows")
    p.add_argument("--rate", type=float, metavar="REQ_PER_S",
                   help="target mean request rate: drawn arrivals for length-only tables (required "
                        "there), a time rescaling for timed traces, the total rate of 'default'")
    p.add_argument("--arrival-cv", *aliases["--arrival-cv"], dest="arrival_cv", type=float,
                   default=1.0, metavar="CV", action=GivenFlag,
                   help="inter-arrival coefficient of variation of drawn arrivals (1 = Poisson)")
    p.add_argument("--no-download", action="store_true",
                   help="fail instead of downloading a missing named dataset")


def add_trace_arguments(parser: argparse.ArgumentParser, *, default: str = "default") -> None:
    """Add --trace and its loading options to another command (simulate, compare, run, ...).
    Pair with `trace_from_args(args, seed=..., max_model_len=...)`."""
    parser.add_argument("--trace", default=default, metavar="T",
                        help=f"trace file, dataset name or 'default' (default: {default})")
    _add_load_options(parser)


def trace_from_args(args: argparse.Namespace, spec: str | None = None, *, seed: int = 0,
                    max_model_len: int | None = None, environ=os.environ):
    """Resolve `spec` (default: args.trace) with the loading options; user errors -> CLIError."""
    from servelab.traces.datasets import resolve_trace
    from servelab.traces.record import TraceError
    spec = args.trace if spec is None else spec
    if spec == "default":
        given = [flag for flag, on in (("--arrival-cv", args.arrival_cv != 1.0),
                                       ("--trace-format", args.trace_format != "auto")) if on]
        if given:
            raise CLIError(f"{' and '.join(given)} do{'es' if len(given) == 1 else ''} not apply "
                           "to the default workload (it draws its own arrivals from its fitted "
                           "distributions and reads no file)")
    try:
        return resolve_trace(spec, trace_dir=trace_dir_from(args.trace_dir, environ), rate=args.rate,
                             cv=args.arrival_cv, seed=seed, on_bad_row=args.on_bad_row,
                             format=args.trace_format, max_model_len=max_model_len,
                             download=not args.no_download)
    except (TraceError, OSError) as exc:
        raise CLIError(str(exc)) from exc


def register(subparsers) -> None:
    p = subparsers.add_parser("trace", help="inspect and convert request traces",
                              description="Inspect and convert request traces.")
    sub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])

    s = sub.add_parser("stats", help="counts, span, rate, length percentiles, inter-arrival histogram",
                       description="Print a trace's counts, span, rate, length percentiles, an "
                                   "inter-arrival histogram, and the rows dropped or clipped.")
    s.add_argument("trace", metavar="T", help="file path, dataset name or 'default'")
    _add_stats_and_convert_options(s)
    s.add_argument("--bins", type=int, default=10, help="inter-arrival histogram bins (default 10)")
    s.add_argument("--lru-cache-tokens", type=_token_counts, metavar="N[,N...]",
                   help="also print the prefix hit ratio of an LRU cache of N tokens (the most "
                        "a serving cache of that size can expect)")
    s.add_argument("--lru-block-size", type=positive_int, metavar="TOKENS",
                   help="block size of that LRU cache (default: the trace's hashed blocks; "
                        "a KV block size must divide them)")
    s.set_defaults(func=_cmd_stats)

    c = sub.add_parser("convert", help="write a trace as servelab's canonical CSV",
                       description="Convert any supported trace to servelab's canonical CSV "
                                   "(arrival_s,prompt_tokens,output_tokens[,...]).")
    c.add_argument("trace", metavar="IN", help="file path, dataset name or 'default'")
    c.add_argument("output", metavar="OUT", help="CSV file to write (an existing file is "
                                                  "refused unless --force)")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    _add_stats_and_convert_options(c)
    c.set_defaults(func=_cmd_convert)

    d = sub.add_parser("datasets", help="list the named datasets and whether they are present",
                       description="List the named public datasets and where they are looked for.")
    d.add_argument("--trace-dir", metavar="DIR", help=f"default: ${TRACE_DIR_ENV} or ~/.cache/servelab/traces")
    d.set_defaults(func=_cmd_datasets)


def _add_stats_and_convert_options(p: argparse.ArgumentParser) -> None:
    _add_load_options(p, short_aliases=True)
    p.add_argument("--seed", type=int, default=0, help="seed of drawn arrivals and of 'default' (default 0)")
    p.add_argument("--max-model-len", type=int, metavar="N", help="clip prompt+output to N tokens (counted)")


def _cmd_stats(args: argparse.Namespace) -> int:
    from servelab.traces.record import NeedsRateError
    from servelab.traces.stats import format_lru_hit_ratios, format_stats, trace_stats
    if args.bins < 1:
        raise CLIError(f"--bins must be >= 1, got {args.bins}")
    if args.lru_block_size is not None and not args.lru_cache_tokens:
        raise CLIError("--lru-block-size sizes the blocks of --lru-cache-tokens's cache: "
                       "give --lru-cache-tokens N too")
    try:
        trace = trace_from_args(args, seed=args.seed, max_model_len=args.max_model_len)
        lengths_only = False
    except CLIError as exc:
        if not isinstance(exc.__cause__, NeedsRateError):
            raise
        # A length-only table: its lengths are worth showing; arrivals exist only once drawn.
        # Any rate loads it; the arrival figures are left out of the output.
        with_rate = argparse.Namespace(**{**vars(args), "rate": 1.0})
        trace = trace_from_args(with_rate, seed=args.seed, max_model_len=args.max_model_len)
        lengths_only = True
    lru = ""
    if args.lru_cache_tokens:
        try:
            lru = "\n" + format_lru_hit_ratios(trace, args.lru_cache_tokens, args.lru_block_size)
        except ValueError as exc:
            raise CLIError(f"--lru-block-size: {exc}") from None
    print(format_stats(trace_stats(trace, bins=args.bins), lengths_only=lengths_only) + lru)
    return 0


def _token_counts(text: str) -> list[int]:
    """N[,N...]: positive token counts."""
    return [positive_int(part) for part in text.split(",")]


def _cmd_convert(args: argparse.Namespace) -> int:
    from servelab.traces.canonical import write_csv
    suffix = Path(args.output).suffix.lower()
    if suffix not in ("", ".csv", ".txt"):
        raise CLIError(f"trace convert writes servelab's canonical CSV, not {suffix[1:]}: name "
                       "the output .csv")
    out = Path(args.output)
    if out.is_dir():
        raise CLIError(f"{out} is a folder: name the CSV file to write")
    if out.exists() and not args.force:   # before loading: a run's requests.csv is not a trace
        raise CLIError(f"{out} exists: use another name, or --force to replace it")
    trace = trace_from_args(args, seed=args.seed, max_model_len=args.max_model_len)
    try:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)   # as simulate --out does
        write_csv(trace, args.output)
    except OSError as exc:
        raise CLIError(f"cannot write {args.output}: {exc}") from exc
    print(f"wrote {len(trace)} requests to {args.output} "
          f"({trace.num_dropped} source rows dropped, {trace.num_clipped} requests clipped)")
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    from servelab.traces.datasets import DATASETS
    directory = trace_dir_from(args.trace_dir)
    print(f"trace directory: {directory}")
    width = max(map(len, DATASETS))
    for ds in DATASETS.values():
        state = "present" if (directory / ds.filename).is_file() else "missing (downloaded on first use)"
        print(f"  {ds.name:<{width}}  {ds.format:<9}  {state}\n  {'':<{width}}  {ds.description}; {ds.license}")
    return 0
