"""Atomic file writes: a file appears under its name complete, or not at all.

    with atomic_path(out / "steps.parquet") as tmp:   # any writer that takes a path
        pyarrow.parquet.write_table(table, tmp)
    write_atomic(out / "report.md", text)             # bytes or str

The data goes to a temporary file in the target's folder (same file system, so the
final `os.replace` is atomic), is flushed to disk (`fsync`), then replaces the target.
A failure anywhere removes the temporary file and leaves an existing target as it was,
so a crashed or killed run never leaves half a file behind a valid name. The temporary
name is unique per live process and thread; a leftover of a killed process starts with
a dot and ends in `.tmp`.

Cost: one fsync per file (milliseconds on a local disk), which is why whole run
directories, not single rows, are the unit written.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

PathLike = str | os.PathLike[str]


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """A temporary path beside `path` to write; on leaving the block without an error it
    is fsynced and moved onto `path`, on an error it is removed."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_atomic(path: PathLike, data: bytes | str) -> None:
    """Write `data` (str as UTF-8, newlines untranslated) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
