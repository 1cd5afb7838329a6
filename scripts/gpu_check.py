"""The prepared GPU validation run: every check a lent H100/H200 should make, in one command
that fits its time, writing every raw record under one folder.

    python scripts/gpu_check.py slice --trace-dir ../shared/traces   # here, once (prepare)
    python scripts/gpu_check.py run --out DIR [--dry-run] [--budget-s S] [--sections a,b]

`scripts/gpu_check.sh` is the entry point people call; it checks prerequisites, installs
what the device lacks from `.gpu/wheels`, runs `run`, and packs the folder for the trip
back. Sections, in order (each a time box; a section that runs out of time is stopped and
recorded, and the next one starts with what is left):

- ``env``: device, driver, library versions, the commit the tree came from.
- ``kernels``: the Triton kernel tests (paged decode, chunked prefill, KV write against
  their PyTorch references, NaN-poisoned caches) on the device.
- ``backends``: the real-backend tests on the device (`BACKEND_TESTS`): greedy outputs of
  dense and mixture-of-experts models against Hugging Face, the CPU KV tier, disaggregated
  prefill/decode and speculative decoding, served over the compiled kernels.
- ``bandwidth``: the paged decode kernel's achieved HBM bandwidth over context x batch
  with Llama-3.1-8B attention shapes, beside SDPA on a contiguous cache
  (`benchmarks/bench_decode_attention.py`).
- ``fidelity``: real runs (`servelab run`) of the trace slice under fcfs, priority, sjf and
  fair; `servelab validate` of them against the default cost model, a fit on the fcfs run,
  and the fitted model replaying all four (step error on the runs it never saw, request
  metrics, Kendall's tau of the policy rankings).
- ``engine``: servelab's engine against Hugging Face `generate()` with static batching on
  the same requests (`benchmarks/bench_engine_throughput.py`).
- ``report``: `scripts/gpu_results.py` writes gpu-results.md from the folder.

The fidelity section comes before the engine section on purpose: the engine section's
generate() baseline is the one whose length is hardest to foresee.

``--dry-run`` runs every section on the CPU with tiny shapes (tiny-llama, fp32, Triton
under the interpreter): the same code paths end to end in about a minute, so the kit cannot
rot between the rare sessions that hold a GPU. Its figures measure nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SLICE = REPO / ".gpu" / "traces" / "azure-conv-2023-slice.csv"
POLICIES = ("fcfs", "priority", "sjf", "fair")
REPEATED = "fcfs-again"
"""The fcfs run served a second time, as the last step of the fidelity section."""
REPORT_RESERVE_S = 20.0
"""Seconds kept back from the budget for the report, whatever the sections before it do."""


@dataclass(frozen=True)
class Plan:
    """What each section runs on this device: the GPU plan or the dry (CPU) plan."""

    device: str
    model: str
    dtype: str
    max_model_len: int
    engine_requests: int
    hf_batch_size: int
    fidelity_requests: int
    fidelity_rate_scale: float
    """Arrivals replayed this many times faster: the slice's first requests then arrive in
    about a second, so a queue forms at once and the policies order it differently."""
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: int
    bandwidth_args: tuple[str, ...]
    backend_tests: tuple[str, ...]
    """The real-backend test files the `backends` section runs on the plan's device."""
    budgets_s: dict = field(default_factory=dict)


BACKEND_TESTS = (
    "tests/test_model_forward.py", "tests/test_model_triton.py", "tests/test_model_moe.py",
    "tests/test_backend_e2e.py", "tests/test_backend_e2e_triton.py",
    "tests/test_backend_host_tier.py", "tests/test_backend_disaggregated.py",
    "tests/test_backend_speculative.py")
"""Greedy outputs against Hugging Face generate() for dense and mixture-of-experts models,
the CPU KV tier, disaggregated prefill/decode (block copies between two caches) and
speculative decoding, each served by the real engine (tests/_backend_device.py)."""

GPU_PLAN = Plan(
    device="cuda", model="llama-3.1-8b", dtype="bfloat16", max_model_len=4096,
    engine_requests=48, hf_batch_size=48,
    fidelity_requests=64, fidelity_rate_scale=20.0,
    max_num_seqs=16, max_num_batched_tokens=2048, chunked_prefill=512,
    bandwidth_args=("--iters", "15", "--warmup", "3"),
    backend_tests=BACKEND_TESTS,
    budgets_s={"env": 20, "kernels": 75, "backends": 120, "bandwidth": 60, "fidelity": 160, "engine": 200,
               "report": REPORT_RESERVE_S})

DRY_PLAN = Plan(
    device="cpu", model="tiny-llama", dtype="float32", max_model_len=256,
    engine_requests=8, hf_batch_size=4,
    fidelity_requests=24, fidelity_rate_scale=20.0,
    max_num_seqs=4, max_num_batched_tokens=128, chunked_prefill=64,
    bandwidth_args=("--contexts", "32,96", "--batches", "1,2", "--iters", "2", "--warmup", "1"),
    backend_tests=("tests/test_backend_e2e_triton.py",),  # the plumbing; CI runs them all
    # fidelity: its first Triton-interpreter run took 41 s of 90 in one CI run that a CUDA
    # compile check shared the two cores with, and the steps after it timed out; the
    # budgets only keep a device run inside its lease, so the dry run's are generous
    budgets_s={"env": 20, "kernels": 60, "backends": 30, "bandwidth": 30, "fidelity": 180, "engine": 40,
               "report": REPORT_RESERVE_S})

SECTIONS = ("env", "kernels", "backends", "bandwidth", "fidelity", "engine", "report")


# --------------------------------------------------------------------------- the slice


def write_slice(trace_dir: Path, out: Path, num_requests: int, max_model_len: int) -> Path:
    """The first `num_requests` of azure-conv-2023, clipped to `max_model_len`, with two
    tenants so that priority and fair share have something to act on: every fourth request
    is `interactive` (priority 0), the rest `batch` (priority 1). Written as a canonical
    servelab CSV, which the device reads without ../shared."""
    from servelab.traces import clip_lengths, first_n, resolve_trace
    from servelab.traces.canonical import write_csv

    trace = resolve_trace("azure-conv-2023", trace_dir=trace_dir, download=False)
    trace = clip_lengths(first_n(trace, num_requests), max_model_len)
    tagged = (replace(r, tenant="interactive" if i % 4 == 0 else "batch",
                      priority=0 if i % 4 == 0 else 1) for i, r in enumerate(trace.records))
    trace = trace.with_records(tagged, note="every 4th request tenant interactive (priority 0), "
                                            "the rest batch (priority 1)")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(trace, out)
    return out


# --------------------------------------------------------------------------- steps


@dataclass
class StepResult:
    name: str
    argv: list[str]
    status: str  # ok | failed | timeout | skipped
    wall_s: float = 0.0
    rc: int | None = None
    log: str | None = None
    note: str = ""


@dataclass
class SectionResult:
    name: str
    budget_s: float
    status: str = "pending"
    wall_s: float = 0.0
    steps: list[StepResult] = field(default_factory=list)
    note: str = ""


class Runner:
    """Runs the steps of each section as child processes inside the section's time box and
    the whole run's deadline, logging each to its own file and the manifest after each."""

    def __init__(self, out: Path, plan: Plan, dry_run: bool, budget_s: float, trace: Path,
                 argv: list[str], pack_into: Path | None = None) -> None:
        self.out, self.plan, self.dry_run, self.trace = out, plan, dry_run, trace
        self.pack_into = pack_into
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.sections: list[SectionResult] = []
        self.manifest = {
            "format": "servelab.gpu-check/1", "mode": "dry-run" if dry_run else "gpu",
            "command": os.environ.get("SERVELAB_GPU_CHECK_COMMAND")
            or "python scripts/gpu_check.py run " + shlex.join(argv),
            "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget_s, "plan": asdict(plan), "trace": trace.name,
            "sections": []}
        self.env = os.environ.copy()
        self.env.update(PYTHONUNBUFFERED="1", MPLBACKEND="Agg", HF_HUB_OFFLINE="1",
                        TRANSFORMERS_OFFLINE="1",
                        TRITON_INTERPRET="1" if dry_run else "0")

    def remaining(self, reserve: float = REPORT_RESERVE_S) -> float:
        return self.deadline - reserve - time.monotonic()

    def step(self, section: SectionResult, section_end: float, name: str, argv: list[str],
             env: dict | None = None, reserve: float = REPORT_RESERVE_S) -> StepResult:
        folder = self.out / section.name
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / f"{name}.log"
        limit = min(section_end - time.monotonic(), self.remaining(reserve))
        result = StepResult(name, [str(a) for a in argv], "skipped",
                            log=str(log.relative_to(self.out)))
        if limit < 1:
            result.note = "no time left in this section's box"
        else:
            print(f"[gpu-check] {section.name}/{name} (at most {limit:.0f} s): "
                  f"{shlex.join(result.argv)}", flush=True)
            start = time.monotonic()
            with open(log, "w") as f:
                # Its own process group, so that a stop ends its children too (pytest's xdist
                # workers would otherwise keep the GPU busy into the next section).
                proc = subprocess.Popen(result.argv, cwd=REPO, env={**self.env, **(env or {})},
                                        stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    result.rc = proc.wait(timeout=limit)
                    result.status = "ok" if result.rc == 0 else "failed"
                except subprocess.TimeoutExpired:
                    result.status, result.note = "timeout", f"stopped after {limit:.0f} s"
                finally:
                    if proc.poll() is None or result.status == "timeout":
                        _kill_group(proc)
            result.wall_s = round(time.monotonic() - start, 2)
            print(f"[gpu-check] {section.name}/{name}: {result.status} in {result.wall_s} s"
                  + (f" (rc {result.rc}; see {log})" if result.status == "failed" else ""),
                  flush=True)
        section.steps.append(result)
        self.save()
        return result

    def save(self) -> None:
        self.manifest["sections"] = [asdict(s) for s in self.sections]
        self.manifest["wall_s"] = round(time.monotonic() - self.t0, 2)
        (self.out / "manifest.json").write_text(json.dumps(self.manifest, indent=1) + "\n")

    def section(self, name: str, body) -> None:
        budget = float(self.plan.budgets_s[name])
        sec = SectionResult(name, budget)
        self.sections.append(sec)
        start = time.monotonic()
        end = start + budget
        try:
            body(self, sec, end)
        except Exception as exc:  # a bug in the kit itself must not cost the other sections
            sec.note = f"the section raised {type(exc).__name__}: {exc}"
        sec.wall_s = round(time.monotonic() - start, 2)
        statuses = {s.status for s in sec.steps}
        sec.status = ("failed" if sec.note and not sec.steps else
                      "ok" if statuses == {"ok"} else
                      "timeout" if "timeout" in statuses else
                      "failed" if "failed" in statuses else "skipped")
        self.save()
        self.pack()

    def pack(self) -> None:
        """Everything so far into `pack_into`/gpu-check.tgz (and the manifest beside it),
        after every section: a call the device stops at its limit still brings back the
        sections that finished."""
        if self.pack_into is None:
            return
        archive = shutil.make_archive(str(self.pack_into / "gpu-check.partial"), "gztar",
                                      root_dir=self.out.parent, base_dir=self.out.name)
        os.replace(archive, self.pack_into / "gpu-check.tgz")
        shutil.copyfile(self.out / "manifest.json", self.pack_into / "manifest.json")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def py(*args) -> list[str]:
    return [sys.executable, *map(str, args)]


def module(name: str, *args) -> list[str]:
    """`python -P -m name`: -P keeps the working directory (the repository root, whose
    servelab/ folder holds only the core) from shadowing the installed servelab package."""
    return py("-P", "-m", name, *args)


def servelab(*args) -> list[str]:
    return module("servelab", *args)


# --------------------------------------------------------------------------- sections


def section_env(r: Runner, sec: SectionResult, end: float) -> None:
    r.step(sec, end, "collect", py(__file__, "env", "--out", r.out / "env.json",
                                   "--device", r.plan.device))
    path = r.out / "env.json"
    if path.exists():
        r.manifest["env"] = json.loads(path.read_text())


def section_kernels(r: Runner, sec: SectionResult, end: float) -> None:
    import importlib.util

    tests = ["tests/test_kernels_decode.py", "tests/test_kernels_prefill.py",
             "tests/test_kernels_kv_write.py"]
    # On the GPU most of the time is Triton compiling each case's kernels: spread the
    # cases over worker processes where pytest-xdist is installed.
    workers = (["-n", "8"] if r.plan.device == "cuda" and importlib.util.find_spec("xdist")
               else [])
    r.step(sec, end, "pytest",
           module("pytest", "-q", "-p", "no:cacheprovider", "-m", "kernels", *workers, *tests,
              "--junitxml", r.out / "kernels" / "junit.xml"),
           env={"SERVELAB_KERNEL_DEVICE": r.plan.device})


def section_backends(r: Runner, sec: SectionResult, end: float) -> None:
    import importlib.util

    workers = (["-n", "8"] if r.plan.device == "cuda" and importlib.util.find_spec("xdist")
               else [])
    r.step(sec, end, "pytest",
           module("pytest", "-q", "-p", "no:cacheprovider", *workers, *r.plan.backend_tests,
                  "--junitxml", r.out / "backends" / "junit.xml"),
           env={"SERVELAB_BACKEND_DEVICE": r.plan.device})


def section_bandwidth(r: Runner, sec: SectionResult, end: float) -> None:
    from servelab.simulator.gpus import get_gpu, gpu_for_device_name

    gpu = None
    name = (r.manifest.get("env") or {}).get("device_name")
    if r.plan.device == "cuda" and name:
        gpu = gpu_for_device_name(name)
    peak = get_gpu(gpu).hbm_bandwidth_gbps if gpu else 3350.0
    if r.plan.device == "cuda" and gpu is None:
        sec.note = f"device {name!r} is not in the GPU catalog: % of peak uses 3350 GB/s"
    r.manifest["bandwidth_peak_gbps"] = peak
    r.step(sec, end, "decode_attention",
           py(REPO / "benchmarks" / "bench_decode_attention.py", "--device", r.plan.device,
              "--peak-gbps", peak, *r.plan.bandwidth_args,
              "--out", r.out / "bandwidth" / "decode_attention"))


def _run_args(plan: Plan, trace: Path) -> list[str]:
    return ["--device", plan.device, "--model", plan.model, "--dtype", plan.dtype,
            "--trace", str(trace), "--num-requests", str(plan.fidelity_requests),
            "--rate-scale", str(plan.fidelity_rate_scale),
            "--max-num-seqs", str(plan.max_num_seqs),
            "--max-num-batched-tokens", str(plan.max_num_batched_tokens),
            "--chunked-prefill", str(plan.chunked_prefill),
            "--max-model-len", str(plan.max_model_len), "--seed", "0",
            # servelab's engine defaults (no prefix cache, 1% watermark): the runs of the
            # first H200 check (docs/gpu-results.md), so that the next one compares with it
            "--engine", "servelab"]


def section_fidelity(r: Runner, sec: SectionResult, end: float) -> None:
    runs = r.out / "fidelity" / "runs"
    val = r.out / "fidelity"
    done = []
    for policy in POLICIES:
        step = r.step(sec, end, f"run-{policy}",
                      servelab("run", *_run_args(r.plan, r.trace), "--policy", policy,
                               "--out", runs / policy))
        if step.status == "ok":
            done.append(policy)
    if "fcfs" not in done:
        sec.note = "the fcfs run failed: nothing to fit on"
        return
    run_flags = [a for p in done for a in ("--run", runs / p)]
    r.step(sec, end, "validate-default", servelab("validate", *run_flags,
                                                  "--out", val / "val-default"))
    fit = r.step(sec, end, "validate-fit", servelab("validate", "--run", runs / "fcfs", "--fit",
                                                    "--out", val / "val-fit"))
    if fit.status != "ok":
        return
    r.step(sec, end, "validate-heldout",
           servelab("validate", *run_flags, "--calibration", val / "val-fit" / "calibration.json",
                    "--simulate", "--out", val / "val-heldout"))
    # The engine's run-to-run spread, against which the policies' differences are judged:
    # fcfs once more, after everything the targets need.
    r.step(sec, end, f"run-{REPEATED}",
           servelab("run", *_run_args(r.plan, r.trace), "--policy", "fcfs",
                    "--out", runs / REPEATED))


def section_engine(r: Runner, sec: SectionResult, end: float) -> None:
    p = r.plan
    r.step(sec, end, "throughput",
           py(REPO / "benchmarks" / "bench_engine_throughput.py", "--device", p.device,
              "--model", p.model, "--dtype", p.dtype, "--trace", r.trace,
              "--num-requests", p.engine_requests, "--hf-batch-size", p.hf_batch_size,
              "--max-model-len", p.max_model_len, "--gpu-memory-utilization", "0.6",
              "--out", r.out / "engine" / "throughput"))


def section_report(r: Runner, sec: SectionResult, end: float) -> None:
    r.save()
    r.step(sec, end, "gpu-results",
           py(REPO / "scripts" / "gpu_results.py", r.out, "--out", r.out / "gpu-results.md"),
           reserve=0.0)


BODIES = {"env": section_env, "kernels": section_kernels, "backends": section_backends,
          "bandwidth": section_bandwidth,
          "fidelity": section_fidelity, "engine": section_engine, "report": section_report}


# --------------------------------------------------------------------------- env


def collect_env(device: str) -> dict:
    """Device, driver and library versions, for the results document."""
    from importlib import metadata

    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(),
           "torch_cuda": torch.version.cuda, "device": device}
    for dist in ("torch", "triton", "transformers", "simpy", "numpy", "scipy"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    commit = REPO / ".gpu" / "commit"
    env["servelab_commit"] = commit.read_text().strip() if commit.exists() else None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count,
                   compute_capability=f"{props.major}.{props.minor}")
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            env["driver"] = smi.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            env["driver"] = None
    else:
        env.update(device_name="cpu", driver=None, cpu=platform.processor() or platform.machine(),
                   cpu_count=os.cpu_count())
    return env


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the sections into --out")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--dry-run", action="store_true",
                     help="CPU, tiny shapes, Triton interpreter: checks the kit, measures nothing")
    run.add_argument("--budget-s", type=float, default=None,
                     help="whole-run limit in seconds (default: the sum of the section budgets)")
    run.add_argument("--sections", default=",".join(SECTIONS),
                     help=f"comma-separated subset of {','.join(SECTIONS)} (report always runs)")
    run.add_argument("--section-budgets", default="", metavar="NAME=S,...",
                     help="override sections' time boxes in seconds, e.g. engine=300")
    run.add_argument("--pack-into", type=Path, default=None, metavar="DIR",
                     help="after every section, pack --out into DIR/gpu-check.tgz")
    run.add_argument("--trace", type=Path, default=DEFAULT_SLICE,
                     help="the trace slice (default %(default)s, written by `slice`)")
    sl = sub.add_parser("slice", help="write the trace slice the device reads")
    sl.add_argument("--trace-dir", type=Path, default=REPO.parent / "shared" / "traces")
    sl.add_argument("--out", type=Path, default=DEFAULT_SLICE)
    sl.add_argument("--num-requests", type=int, default=256)
    sl.add_argument("--max-model-len", type=int, default=GPU_PLAN.max_model_len)
    env = sub.add_parser("env", help=argparse.SUPPRESS)
    env.add_argument("--out", type=Path, required=True)
    env.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.command == "run":
        chosen = [s for s in args.sections.split(",") if s]
        unknown = sorted(set(chosen) - set(SECTIONS))
        if unknown:
            p.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
        args.sections = [s for s in SECTIONS if s in chosen or s in ("env", "report")]
        try:
            pairs = [item.split("=") for item in args.section_budgets.split(",") if item]
            args.section_budgets = {name: float(value) for name, value in pairs}
        except ValueError:
            p.error(f"--section-budgets: expected NAME=SECONDS,..., got {args.section_budgets!r}")
        unknown = sorted(set(args.section_budgets) - set(SECTIONS))
        if unknown:
            p.error(f"--section-budgets: unknown {unknown}; choose from {','.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    if args.command == "slice":
        path = write_slice(args.trace_dir, args.out, args.num_requests, args.max_model_len)
        print(f"wrote {path}")
        return 0
    if args.command == "env":
        args.out.write_text(json.dumps(collect_env(args.device), indent=1) + "\n")
        return 0
    if not args.trace.is_file():
        print(f"gpu_check: trace slice {args.trace} not found: run scripts/gpu_prepare.sh "
              "first (it writes the slice and the wheels the device lacks)", file=sys.stderr)
        return 2
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    plan = replace(plan, budgets_s={**plan.budgets_s, **args.section_budgets})
    budget = args.budget_s or sum(plan.budgets_s[s] for s in args.sections)
    args.out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args.out, plan, args.dry_run, budget, args.trace.resolve(), raw[1:],
                    pack_into=args.pack_into)
    for name in args.sections:
        runner.section(name, BODIES[name])
    runner.manifest["finished_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runner.save()
    failed = [s.name for s in runner.sections if s.status != "ok"]
    print(f"[gpu-check] done in {runner.manifest['wall_s']:.0f} s; "
          + (f"not ok: {', '.join(failed)}" if failed else "every section ok")
          + f"; results in {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
