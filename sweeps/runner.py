"""Running sweep points: a local process pool by default, Ray when asked for.

    outcome = run_sweep(points, Path("runs/cmp"), workers=4)            # one grid
    with SweepRunner(Path("runs/cap"), workers=2) as runner:            # batches chosen as you go
        outcomes = runner.run(points)

Execution: a local `ProcessPoolExecutor` (spawn context: no state inherited from the
driver), or Ray, imported only when asked for. Pool workers write their own points (the
CSV formatting is CPU work worth spreading); Ray tasks return their results and the driver
writes them, so a Ray cluster needs no shared file system. Storage, keys and the lock are
`sweeps/sweep.py`'s. Nothing here reads a clock: callers time the progress lines.

Ctrl-C: the terminal sends SIGINT to the whole process group, workers included. Pool
workers ignore it, so none turns it into a failed point and carries on with the queue;
the driver cancels what has not started, terminates the workers (their points were not
committed, so nothing half-written is kept) and raises `SweepInterrupted`, which says
how many points are stored and that rerunning the command resumes.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from servelab._validate import check_bounded
from servelab.simulator.run import SimulationResult, run_simulation, write_run_dir
from servelab.sweeps.sweep import (POINT_ERRORS, RAY_INSTALL_HINT, RUNS_DIR, PointOutcome,
                                   Progress, SweepError, SweepOutcome, SweepPoint, sweep_lock, commit_point,
                                   is_done, write_sweep_file)


def default_workers() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_sweep(points: Sequence[SweepPoint], out_dir: Path, *, workers: int | None = None,
              ray: bool = False, ray_address: str | None = None,
              axes: Mapping[str, Sequence[Any]] | None = None,
              progress: Progress | None = None, output_format: str = "csv") -> SweepOutcome:
    """Run every point not already done in out_dir and list them in DIR/sweep.json; return
    one outcome per point.

    workers: parallel simulations (default: the CPUs available); with Ray, the CPUs of the
    local instance it starts (ignored with ray_address). ray / ray_address: run on a local
    Ray instance, or on the cluster at that address ("auto" for the one this machine
    belongs to). Points whose inputs fail (POINT_ERRORS) are 'failed' outcomes; any other
    exception stops the sweep and propagates, finished points staying stored.
    output_format: how each point's requests and steps are written (csv or parquet).
    """
    _check_points(points)
    with SweepRunner(out_dir, workers=workers, ray=ray, ray_address=ray_address,
                     output_format=output_format) as runner:
        write_sweep_file(runner.out_dir, points, axes)
        outcomes = runner.run(points, progress)
    return SweepOutcome(Path(out_dir), tuple(outcomes))


def _check_points(points: Sequence[SweepPoint]) -> None:
    if not points:
        raise ValueError("a sweep needs at least one point")
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise ValueError("a sweep lists the same point twice")


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep: the workers are stopped; the message says what is stored."""


def _ignore_interrupts() -> None:
    """Pool worker initializer: Ctrl-C is the driver's to handle (see the module docstring);
    a spawned worker imports the user's own entries (`$SERVELAB_PLUGINS`) as the driver did."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from servelab.registry import import_plugins

    import_plugins()


class SweepRunner:
    """Runs batches of points into one DIR, holding its lock and one process pool (or one
    Ray connection) across batches: a search that decides its next points from the last
    ones (`sweeps/capacity.py`) pays for starting the workers once, not per batch (a spawned
    worker imports the simulator: about a second).

        with SweepRunner(Path("runs/x"), workers=2) as runner:
            outcomes = runner.run(points)          # as many batches as wanted
    """

    def __init__(self, out_dir: Path, *, workers: int | None = None, ray: bool = False,
                 ray_address: str | None = None, output_format: str = "csv") -> None:
        workers = default_workers() if workers is None else workers
        check_bounded("workers", workers, 1, integer=True, noun="an integer")
        self.out_dir, self.workers = Path(out_dir), workers
        self.output_format = output_format
        self.runs_dir = self.out_dir / RUNS_DIR
        self.use_ray, self.ray_address = ray or ray_address is not None, ray_address
        self._stack: contextlib.ExitStack | None = None
        self._pool: ProcessPoolExecutor | None = None
        self._ray = None
        self._asked: dict[str, str] = {}
        """Name -> key of every point asked of this runner (what an interruption counts)."""

    def __enter__(self) -> "SweepRunner":
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        stack = contextlib.ExitStack()
        stack.enter_context(sweep_lock(self.out_dir))
        for entry in self.runs_dir.glob(".*.tmp"):   # left by killed sweeps
            shutil.rmtree(entry, ignore_errors=True)
        self._stack = stack
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        interrupted = isinstance(exc, KeyboardInterrupt) and not isinstance(exc, SweepInterrupted)
        try:
            if self._pool is not None:
                if interrupted:
                    _stop_now(self._pool)
                else:
                    self._pool.shutdown(wait=exc is None, cancel_futures=exc is not None)
            if self._ray is not None and self._ray[1]:   # a Ray instance this runner started
                self._ray[0].shutdown()
        finally:
            self._pool = self._ray = None
            self._stack.close()
        if interrupted:
            # counted on disk once the workers are gone: a worker may have committed a point
            # whose result the driver had not received yet
            stored = sum(is_done(self.runs_dir / name, key) for name, key in self._asked.items())
            raise SweepInterrupted(
                f"interrupted: {stored} point(s) of this sweep are stored in "
                f"{self.out_dir}; run the same command again to resume (points already stored "
                "are not run again)") from None

    def run(self, points: Sequence[SweepPoint], progress: Progress | None = None) -> list[PointOutcome]:
        """Run the points not already stored; one outcome per point, in order. `progress`
        numbers the points of this batch."""
        _check_points(points)
        settled: dict[str, PointOutcome] = {}

        self._asked.update((p.name, p.key) for p in points)

        def settle(outcome: PointOutcome) -> None:
            settled[outcome.point.key] = outcome
            if progress is not None:
                progress(outcome, len(settled), len(points))

        pending = []
        for p in points:
            if is_done(self.runs_dir / p.name, p.key):
                settle(PointOutcome(p, self.runs_dir / p.name, "done before",
                                    _read_summary(self.runs_dir / p.name)))
            else:
                pending.append(p)
        for point in pending:   # incomplete directories of killed sweeps
            stale = self.runs_dir / point.name
            if stale.exists():
                shutil.rmtree(stale)
        if pending:
            if self.use_ray:
                self._run_on_ray(pending, settle)
            else:
                self._run_on_pool(pending, settle)
        return [settled[p.key] for p in points]

    def _run_on_pool(self, pending: Sequence[SweepPoint], settle: Callable[[PointOutcome], None]) -> None:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=min(self.workers, len(pending)),
                                             mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_ignore_interrupts)
        runs_dir, order = self.runs_dir, {p.key: i for i, p in enumerate(pending)}
        futures = {self._pool.submit(_simulate_and_commit, p, runs_dir, self.output_format): p
                   for p in pending}
        while futures:
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: order[futures[f].key]):
                point = futures.pop(future)
                try:
                    summary = future.result()
                except POINT_ERRORS as exc:
                    settle(_failed(point, runs_dir, exc))
                else:
                    settle(PointOutcome(point, runs_dir / point.name, "ran", summary))

    def _run_on_ray(self, pending: Sequence[SweepPoint], settle: Callable[[PointOutcome], None]) -> None:
        if self._ray is None:
            ray = import_ray()
            started = not ray.is_initialized()
            if started:
                if self.ray_address is None:
                    ray.init(num_cpus=self.workers, include_dashboard=False, log_to_driver=False)
                else:
                    ray.init(address=self.ray_address, log_to_driver=False)
            self._ray = (ray, started, ray.remote(num_cpus=1)(_simulate))
        ray, _, task = self._ray
        refs = {task.remote(p): p for p in pending}
        while refs:
            (ref,), _ = ray.wait(list(refs), num_returns=1)
            point = refs.pop(ref)
            try:
                result = ray.get(ref)
            except POINT_ERRORS as exc:  # a RayTaskError is also an instance of its cause's class
                settle(_failed(point, self.runs_dir, exc))
                continue
            commit_point(point, self.runs_dir,
                         lambda d: write_run_dir(result, d, self.output_format))
            settle(PointOutcome(point, self.runs_dir / point.name, "ran", result.summary))


def _stop_now(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the workers at once (terminate_workers from
    Python 3.14; before it, the pool's own process table, read before shutdown clears it)."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=5)


def _read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _simulate_and_commit(point: SweepPoint, runs_dir: Path, output_format: str) -> dict[str, Any]:
    """Pool task: simulate one point and store it; returns its summary."""
    result = run_simulation(point.config)
    commit_point(point, runs_dir, lambda d: write_run_dir(result, d, output_format))
    return result.summary


def _simulate(point: SweepPoint) -> SimulationResult:
    """Ray task: simulate one point; the driver stores it."""
    return run_simulation(point.config)


def _failed(point: SweepPoint, runs_dir: Path, exc: BaseException) -> PointOutcome:
    cause = getattr(exc, "cause", None) or exc  # Ray wraps a task's exception
    return PointOutcome(point, runs_dir / point.name, "failed", error=f"{type(cause).__name__}: {cause}")


def import_ray():
    """The `ray` module, or SweepError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise SweepError(f"running a sweep on Ray needs the ray package: {RAY_INSTALL_HINT}") from None
    return ray
