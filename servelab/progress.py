"""The progress bar of a long run (`servelab simulate`, `servelab run`): requests done out
of all, their rate and the time left (tqdm's ETA, from wall time), and the run's own clock
(simulated seconds, or the real engine's virtual or wall clock) with whatever else the
command wants to show.

    bar = RequestProgress(total=2000, command="simulate", clock="simulated")
    bar.update(done=120, clock_s=8.5)                  # as often as liked: tqdm throttles
    bar.close()

Drawn only on a terminal (or when `enabled=True`): redirected output stays clean. tqdm is
imported when a bar is made, so importing this module costs nothing.
"""
from __future__ import annotations

import sys
from typing import IO


class RequestProgress:
    def __init__(self, total: int, *, command: str, clock: str, stream: IO[str] | None = None,
                 enabled: bool | None = None, min_interval_s: float = 0.5) -> None:
        stream = stream if stream is not None else sys.stderr
        self.enabled = stream.isatty() if enabled is None else enabled
        self.clock = clock
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=command, unit="req", file=stream, mininterval=min_interval_s,
                             dynamic_ncols=True, leave=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} requests "
                                        "[{elapsed}<{remaining}, {rate_fmt}] {postfix}")

    def update(self, done: int, clock_s: float, extra: str = "") -> None:
        """`done` requests finished (or rejected) at `clock_s` on the run's clock."""
        if self._bar is None:
            return
        self._bar.set_postfix_str(f"{self.clock} {clock_s:,.1f} s" + (f", {extra}" if extra else ""),
                                  refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
