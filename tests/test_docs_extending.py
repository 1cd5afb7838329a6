"""docs/extending.md runs: each section's Python blocks, in order, in a fresh process
(so what they register stays there). The doc and the code cannot drift apart."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def sections() -> dict[str, str]:
    """Section title -> its Python code blocks joined."""
    out = {}
    for part in re.split(r"^## ", DOC.read_text(encoding="utf-8"), flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        out[title.strip()] = "\n\n".join(re.findall(r"^```python\n(.*?)^```", body, re.M | re.S))
    return out


def test_the_doc_covers_every_extension_point():
    assert set(sections()) == {"Adding a policy", "Adding a preemption mode",
                               "Adding a block manager", "Adding a GPU"}


@pytest.mark.parametrize("title", ["Adding a policy", "Adding a preemption mode",
                                   "Adding a block manager", "Adding a GPU"])
def test_the_example_runs(title, tmp_path):
    code = sections()[title]
    # a code entry registers itself; a GPU is a data file the example writes
    assert ("register_" in code) if title != "Adding a GPU" else ('"calibration"' in code)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
