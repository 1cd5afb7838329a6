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
import errno
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

STAGING_PREFIX = ".staging-"
"""A run's files are written into a DIR/.staging-* folder first (`staged_run_dir`)."""
STALE_STAGING_S = 86_400.0
"""A staging folder this old was left by a killed process: the next write removes it."""


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
    """A staging folder a run directory holds while (or, killed, after) it is written."""
    return path.name.startswith(STAGING_PREFIX)


class OutDirTaken(ValueError):
    """Another command holds, or wrote meanwhile, the directory a run was to move into."""


@contextlib.contextmanager
def exclusive_lock(target: Path, busy: Callable[[], Exception]) -> Iterator[None]:
    """Hold an exclusive lock (flock) on `target`, a directory or a lock file (made if
    missing), for the block, or raise `busy()` at once when another process holds it. The
    kernel releases the lock of a process that dies. Where locks are not to be had (not
    POSIX, or a file system without them: NFS without lockd, some FUSE mounts) the block
    runs unlocked, as it did before locks were taken."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    flags = os.O_RDONLY if target.is_dir() else os.O_RDWR | os.O_CREAT
    fd = os.open(target, flags, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy() from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged_run_dir(out: Path, replaces: Iterable[str],
                   check: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A folder inside `out` to write a run's files into; leaving the block moves them into
    `out` together, so that `out` holds one run's files, never a mix of two. `replaces`
    names the files an earlier run may have left there: those this run does not write go.

    The move runs under a lock on the directory `out` itself, after `check(out)` (which may raise;
    another command may have written `out` since it was first checked); a second command
    moving its files in at that moment is refused (`OutDirTaken`). Until the move, `out` is
    as it was: an error or an interrupt while the files are written leaves it so (the
    staging folder is removed; one a killed process left is removed by the next write into
    `out` that finds it older than a day). config.json goes first and comes back last, so a
    move cut short leaves no run to mistake for another."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{STAGING_PREFIX}*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    try:
        yield staging
        with exclusive_lock(out, lambda: OutDirTaken(f"another command is writing {out}")):
            if check is not None:
                try:
                    check(out)
                except ValueError as exc:
                    raise OutDirTaken(str(exc)) from exc
            written = {p.name for p in staging.iterdir()}
            (out / "config.json").unlink(missing_ok=True)
            for name in set(replaces) - written:
                (out / name).unlink(missing_ok=True)
            last = ["config.json"] if "config.json" in written else []
            for name in sorted(written - {"config.json"}) + last:
                os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
