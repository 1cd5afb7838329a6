"""Write the GPU validation results document from a `scripts/gpu_check.py run` folder.

    python scripts/gpu_results.py DIR --out docs/gpu-results.md [--figures docs/gpu-results]

Reads DIR's manifest.json, env.json, kernels/junit.xml, backends/junit.xml,
bandwidth/decode_attention.json, fidelity/ (the real runs, the three `servelab validate`
outputs, the replays) and engine/throughput.json; writes one Markdown document (setup, the targets met or not, a
section per check) and its figures into --figures (default: the document's path without
.md), linked by relative paths. A record that is missing or partial (a section that failed
or ran out of time) is named in the document with its step's status and log; nothing
missing stops it. The document depends on DIR alone. Exits 2 when DIR has no readable
manifest.json.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

POLICIES = ("fcfs", "priority", "sjf", "fair")
REPEATED = "fcfs-again"  # fcfs served once more: the engine's run-to-run spread
UNSEEN_POLICIES = ("priority", "sjf", "fair")  # the fcfs-fitted profile never saw their steps
KERNEL_MIN_CONTEXT, KERNEL_MIN_BATCH, KERNEL_TARGET_PCT = 8192, 64, 85.0
SPEEDUP_TARGET, STEP_MAPE_TARGET_PCT, P95_E2E_TARGET_PCT = 3.0, 5.0, 5.0
SOURCES = {  # record: (path in DIR, the section and step that write it)
    "env": ("env.json", "env", "collect"),
    "junit": ("kernels/junit.xml", "kernels", "pytest"),
    "backends-junit": ("backends/junit.xml", "backends", "pytest"),
    "bandwidth": ("bandwidth/decode_attention.json", "bandwidth", "decode_attention"),
    "default": ("fidelity/val-default/validation.json", "fidelity", "validate-default"),
    "fit": ("fidelity/val-fit/validation.json", "fidelity", "validate-fit"),
    "heldout": ("fidelity/val-heldout/validation.json", "fidelity", "validate-heldout"),
    "engine": ("engine/throughput.json", "engine", "throughput"),
    **{f"run-{p}": (f"fidelity/runs/{p}/summary.json", "fidelity", f"run-{p}")
       for p in (*POLICIES, REPEATED)}}
METRIC_LABELS = {
    "median_ttft_ms": "TTFT p50 (ms)", "p90_ttft_ms": "TTFT p90 (ms)",
    "p99_ttft_ms": "TTFT p99 (ms)", "median_tpot_ms": "TPOT p50 (ms)",
    "p90_tpot_ms": "TPOT p90 (ms)", "p99_tpot_ms": "TPOT p99 (ms)",
    "median_e2el_ms": "E2E p50 (ms)", "p90_e2el_ms": "E2E p90 (ms)",
    "p95_e2el_ms": "E2E p95 (ms)", "p99_e2el_ms": "E2E p99 (ms)",
    "request_throughput": "requests/s", "output_throughput": "output tok/s"}
ENGINE_METRICS = ("output_throughput", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                  "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms")


# --------------------------------------------------------------------------- formatting


def fmt_pct(x, signed: bool = False) -> str:
    return "—" if x is None else f"{x:+.1f}%" if signed else f"{x:.1f}%"


def fmt_ms(x) -> str:
    return "—" if x is None else f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


def fmt_rate(x) -> str:
    return "—" if x is None else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}"


def fmt_metric(key: str, x) -> str:
    return fmt_ms(x) if key.endswith("_ms") else fmt_rate(x)


def table(header: list, rows: list[list]) -> list[str]:
    def line(row):
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |"
    return [line(header), "|" + "---|" * len(header), *map(line, rows), ""]


def percent_error(real, sim) -> float | None:
    return None if not real or sim is None else (sim - real) / real * 100


def by_policy(per_run: dict) -> dict:
    """`servelab validate` keys runs by their absolute path on the device: the folder name
    is the policy."""
    return {Path(path).name: errors for path, errors in per_run.items()}


# --------------------------------------------------------------------------- the folder


class Folder:
    """A gpu-check output folder: its manifest, its records, and why one is absent."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.manifest = json.loads((root / "manifest.json").read_text())
        self.dry_run = self.manifest.get("mode") == "dry-run"

    def load(self, record: str):
        try:
            return json.loads((self.root / SOURCES[record][0]).read_text())
        except (OSError, ValueError):
            return None

    def missing(self, record: str) -> str:
        """What is wrong with the record and what the manifest says happened to its step."""
        rel, section, step = SOURCES[record]
        state = "unreadable or incomplete" if (self.root / rel).exists() else "absent"
        return f"`{rel}` is {state}: {self.step_story(section, step)}"

    def step_story(self, section: str, step: str) -> str:
        sec = next((s for s in self.manifest.get("sections", []) if s.get("name") == section),
                   None)
        if sec is None:
            return f"the {section} section did not run"
        st = next((s for s in sec.get("steps", []) if s.get("name") == step), None)
        if st is None:
            why = sec.get("note") or "an earlier step failed or the section ran out of time"
            return f"step {section}/{step} did not run ({why})"
        return f"step {section}/{step} {describe_step(st)}"


def describe_step(step: dict) -> str:
    status, note, log = step.get("status"), step.get("note"), step.get("log")
    text = {"failed": f"failed (rc {step.get('rc')})", "timeout": "timed out",
            "skipped": "was skipped", "ok": "finished"}.get(status, status)
    return text + (f" ({note})" if note else "") + (f"; log `{log}`" if log else "")


def p95_e2e_ms(requests_csv: Path) -> float | None:
    """95th percentile (numpy's linear interpolation, as the run summaries use) of the
    finished requests' E2E latency, the `e2el_ms` column (finish_s - arrival_s)."""
    try:
        with open(requests_csv, newline="") as f:
            values = [float(r["e2el_ms"]) for r in csv.DictReader(f)
                      if r.get("status", "finished") == "finished"]
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return float(np.percentile(values, 95)) if values else None


def p95_e2e_pairs(f: Folder) -> dict[str, tuple[float | None, float | None]]:
    """Per policy: the real run's p95 E2E and its replay's."""
    return {p: (p95_e2e_ms(f.root / "fidelity/runs" / p / "requests.csv"),
                p95_e2e_ms(f.root / "fidelity/val-heldout/replay" / p / "run/requests.csv"))
            for p in POLICIES}


# --------------------------------------------------------------------------- setup


def setup_section(f: Folder) -> list[str]:
    m, plan = f.manifest, f.manifest.get("plan", {})
    env = f.load("env") or m.get("env") or {}
    lines = ["## Setup", ""] + ([f.missing("env") + ".", ""] if not env else [])
    device = (f"cpu ({env.get('cpu')}, {env.get('cpu_count')} cores)"
              if env.get("device_name") == "cpu" else env.get("device_name", "—"))
    versions = " / ".join(str(env.get(k) or "—")
                          for k in ("python", "torch", "triton", "transformers"))
    wall = (f"{m.get('wall_s', 0):.0f} s of a {m.get('budget_s', 0):.0f} s budget"
            + ("" if "finished_utc" in m else " (written before the run finished)"))
    lines += table(["", ""], [
        ["Device", device],
        ["Memory", f"{env['memory_gib']} GiB" if "memory_gib" in env else "—"],
        ["Driver / CUDA", f"{env.get('driver') or '—'} / {env.get('torch_cuda') or '—'}"],
        ["Compute capability / SMs",
         f"{env.get('compute_capability', '—')} / {env.get('multiprocessors', '—')}"],
        ["Python / torch / Triton / transformers", versions],
        ["Model / dtype", f"{plan.get('model', '—')} / {plan.get('dtype', '—')}"],
        ["servelab commit", " ".join(str(env.get("servelab_commit") or "—").split())],
        ["Started (UTC)", m.get("started_utc", "—")], ["Wall time", wall],
        ["Command", f"`{m.get('command', '—')}`"]])
    rows = []
    for sec in m.get("sections", []):
        notes = [sec["note"]] if sec.get("note") else []
        notes += [f"{sec.get('name')}/{st.get('name')} {describe_step(st)}"
                  for st in sec.get("steps", []) if st.get("status") != "ok"]
        status = sec.get("status")
        rows.append([sec.get("name"), "running (writes this document)" if status == "pending"
                     else status, f"{sec.get('wall_s', 0):.0f} / {sec.get('budget_s', 0):.0f}",
                     "; ".join(notes)])
    return lines + table(["Section", "Status", "Wall / budget (s)", "Note"], rows)


# --------------------------------------------------------------------------- targets


def judge(within: bool, complete: bool = True) -> str:
    """A target is met only on every record it asks for; missing ones cannot fail it."""
    return "not met" if not within else "met" if complete else "not measured"


def target_kernel(f: Folder) -> tuple[str, str]:
    bw = f.load("bandwidth")
    if bw is None:
        return f.missing("bandwidth"), "not measured"
    settings = bw.get("settings", {})
    peak = settings.get("peak_gbps") or f.manifest.get("bandwidth_peak_gbps")
    rows = [r for r in bw.get("rows", []) if r["impl"] == "triton"
            and r["context"] >= KERNEL_MIN_CONTEXT and r["batch"] >= KERNEL_MIN_BATCH]
    if not rows:
        return (f"no Triton row with context ≥ {KERNEL_MIN_CONTEXT} and batch ≥ "
                f"{KERNEL_MIN_BATCH} (contexts {settings.get('contexts')}, batches "
                f"{settings.get('batches')})"), "not measured"
    best = max(rows, key=lambda r: r["pct_of_peak"])
    return (f"{fmt_pct(best['pct_of_peak'])} of {peak:,.0f} GB/s ({best['gbps']:,.0f} GB/s "
            f"at batch {best['batch']}, context {best['context']})",
            judge(best["pct_of_peak"] >= KERNEL_TARGET_PCT))


def target_speedup(f: Folder) -> tuple[str, str]:
    eng = f.load("engine")
    if eng is None:
        return f.missing("engine"), "not measured"
    speedup = eng.get("output_throughput_speedup")
    if speedup is None:
        absent = " or ".join(k for k in ("servelab", "hf_static") if k not in eng) or "speed-up"
        return (f"no {absent} figures in engine/throughput.json: "
                f"{f.step_story('engine', 'throughput')}"), "not measured"
    return f"{speedup:.2f}x", judge(speedup >= SPEEDUP_TARGET)


def target_step_mape(f: Folder) -> tuple[str, str]:
    """Step-weighted MAPE of the fcfs-fitted profile over the runs it never saw (the MAPE
    of their steps pooled), beside its MAPE on fcfs's own held-out half."""
    own = ((f.load("fit") or {}).get("held_out") or {}).get("overall")
    own = f"; fcfs's own held-out half: {fmt_pct(own['mape_pct'])}" if own else ""
    per_run = by_policy((f.load("heldout") or {}).get("per_run", {}))
    runs = [p for p in UNSEEN_POLICIES if p in per_run]
    steps = sum(per_run[p]["steps"] for p in runs)
    if not steps:
        return f.missing("heldout") + own, "not measured"
    mape = sum(per_run[p]["mape_pct"] * per_run[p]["steps"] for p in runs) / steps
    absent = [p for p in UNSEEN_POLICIES if p not in runs]
    return (f"{fmt_pct(mape)} over {steps} steps of {', '.join(runs)}{own}"
            + (f"; no record of {', '.join(absent)}" if absent else ""),
            judge(mape <= STEP_MAPE_TARGET_PCT, complete=not absent))


def target_p95_e2e(f: Folder) -> tuple[str, str]:
    errors = {p: percent_error(*pair) for p, pair in p95_e2e_pairs(f).items()}
    errors = {p: e for p, e in errors.items() if e is not None}
    if not errors:
        return f.missing("heldout"), "not measured"
    worst = max(abs(e) for e in errors.values())
    each = ", ".join(f"{p} {fmt_pct(e, signed=True)}" for p, e in errors.items())
    absent = [p for p in POLICIES if p not in errors]
    return (f"worst {fmt_pct(worst)} ({each})"
            + (f"; no real run or replay of {', '.join(absent)}" if absent else ""),
            judge(worst <= P95_E2E_TARGET_PCT, complete=not absent))


def target_ranking(f: Folder) -> tuple[str, str]:
    ranking = ((f.load("heldout") or {}).get("simulate") or {}).get("ranking") or {}
    taus = {m: v.get("kendall_tau_b") for m, v in (ranking.get("metrics") or {}).items()}
    if not taus:
        return f.missing("heldout"), "not measured"
    ones = [m for m, t in taus.items() if t is not None and math.isclose(t, 1.0, abs_tol=1e-9)]
    mean = ranking.get("mean_kendall_tau_b")
    text = (f"mean τ-b {mean:.2f}; " if mean is not None else "") + (
        f"τ-b = 1 for {len(ones)} of {len(taus)} metrics ({', '.join(ones)})" if ones
        else f"τ-b = 1 for none of the {len(taus)} metrics")
    return text, judge(len(ones) == len(taus))


def targets_section(f: Folder) -> list[str]:
    targets = [
        (f"Decode kernel ≥ {KERNEL_TARGET_PCT:.0f}% of HBM peak (best Triton row with context "
         f"≥ {KERNEL_MIN_CONTEXT}, batch ≥ {KERNEL_MIN_BATCH})", target_kernel),
        (f"Engine ≥ {SPEEDUP_TARGET:.0f}x generate()'s output throughput", target_speedup),
        (f"Step-time MAPE ≤ {STEP_MAPE_TARGET_PCT:.0f}% on the runs the fit never saw",
         target_step_mape),
        (f"p95 E2E error ≤ {P95_E2E_TARGET_PCT:.0f}% (replay against real, every policy)",
         target_p95_e2e),
        ("Policy ranking: Kendall τ-b = 1 on every metric", target_ranking)]
    rows = []
    for name, measure in targets:
        try:
            measured, verdict = measure(f)
        except (KeyError, TypeError, ValueError) as exc:
            measured, verdict = f"records incomplete ({type(exc).__name__}: {exc})", "not measured"
        rows.append([name, measured, f"**{verdict}**"])
    return ["## Targets", ""] + table(["Target", "Measured", "Verdict"], rows)


# --------------------------------------------------------------------------- kernels, bandwidth


def kernels_section(f: Folder) -> list[str]:
    return junit_section(f, "junit", "Kernels")


def backends_section(f: Folder) -> list[str]:
    return junit_section(f, "backends-junit", "Real backend: engine, MoE, CPU tier, "
                         "disaggregation, speculative decoding")


def junit_section(f: Folder, source: str, title: str) -> list[str]:
    """A pytest run's counts and its failures, one line each."""
    lines = [f"## {title}", ""]
    try:
        root = ET.parse(f.root / SOURCES[source][0]).getroot()
    except (OSError, ET.ParseError):
        return lines + [f.missing(source) + ".", ""]
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(s.get(k, 0)) for s in suites)
         for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    lines += table(["Tests", "Passed", "Failed", "Errors", "Skipped"],
                   [[n["tests"], passed, n["failures"], n["errors"], n["skipped"]]])
    for case in root.iter("testcase"):
        for bad in case.findall("failure") + case.findall("error"):
            message = (bad.get("message") or bad.text or "(no message)").strip().splitlines()
            lines.append(f"- {bad.tag}: `{case.get('classname')}::{case.get('name')}`: "
                         f"{message[0][:200] if message else '(no message)'}")
    return lines + ([""] if lines[-1] else [])


def bandwidth_section(f: Folder, figures: Path, rel: str) -> list[str]:
    lines = ["## Bandwidth: paged decode attention", ""]
    bw = f.load("bandwidth")
    if bw is None:
        return lines + [f.missing("bandwidth") + ".", ""]
    peak = bw.get("settings", {}).get("peak_gbps") or f.manifest.get("bandwidth_peak_gbps")
    rows = bw.get("rows", [])
    impls = [i for i in ("triton", "sdpa", "reference") if any(r["impl"] == i for r in rows)]
    cell = {(r["impl"], r["batch"], r["context"]): r for r in rows}
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    lines += [f"Achieved K/V bandwidth in GB/s (% of the {peak:,.0f} GB/s peak) on "
              f"{bw.get('device')}: Llama-3.1-8B attention shapes, one layer, median of "
              f"{bw.get('settings', {}).get('iters')} iterations.", ""]
    lines += table(["Batch", "Context", *[f"{i} GB/s (% peak)" for i in impls]], [
        [b, c, *(f"{fmt_rate(cell[i, b, c]['gbps'])} ({fmt_pct(cell[i, b, c]['pct_of_peak'])})"
                 if (i, b, c) in cell else "—" for i in impls)] for b, c in shapes])
    lines += [f"- Not compared, {name}: {why}." for name, why in bw.get("not_compared", {}).items()]
    if shapes:
        bandwidth_figure(rows, peak, figures / "bandwidth.png", f.dry_run)
        lines += ["", f"![Achieved bandwidth against context]({rel}/bandwidth.png)"]
    return lines + [""]


def bandwidth_figure(rows: list[dict], peak: float, path: Path, dry_run: bool) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, batch in enumerate(sorted({r["batch"] for r in rows})):
        for impl, style in (("triton", "-"), ("sdpa", "--")):
            points = sorted((r["context"], r["gbps"]) for r in rows
                            if r["impl"] == impl and r["batch"] == batch)
            if points:
                ax.plot(*zip(*points), style, marker="o", color=f"C{n % 10}",
                        label=f"{impl}, batch {batch}")
    ax.axhline(peak, color="black", linewidth=1, label=f"peak {peak:,.0f} GB/s")
    contexts = sorted({r["context"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set(xticks=contexts, xticklabels=[str(c) for c in contexts], xlabel="context (tokens)",
           ylabel="achieved GB/s", title="Paged decode attention (solid: Triton, dashed: SDPA)")
    ax.legend(fontsize=7, ncol=2)
    save(fig, path, dry_run)


def save(fig, path: Path, dry_run: bool) -> None:
    if dry_run:
        fig.text(0.5, 0.5, "DRY RUN: measures nothing", ha="center", va="center",
                 fontsize=22, color="red", alpha=0.3, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def copy_figure(f: Folder, src: str, figures: Path, name: str, rel: str, alt: str) -> list[str]:
    if not (f.root / src).is_file():
        return []
    shutil.copyfile(f.root / src, figures / name)
    return [f"![{alt}]({rel}/{name})", ""]


# --------------------------------------------------------------------------- fidelity


STEP_ERROR_HEADER = ["Run", "Fit saw its steps", "Steps", "MAPE", "Median APE", "Bias",
                     "Summed time error"]


def step_error_rows(per_run: dict, overall: dict | None, seen: dict[str, str]) -> list[list]:
    runs = [(p, seen.get(p, "no"), e) for p, e in by_policy(per_run).items()]
    return [[name, saw, e.get("steps"), fmt_pct(e.get("mape_pct")),
             fmt_pct(e.get("median_ape_pct")), fmt_pct(e.get("bias_pct"), signed=True),
             fmt_pct(e.get("total_time_error_pct"), signed=True)]
            for name, saw, e in runs + ([("**all**", "", overall)] if overall else [])]


REAL_RUN_METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_e2el_ms",
                    "p95_e2el_ms", "output_throughput")


def real_run_metrics(f: Folder, run: str) -> dict | None:
    s = f.load(f"run-{run}")
    if s is None:
        return None
    p95 = p95_e2e_ms(f.root / f"fidelity/runs/{run}/requests.csv")
    return {"completed": s.get("completed"), **{k: s.get(k) for k in REAL_RUN_METRICS},
            "p95_e2el_ms": p95}


def real_runs_part(f: Folder) -> list[str]:
    rows, missing, measured = [], [], {}
    for p in (*POLICIES, REPEATED):
        m = real_run_metrics(f, p)
        if m is None:
            if p != REPEATED:   # absent from runs made before the kit repeated fcfs
                missing.append(f"- {p}: {f.missing(f'run-{p}')}")
            continue
        measured[p] = m
        rows.append([p, m["completed"], *(fmt_ms(m[k]) for k in REAL_RUN_METRICS[:-1]),
                     fmt_rate(m["output_throughput"])])
    header = ["Policy", "Requests", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)",
              "E2E p50 (ms)", "E2E p95 (ms)", "Output tok/s"]
    lines = ["### Real runs", ""] + (table(header, rows) if rows else [])
    if "fcfs" in measured and REPEATED in measured:
        a, b = measured["fcfs"], measured[REPEATED]
        spread = {METRIC_LABELS[k]: 100 * (b[k] - a[k]) / a[k] for k in REAL_RUN_METRICS
                  if a.get(k) and b.get(k) is not None}
        if spread:
            worst = max(spread, key=lambda k: abs(spread[k]))
            lines += [f"The same fcfs run served twice ({REPEATED}, the section's last step) "
                      "differs by " + ", ".join(f"{fmt_pct(v, signed=True)} ({k})"
                                               for k, v in spread.items())
                      + f": the engine's own run-to-run spread, up to "
                      f"{abs(spread[worst]):.1f}% ({worst}).", ""]
    return lines + missing + ([""] if missing else [])


def default_model_part(f: Folder, figures: Path, rel: str) -> list[str]:
    lines = ["### Default cost model: per-step error", ""]
    val = f.load("default")
    if val is None:
        return lines + [f.missing("default") + ".", ""]
    overall = (val.get("default") or {}).get("overall")
    return (lines + table(STEP_ERROR_HEADER, step_error_rows(val.get("per_run", {}), overall, {}))
            + copy_figure(f, "fidelity/val-default/step_pred_vs_measured.png", figures,
                          "default_step_pred_vs_measured.png", rel,
                          "Default model: predicted against measured step time"))


def fit_part(f: Folder) -> list[str]:
    lines = ["### Profile fitted on the fcfs run", ""]
    val = f.load("fit") or {}
    fit = val.get("fit")
    if fit is None:
        return lines + [f.missing("fit") + ".", ""]
    scales = dict(fit.get("coefficients", {}))
    overhead = scales.pop("overhead", None)
    unidentified, at_bound = fit.get("unidentified", {}), fit.get("at_bound", [])
    rows = [[name, f"{scales[name]:.3g}" if name in scales else "—",
             f"unidentified: {unidentified[name]}" if name in unidentified
             else "at its bound" if name in at_bound else ""]
            for name in dict.fromkeys([*scales, *unidentified])]
    own = (val.get("held_out") or {}).get("overall") or {}
    lines += [f"Fitted on {fit.get('train_steps')} of fcfs's steps (loss {fit.get('loss')}): "
              f"step overhead {'—' if overhead is None else f'{overhead * 1e3:.2f}'} ms; "
              f"MAPE on the other {own.get('steps')} fcfs steps {fmt_pct(own.get('mape_pct'))}. "
              "The profile is `fidelity/val-fit/calibration.json`.", ""]
    return lines + table(["Op class", "Scale on the kernel model", "Note"], rows)


def heldout_part(f: Folder, figures: Path, rel: str) -> list[str]:
    lines = ["### Fitted profile on every run", ""]
    val = f.load("heldout")
    if val is None:
        return lines + [f.missing("heldout") + ".", ""]
    overall = (val.get("starting") or {}).get("overall")
    lines += table(STEP_ERROR_HEADER, step_error_rows(val.get("per_run", {}), overall,
                                                      {"fcfs": "half (trained on)"}))
    warnings = [f"- validate warns: {w}" for w in (val.get("verdict") or {}).get("warnings", [])]
    return (lines + warnings + ([""] if warnings else [])
            + copy_figure(f, "fidelity/val-heldout/step_pred_vs_measured.png", figures,
                          "heldout_step_pred_vs_measured.png", rel,
                          "Fitted profile: predicted against measured step time, every run"))


def replay_part(f: Folder, figures: Path, rel: str) -> list[str]:
    lines = ["### Replays: real against simulated request metrics", ""]
    simulate = (f.load("heldout") or {}).get("simulate") or {}
    runs = simulate.get("runs") or {}
    if not runs:
        return lines + [f.missing("heldout") + " (no replays).", ""]
    pairs = p95_e2e_pairs(f)
    metrics = list(dict.fromkeys(m for run in runs.values() for m in run.get("metrics", {})))
    if "p90_e2el_ms" in metrics:  # the replay's own p95, computed here from requests.csv
        metrics.insert(metrics.index("p90_e2el_ms") + 1, "p95_e2el_ms")
    else:
        metrics.append("p95_e2el_ms")
    rows = [[METRIC_LABELS.get(m, m), *(replay_cell(run, m, pairs.get(p, (None, None)))
                                        for p, run in runs.items())] for m in metrics]
    lines += ["Each cell: real / simulated (error of the simulation).", ""]
    lines += table(["Metric", *runs], rows)
    notes = [f"- {p}: {note}" for p, run in runs.items() for note in run.get("notes", [])]
    lines += notes + ([""] if notes else [])
    complete = {p: pair for p, pair in pairs.items() if None not in pair}
    if complete:
        p95_figure(complete, figures / "p95_e2e.png", f.dry_run)
        lines += [f"![p95 E2E latency, real and simulated]({rel}/p95_e2e.png)", ""]
    return lines + ranking_part(simulate.get("ranking") or {})


def replay_cell(run: dict, metric: str, p95_pair: tuple) -> str:
    if metric == "p95_e2el_ms":
        real, sim = p95_pair
        error = percent_error(real, sim)
    else:
        v = run.get("metrics", {}).get(metric) or {}
        real, sim, error = v.get("real"), v.get("sim"), v.get("error_pct")
    if real is None and sim is None:
        return "—"
    return f"{fmt_metric(metric, real)} / {fmt_metric(metric, sim)} ({fmt_pct(error, signed=True)})"


def ranking_part(ranking: dict) -> list[str]:
    metrics = ranking.get("metrics") or {}
    if not metrics:
        return []
    rows = [[METRIC_LABELS.get(m, m), ", ".join(v.get("real_order", [])),
             ", ".join(v.get("sim_order", [])),
             "—" if v.get("kendall_tau_b") is None else f"{v['kendall_tau_b']:.2f}"]
            for m, v in metrics.items()]
    mean = ranking.get("mean_kendall_tau_b")
    return (["### Policy ranking", "", "Policies best first; Kendall τ-b between the orders"
             + (f" (mean {mean:.2f})." if mean is not None else "."), ""]
            + table(["Metric", "Real order", "Simulated order", "τ-b"], rows))


def p95_figure(pairs: dict, path: Path, dry_run: bool) -> None:
    x = np.arange(len(pairs))
    fig, ax = plt.subplots(figsize=(6, 4))
    for offset, label, i in ((-0.2, "real", 0), (0.2, "simulated", 1)):
        ax.bar(x + offset, [pair[i] for pair in pairs.values()], width=0.4, label=label)
    ax.set(xticks=x, xticklabels=list(pairs), ylabel="p95 E2E latency (ms)",
           title="p95 E2E latency per policy: real run and its replay")
    ax.legend()
    save(fig, path, dry_run)


def fidelity_section(f: Folder, figures: Path, rel: str) -> list[str]:
    plan = f.manifest.get("plan", {})
    intro = (f"The trace slice's first {plan.get('fidelity_requests', '—')} requests, arriving "
             f"{plan.get('fidelity_rate_scale', '—')}x faster than recorded, served for real "
             "under each policy; `servelab validate` prices every step with the default cost "
             "model, fits a profile on half of fcfs's steps, and replays all four runs with it.")
    return (["## Fidelity: cost model and simulator against real runs", "", intro, ""]
            + real_runs_part(f)
            + default_model_part(f, figures, rel) + fit_part(f)
            + heldout_part(f, figures, rel) + replay_part(f, figures, rel))


# --------------------------------------------------------------------------- engine


def engine_section(f: Folder, figures: Path, rel: str) -> list[str]:
    lines = ["## Engine: servelab against Hugging Face generate()", ""]
    eng = f.load("engine")
    if eng is None:
        return lines + [f.missing("engine") + ".", ""]
    engines = {"servelab": eng.get("servelab"),
               "HF generate() (static batches)": eng.get("hf_static")}
    lines += [f"{eng.get('num_requests', '—')} requests ({eng.get('output_tokens', '—')} "
              f"output tokens) all arriving at t = 0, model {eng.get('model', '—')}; "
              f"generate() in batches of {eng.get('settings', {}).get('hf_batch_size', '—')}.",
              ""]
    lines += table(["Metric", *engines], [
        [METRIC_LABELS[m], *(fmt_metric(m, (e or {}).get(m)) for e in engines.values())]
        for m in ENGINE_METRICS])
    speedup = eng.get("output_throughput_speedup")
    lines += [f"Output-throughput speed-up: **{speedup:.2f}x**." if speedup is not None
              else f"No speed-up: {f.step_story('engine', 'throughput')}.", ""]
    measured = {k: e["output_throughput"] for k, e in engines.items()
                if e and "output_throughput" in e}
    if measured:
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        ax.bar(list(measured), list(measured.values()), color=["C0", "C1"][:len(measured)])
        ax.set(ylabel="output tokens/s", title="Output throughput, same requests")
        save(fig, figures / "engine_throughput.png", f.dry_run)
        lines += [f"![Output throughput]({rel}/engine_throughput.png)", ""]
    return lines


# --------------------------------------------------------------------------- reproduce


def reproduce_section(f: Folder) -> list[str]:
    setup = (f.load("fit") or {}).get("setup") or {}
    profile = ("calibration/<gpu>-llama-3.1-8b-bf16.json" if f.dry_run or not setup else
               f"calibration/{setup.get('gpu')}-{setup.get('model')}-{setup.get('dtype')}.json")
    lines = ["## Reproduce", "", "```bash",
             "bash scripts/gpu_prepare.sh   # here: .gpu/ (simpy wheel, trace slice, commit)",
             "# on the GPU machine, from the repository root, with .gpu carried:",
             "bash scripts/gpu_check.sh     # writes $OUT/gpu-check.tgz",
             "# back here, with gpu-check.tgz unpacked into <folder>:",
             "python scripts/gpu_results.py <folder> --out docs/gpu-results.md "
             "--figures docs/gpu-results",
             f"cp <folder>/fidelity/val-fit/calibration.json {profile}   # to adopt its fit",
             "```", "",
             f"This run's command: `{f.manifest.get('command')}`. The profile it fitted "
             f"is `fidelity/val-fit/calibration.json` in the run folder; `calibration/README.md` "
             f"says which run's fit `{profile}` holds."
             + (" A dry run's profile describes the CPU: it is never committed." if f.dry_run
                else "")]
    return lines + [""]


# --------------------------------------------------------------------------- main


def document(f: Folder, figures: Path, rel: str) -> str:
    lines = ["# GPU validation results", ""]
    if f.dry_run:
        lines += ["> **DRY RUN on the CPU with tiny shapes: these figures measure nothing.** "
                  "It checks only that the kit runs end to end.", ""]
    sections = [(setup_section, ()), (targets_section, ()), (kernels_section, ()),
                (backends_section, ()), (bandwidth_section, (figures, rel)), (fidelity_section, (figures, rel)),
                (engine_section, (figures, rel)), (reproduce_section, ())]
    for write, args in sections:
        try:
            lines += write(f, *args)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            # a record of an unforeseen shape costs its section, not the document
            lines += [f"({write.__name__} could not read these records: "
                      f"{type(exc).__name__}: {exc}.)", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="the output folder of scripts/gpu_check.py run")
    p.add_argument("--out", type=Path, required=True, help="the Markdown file to write")
    p.add_argument("--figures", type=Path, default=None,
                   help="folder for the figures (default: --out without its .md suffix)")
    args = p.parse_args(argv)
    try:
        folder = Folder(args.dir)
    except (OSError, ValueError):
        print(f"gpu_results: {args.dir} is not a gpu-check folder (no readable manifest.json)",
              file=sys.stderr)
        return 2
    figures = args.figures or args.out.with_suffix("")
    figures.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rel = Path(os.path.relpath(figures.resolve(), args.out.parent.resolve())).as_posix()
    args.out.write_text(document(folder, figures, rel))
    print(f"wrote {args.out} and its figures in {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
