"""A run directory is never silently replaced by a different run.

`servelab simulate --out DIR` and `servelab run --out DIR` write into DIR. Rerunning the
same command there replaces the run with an identical one, which loses nothing; anything
else (another run's config.json, or files that are not a run) needs `--force`.

    check_out_dir(Path("runs/x"), config.to_dict(), force=args.force)   # ValueError if not

A sweep (`compare`, `capacity`, `plan`) writes into DIR too, and resumes there: its points'
runs are kept by config, so rerunning it — or another sweep of the same command — reuses
what is done. A report of another command, a `simulate` run or files that are not a sweep's
need `--force`:

    check_sweep_dir(Path("sweeps/x"), "capacity", force=args.force)     # ValueError if not
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

RUN_LOCK = ".run.lock"
"""Held (flock) inside a run directory while a command moves its files in."""
STAGING_PREFIX = ".staging-"
"""A run's files are written into DIR/.staging-<pid> first (`staged_run_dir`)."""


def check_out_dir(out: Path, config: dict[str, Any], *, force: bool) -> None:
    """Raise ValueError (with what to do) when `out` holds something other than a run of
    `config` (the "config" part of a run directory's config.json) and `force` is off."""
    if force or not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if not any(not _ours(p) for p in out.iterdir()):
        return
    try:
        earlier = json.loads((out / "config.json").read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"--out {out} is not empty and holds no servelab run: use another "
                         "--out, or --force to write into it") from None
    wanted = json.loads(json.dumps(config))          # as config.json would hold it
    if not isinstance(earlier, dict) or earlier != wanted:
        keys = sorted(set(earlier) | set(wanted)) if isinstance(earlier, dict) else []
        differ = [k for k in keys if earlier.get(k) != wanted.get(k)]
        what = (f" (its {', '.join(differ[:6])}{', ...' if len(differ) > 6 else ''} "
                f"differ{'s' if len(differ) == 1 else ''})") if differ else ""
        raise ValueError(f"--out {out} holds another run{what}: use another --out, or --force "
                         "to replace it")


def _ours(path: Path) -> bool:
    """The lock and staging folders a run directory holds while (or after) it is written."""
    return path.name == RUN_LOCK or path.name.startswith(STAGING_PREFIX)


@contextlib.contextmanager
def staged_run_dir(out: Path, replaces: Iterable[str],
                   check: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A folder inside `out` to write a run's files into; leaving the block moves them into
    `out` together, so that `out` holds one run's files, never a mix of two. `replaces`
    names the files an earlier run may have left there: those this run does not write go.

    The move runs under a lock on `out` (`RUN_LOCK`), after `check(out)` (which may raise:
    another command may have written `out` since it was first checked); a second command
    moving its files in at that moment is refused (ValueError). Until the move, `out` is as
    it was: an error or an interrupt while the files are written leaves it so (the staging
    folder is removed, or by the next write if the process was killed). config.json goes
    first and comes back last, so a move cut short leaves no run to mistake for another."""
    out.mkdir(parents=True, exist_ok=True)
    staging = out / f"{STAGING_PREFIX}{os.getpid()}"
    for stale in out.glob(f"{STAGING_PREFIX}*"):   # ours from an earlier crash, or a live one's
        if stale == staging or not _alive(stale.name[len(STAGING_PREFIX):]):
            shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        with _run_lock(out):
            if check is not None:
                check(out)
            written = {p.name for p in staging.iterdir()}
            (out / "config.json").unlink(missing_ok=True)
            for name in set(replaces) - written:
                (out / name).unlink(missing_ok=True)
            for name in sorted(written - {"config.json"}) + ["config.json"] * ("config.json" in written):
                os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: str) -> bool:
    """Whether process `pid` (a staging folder's) still runs."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _run_lock(out: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:   # not POSIX: no lock
        yield
        return
    lock = out / RUN_LOCK
    with open(lock, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another command is writing {out} (locked: {lock})") from None
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


SWEEP_REPORTS = (("plan", "plan.json"), ("capacity", "capacity.json"), ("compare", "sweep.json"))
"""Which command's report a sweep directory holds, by the file only it writes (a capacity
search and a plan write sweep.json too), checked in this order."""
SWEEP_LAYOUT = frozenset({"runs", "figures", "report.md", "index.html", ".sweep.lock",
                          *(name for _, name in SWEEP_REPORTS)})
"""Everything a sweep writes at the top of its directory (sweeps/sweep.py; .sweep.lock is
its LOCK_FILE)."""


def check_sweep_dir(out: Path, command: str, *, force: bool) -> None:
    """Raise ValueError (with what to do) when `out` holds anything but a sweep of
    `command` (finished or interrupted: an interrupted one holds only runs/, which any sweep
    may reuse) and `force` is off."""
    if force or not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    names = {entry.name for entry in out.iterdir()}
    foreign = sorted(names - SWEEP_LAYOUT)
    if foreign:
        what = "a `servelab simulate` run" if "config.json" in names else \
            f"files that are not a sweep's ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})"
        raise ValueError(f"--out {out} holds {what}: use another --out, or --force to write "
                         f"the {command} report into it")
    kind = next((name for name, marker in SWEEP_REPORTS if marker in names), None)
    if kind not in (None, command):
        raise ValueError(f"--out {out} holds a `servelab {kind}` report: use another --out, or "
                         f"--force to replace it with this {command}'s (its runs are reused)")
