"""Progress of long work, drawn by tqdm: the one place commands show it.

A run (`servelab simulate`, `servelab run`): requests done out of all, their rate and the
time left (tqdm's ETA, from wall time), and the run's own clock (simulated seconds, or the
real engine's virtual or wall clock) with whatever else the command wants to show.

    bar = RequestProgress(total=2000, command="simulate", clock="simulated")
    bar.update(done=120, clock_s=8.5)                  # as often as liked: tqdm throttles
    bar.close()

A sweep (`servelab compare`, `servelab capacity`): one line per settled point, the record
of what ran (also when redirected), and on a terminal a bar of the batch beneath them.

    progress = PointProgress(command="compare")
    runner.run(points, progress)                       # progress(outcome, done, total)

Bars are drawn only on a terminal (or when `enabled=True`): redirected output stays clean.
A run whose output is not a terminal may still ask for a plain line every `plain_every_s`
seconds of wall time (`servelab run` does, so a long run in a log is never silent).
tqdm is imported when a bar is made, so importing this module costs nothing.
"""
from __future__ import annotations

import sys
import time
from typing import IO, Any, Callable


class RequestProgress:
    def __init__(self, total: int, *, command: str, clock: str, stream: IO[str] | None = None,
                 enabled: bool | None = None, min_interval_s: float = 0.5,
                 plain_every_s: float | None = None) -> None:
        stream = stream if stream is not None else sys.stderr
        self.enabled = stream.isatty() if enabled is None else enabled
        self.clock, self.command, self.total, self.stream = clock, command, total, stream
        self._bar = None
        self._plain_every_s = None if self.enabled else plain_every_s
        self._start = self._last_line = time.monotonic()
        self._done, self._clock_s = 0, 0.0
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=command, unit="req", file=stream, mininterval=min_interval_s,
                             dynamic_ncols=True, leave=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} requests "
                                        "[{elapsed}<{remaining}, {rate_fmt}]{postfix}")

    def update(self, done: int, clock_s: float, extra: str = "") -> None:
        """`done` requests finished (or rejected) at `clock_s` on the run's clock."""
        self._done, self._clock_s = done, clock_s
        if self._plain_every_s is not None:
            now = time.monotonic()
            if now - self._last_line >= self._plain_every_s:
                self._last_line = now
                self._plain_line(extra)
        if self._bar is None:
            return
        self._bar.set_postfix_str(f"{self.clock} {clock_s:,.1f} s" + (f", {extra}" if extra else ""),
                                  refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._plain_every_s is not None:
            self._plain_line("finished")
            self._plain_every_s = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _plain_line(self, extra: str) -> None:
        self.stream.write(f"{self.command}: {self._done}/{self.total} requests, {self.clock} "
                          f"{self._clock_s:,.1f} s" + (f", {extra}" if extra else "")
                          + f"  (elapsed {time.monotonic() - self._start:.0f} s)\n")
        self.stream.flush()


class PointProgress:
    """`progress(outcome, done, total)` for `SweepRunner.run`: writes "<command>: <prefix>[done/
    total] <point>  <state>[: error][detail]  (elapsed S s)" per settled point (`detail`
    of its outcome, when given), above a tqdm bar of the batch on a terminal. `prefix` may
    change between batches (a capacity search's round)."""

    def __init__(self, *, command: str = "compare", detail: Callable[[Any], str] | None = None,
                 stream: IO[str] | None = None, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.command, self.detail, self.prefix = command, detail, ""
        self.start = time.monotonic()
        self._bar = None

    def __call__(self, outcome, done: int, total: int) -> None:
        state = {"ran": "done", "done before": "done before, skipped", "failed": "FAILED"}[outcome.status]
        error = f": {outcome.error}" if outcome.error else ""
        detail = self.detail(outcome) if self.detail is not None and not outcome.error else ""
        line = (f"{self.command}: {self.prefix}[{done:>{len(str(total))}}/{total}] "
                f"{outcome.point.describe()}  {state}{error}{detail}  "
                f"(elapsed {time.monotonic() - self.start:.1f} s)")
        if not self.enabled:
            self.stream.write(line + "\n")
            self.stream.flush()
            return
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=total, desc=f"{self.command}: {self.prefix}".rstrip(), unit="point",
                             file=self.stream, leave=False, dynamic_ncols=True)
        tqdm.write(line, file=self.stream)
        self._bar.update(1)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
