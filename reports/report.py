"""The report of a policy comparison: DIR/index.html (self-contained) and DIR/report.md.

    files = write_report(Path("runs/cmp"))    # DIR as `servelab compare` left it

It reads files only (`reports/comparison.py`), so it can be rebuilt at any time. The
report holds: what was run and which SLOs apply; where each policy breaks and why, which
runs were overloaded or rejected requests, and which policy wins each metric by a clear
margin (`reports/findings.py`); with a prefix cache, its hit rate per point and over
each run and what lpm and prefix-affinity routing bought (`reports/prefix_report.py`); a
summary table per policy and load (the runs' summary.json, rounded; "n/a" for a
statistic of nothing); and figures
(`reports/report_figures.py`). Both files are rendered from one list of blocks
(`reports/document.py`), so they say the same.

Breaking point: the first rate at which fewer than 90% of the requests met their SLOs
(rejected ones counting as misses; a request's own SLO takes precedence over the global
one), or the p99 TTFT / TPOT exceeded a global SLO that applies to some request.

Cost: every point's records are loaded, then each figure is drawn once; seconds for a
dozen points of thousands of requests.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.reports import plots
from servelab.reports.comparison import RUNS_DIR, Comparison, describe_labels, load_comparison, show_value
from servelab.reports.document import Bullets, Heading, ReportFiles, Table, Text, write_document
from servelab.reports.findings import analyse, constant, findings, summary_cells
from servelab.reports.prefix_report import prefix_section
from servelab.reports.repeats import repeated_policies, repeats_text
from servelab.reports.report_figures import figures, memory_figure
from servelab.reports.slo import (MIN_ATTAINMENT, describe_tier, slo_attainment, slo_tiers,
                                  unused_global_slos)

#: Summary table: (header, summary.json key, decimals).
TABLE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("Throughput (req/s)", "request_throughput", 2),
    ("Output (tok/s)", "output_throughput", 0),
    ("Mean TTFT (ms)", "mean_ttft_ms", 1),
    ("P99 TTFT (ms)", "p99_ttft_ms", 1),
    ("Mean TPOT (ms)", "mean_tpot_ms", 2),
    ("P99 TPOT (ms)", "p99_tpot_ms", 2),
    ("P99 E2E (ms)", "p99_e2el_ms", 0),
    ("Goodput (req/s)", "request_goodput", 2),
    ("Preemptions", "num_preemptions", 0),
    ("Rejected", "rejected", 0),
    ("Jain index", "jain_fairness_index", 3),
)
_AXIS_NAMES = {"model": "Model", "gpu": "GPU", "tp": "TP", "pp": "PP", "router": "Router",
               "block_manager": "Block manager",
               "block_size": "Block size", "chunked_prefill": "Chunk size", "preemption": "Preemption"}


def write_report(out_dir: Path) -> ReportFiles:
    """Build the report of the sweep in out_dir and write index.html, report.md, figures/."""
    return write_document(Path(out_dir), build_document(load_comparison(out_dir)))


def build_document(c: Comparison, *, title: str | None = None, level: int = 1,
                   run_targets: str | None = None) -> list:
    """The report as blocks (Heading, Text, Bullets, Table, Image), figures not yet rendered.
    `title` replaces the heading; `level` is the heading level of the title (the sections
    are one level below), so another report can embed this one. `run_targets` names the
    whole-run targets an embedding report applied (a plan's "p99 TTFT <= 2000 ms"), which
    the text then names where the runs carry no per-request SLO."""
    colours = plots.policy_colours(c.policies)
    sub = level + 1
    doc: list = [Heading(level, title or f"Policy comparison: {c.points[0].config['trace']}"),
                 *_what_was_run(c, run_targets)]
    groups, repeated = [], {}
    for labels, points in c.groups():
        repeats = repeated_policies(points)
        repeated[tuple(labels.items())] = repeats_text(repeats, points)
        groups.append((labels, analyse([p for p in points if p.policy not in repeats])))
    for labels, group in groups:
        suffix = f" ({describe_labels(labels)})" if labels else ""
        note = repeated[tuple(labels.items())]
        doc += [Heading(sub, "Findings" + suffix), *([Text(note)] if note else []),
                *findings(group)]
    prefix = prefix_section(c)
    if prefix:
        doc += [Heading(sub, "Prefix caching"), *prefix]
    doc += [Heading(sub, "Summary per policy and load"), *summary_table(c)]
    for labels, group in groups:
        suffix = f" ({describe_labels(labels)})" if labels else ""
        doc += [Heading(sub, "Figures" + suffix), *figures(group, colours, suffix, _slug(labels))]
    for labels, points in c.groups(exclude=("block_manager",)):
        if any(p.config["block_manager"].startswith("contiguous") for p in points):
            suffix = f" ({describe_labels(labels)})" if labels else ""
            doc += [Heading(sub, "KV memory: paged vs contiguous" + suffix),
                    memory_figure(points, max(p.rate for p in points), colours, suffix, _slug(labels))]
    if c.missing:
        doc += [Heading(sub, "Points not in this report"),
                Text("These grid points have no stored run (they failed, or the sweep has not "
                     "reached them); rerun the same command to retry them."), Bullets(c.missing)]
    doc += [Heading(sub, "Run directories"),
            Text(f"Each point is a `servelab simulate` run directory under {RUNS_DIR}/ (its "
                 f"config.json reruns it: python -m servelab.simulator.run RUN/config.json --out DIR)."),
            Bullets([f"{p.name}: {describe_labels(p.labels)}" for p in c.points])]
    return doc


def _slug(labels: dict[str, Any]) -> str:
    return "_".join(f"{a}-{show_value(v)}" for a, v in labels.items()).replace("/", "-")


def _what_was_run(c: Comparison, run_targets: str | None) -> list:
    cfg = c.points[0].config
    swept = {a for a, vals in c.axes.items() if len(vals) > 1}
    counts = sorted({p.summary["completed"] + p.summary["rejected"] for p in c.points})
    count = f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,} to {counts[-1]:,}"
    each = [_settings(p.config, p.derived, swept) for p in c.points]
    fixed, differ = [], []
    for i, (axis, label, words) in enumerate(each[0]):
        if axis in swept:
            continue
        if all(point[i][2] == words for point in each[1:]):
            if words:
                fixed.append(words)
        else:             # set by a swept axis (a GPU's or an engine's defaults), not by it
            differ.append(label)
    axes = " x ".join(f"{a} ({', '.join(show_value(v) for v in vals)})"
                      for a, vals in c.axes.items() if a in swept)
    text = [Text(f"{len(c.points)} simulations of the trace '{cfg['trace']}' ({count} requests each), "
                 f"sweeping {axes or 'nothing'}. Rates are mean request rates (req/s) to which the "
                 f"trace's arrivals are rescaled."),
            Text("Every point: " + "; ".join(fixed) + "."
                 + (f" Differing with the points' engines, GPUs or models (each run's config.json "
                    f"has them): {', '.join(differ)}." if differ else ""))]
    text.append(Text(_slo_text(c, run_targets)))
    return text


def _settings(cfg: dict, derived: dict, swept: set) -> list[tuple[str | None, str, str | None]]:
    """(the axis that would vary it, a name for it, the words) of each setting of one point,
    in the order the report lists them; words None where there is nothing to say."""
    sched = cfg["scheduler"]
    chunk = f"chunked prefill of {sched['chunked_prefill']} tokens" if sched["chunked_prefill"] \
        else "no chunked prefill"
    pools = derived.get("disaggregation")   # a prefill and a decode pool (simulator/disaggregated_run.py)
    costs = [derived.get("cost_model", {})] if pools is None else \
        [pools[name].get("cost_model", {}) for name in ("prefill", "decode")]
    kernels = list(dict.fromkeys(f"{c['calibration']}, measured inside vLLM "
                                 f"{c['calibration_engine_version']}"
                                 for c in costs if c.get("calibration_engine_version")))
    priced = f"engine {cfg.get('engine') or 'servelab'}" + (
        f" (kernels: {' and '.join(kernels)})" if kernels and "gpu" not in swept else "")
    layout = f"{cfg['replicas']} replica(s)" if pools is None else "disaggregated: " + " + ".join(
        f"{'swept' if f'{name}_replicas' in swept else pools[name]['replicas']} {name} replica(s)"
        for name in ("prefill", "decode")) + f", KV over {pools['kv_link']['name']} ({pools['kv_transfer']})"
    blocks = derived.get("kv_blocks_per_replica", cfg["kv_blocks"])
    return [
        ("engine", "engine or its kernels", priced),
        ("model", "model", f"model {cfg['model']}"), ("gpu", "GPU", f"GPU {cfg['gpu']}"),
        ("tp", "tensor parallelism", f"tensor parallelism {cfg['tp']}"),
        *_other_parallelism(cfg), (None, "layout", layout),
        (None, "KV blocks", f"{blocks:,} KV blocks per replica" if pools is None else None),
        ("block_size", "block size", f"{cfg['block_size']}-token KV blocks"),
        ("block_manager", "block manager", f"{cfg['block_manager']} block manager"),
        (None, "batch limits", f"{sched['batching']} batching of at most {sched['max_num_seqs']} "
                               f"sequences and {sched['max_num_batched_tokens']} tokens per step"),
        ("chunked_prefill", "chunked prefill", chunk),
        (None, "step composition", f"{sched['step_composition'].replace('_', '-')} steps"),
        ("preemption", "preemption", f"{sched['preemption']} preemption"),
        (None, "prefix caching", "prefix caching" if cfg["prefix_caching"] else None),
        (None, "seed", f"seed {cfg['seed']}"),
    ]


def _other_parallelism(cfg) -> list[tuple[str, str, str | None]]:
    """(axis, name, words) for the pipeline depth and the expert / data parallelism of the runs,
    words only where they are not 1. config.json leaves pp and ep out at 1
    (`SimulationConfig.to_dict`); data-parallel attention ranks are ep / tp when ep > tp
    (`SimulationConfig.ep`)."""
    tp, pp, ep = cfg["tp"], cfg.get("pp", 1), cfg.get("ep", 1)
    dp = ep // tp if ep > tp else 1
    return [("pp", "pipeline parallelism",
             f"pipeline parallelism {pp} ({tp * pp} GPUs per replica)" if pp != 1 else None),
            ("ep", "expert parallelism",
             f"expert parallelism {ep}" + (f", data parallelism {dp} (each replica one "
                                           f"data-parallel attention rank)" if dp > 1 else "")
             if ep != 1 else None)]


def _slo_text(c: Comparison, run_targets: str | None) -> str:
    first = c.points[0]
    tiers = slo_tiers(first.config, first.requests)
    if not tiers and run_targets:
        return (f"The targets ({run_targets}) are percentiles over each whole run, not SLOs of each "
                "request, and no request carries its own: goodput equals throughput below, and a "
                "policy breaks only on rejections.")
    if not tiers:
        return ("No SLO was given and no request carries its own: goodput equals throughput, and a "
                "policy breaks only on rejections. Give --slo-ttft-ms / --slo-tpot-ms to compare "
                "latency within SLOs.")
    own = any(t.tenant is not None for t in tiers)
    where = "per tenant, the requests' own SLOs taking precedence over the global ones" if own \
        else "for every request"
    unused = unused_global_slos(first.config, first.requests)
    ignored = (f" {' and '.join(unused)} applied to no request: each request carries its own."
               if unused else "")
    if run_targets:   # an embedding search judged its rates by whole-run targets
        ignored += (f" This section judges each run by those SLOs, as compare does; the search "
                    f"above judged its runs by {run_targets}, so a run may hold here and not "
                    "there.")
    return (f"SLOs ({where}): " + "; ".join(describe_tier(t) for t in tiers) + f".{ignored} A policy "
            f"breaks at the first rate where fewer than {MIN_ATTAINMENT:.0%} of the requests meet "
            "their SLOs (rejected ones count as misses), or its p99 TTFT or TPOT exceeds a global "
            "SLO that applies to some request.")


def summary_table(c: Comparison) -> list:
    """A sentence on what the values are, and the table; a column that is the same at every
    point and explained in the sentence (the whole-run Jain index) is left out."""
    columns = list(TABLE_COLUMNS)
    text = ("Values are each run's summary.json (vLLM benchmark definitions), rounded; n/a: a "
            "statistic over no value (nothing finished). SLO met: requests that finished within "
            "their SLOs, over all requests.")
    jain = constant(c.points, "jain_fairness_index", 3)
    if jain is not None and len(c.points) > 1:
        columns = [col for col in columns if col[1] != "jain_fairness_index"]
        text += (f" Jain's fairness index over the whole run is {jain:.3f} at every point and left out: "
                 "when every request finishes, every policy served each tenant the same tokens in "
                 "total, so that index describes the workload's tenant mix, not the policy (the "
                 "fairness figure shows who was served when).")
    variant = c.variant_axes()
    headers = ["Policy", "Rate (req/s)", *(_AXIS_NAMES.get(a, a) for a in variant),
               *(h for h, _, _ in columns), "SLO met (%)"]
    hits = all(p.summary.get("prefix_cache_hit_rate") is not None for p in c.points)
    if hits:   # in percent, as the prefix-caching section shows it
        headers.insert(len(headers) - 1, "Prefix hit rate (%)")
    rows = [[p.policy, f"{p.rate:g}", *(show_value(p.labels[a]) for a in variant), *summary_cells(p, columns),
             *([f"{100 * p.summary['prefix_cache_hit_rate']:.1f}"] if hits else []),
             f"{100 * slo_attainment(p.summary):.1f}"] for p in c.points]
    return [Text(text), Table(headers, rows)]
