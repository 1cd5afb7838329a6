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

import json
from pathlib import Path
from typing import Any


def check_out_dir(out: Path, config: dict[str, Any], *, force: bool) -> None:
    """Raise ValueError (with what to do) when `out` holds something other than a run of
    `config` (the "config" part of a run directory's config.json) and `force` is off."""
    if force or not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if not any(out.iterdir()):
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
