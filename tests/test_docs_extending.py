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


TITLES = ["Adding a policy", "Adding a preemption mode", "Adding a block manager",
          "Adding a router", "Adding a trace format", "Adding a GPU"]


def test_the_doc_covers_every_extension_point():
    assert set(sections()) == set(TITLES)


def test_every_registry_has_its_section():
    """Each registry's entries are "Adding a <what>" (preemption strategies are modes)."""
    from servelab.memory.registry import BLOCK_MANAGERS
    from servelab.policies.base import POLICIES
    from servelab.policies.preemption import PREEMPTIONS
    from servelab.simulator.router import ROUTERS
    from servelab.traces.formats import TRACE_FORMATS

    whats = [r.what for r in (POLICIES, PREEMPTIONS, BLOCK_MANAGERS, ROUTERS, TRACE_FORMATS)]
    assert [f"Adding a {w}" + (" mode" if w == "preemption" else "") for w in whats] == TITLES[:5]


@pytest.mark.parametrize("title", TITLES)
def test_the_example_runs(title, tmp_path):
    code = sections()[title]
    # a code entry registers itself; a GPU is a data file the example writes
    assert ("register_" in code) if title != "Adding a GPU" else ('"calibration"' in code)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
