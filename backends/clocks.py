"""The engine loop's clocks and its progress line.

A clock answers `now()`, is told how long each step took (`advance`), and is asked to let
time pass until the next arrival (`wait_until`):

- `VirtualClock` (servelab.engine's): time is the sum of measured step durations, idle
  gaps are jumped over (nothing sleeps; a replay's timeline is comparable with the
  simulator's);
- `WallClock`: time is real; idle gaps are slept through.
"""
from __future__ import annotations

import time

from servelab.engine import VirtualClock

__all__ = ["VirtualClock", "WallClock", "Progress"]


class WallClock:
    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def advance(self, seconds: float) -> None:
        pass  # the wall clock moved by itself

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class Progress:
    """The engine loop's progress (`servelab.progress.RequestProgress`): requests done, rate
    and time left, the run's clock, and what the scheduler holds. `enabled`: True draws a
    bar, False shows nothing, None draws a bar on a terminal and otherwise writes a plain
    line every PLAIN_EVERY_S seconds. Refreshed at most every half second of wall time
    (the loop calls `update` every step)."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, total: int, enabled: bool | None, clock: str = "virtual") -> None:
        from servelab.progress import RequestProgress

        self._bar = RequestProgress(total, command="run", clock=f"{clock} clock",
                                    enabled=enabled,
                                    plain_every_s=self.PLAIN_EVERY_S if enabled is None else None)
        self.enabled = enabled is not False
        self._last = -1.0

    def update(self, done: int, now: float, steps: int, sched, force: bool = False) -> None:
        if not self.enabled:
            return
        t = time.monotonic()
        if not force and t - self._last < 0.5:
            return
        self._last = t
        self._bar.update(done, now, f"{sched.num_running} running, {sched.num_waiting} waiting, "
                                    f"{sched.num_swapped} swapped, {steps} steps")

    def close(self) -> None:
        self._bar.close()
