"""A run directory is never silently replaced by a different run.

`servelab simulate --out DIR` and `servelab run --out DIR` write into DIR. Rerunning the
same command there replaces the run with an identical one, which loses nothing; anything
else (another run's config.json, or files that are not a run) needs `--force`.

    check_out_dir(Path("runs/x"), config.to_dict(), force=args.force)   # ValueError if not
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
