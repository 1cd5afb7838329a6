"""policies/ and memory/ stay pure Python: importing them pulls in no torch, triton or simpy."""
import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "simpy", "transformers")


@pytest.mark.parametrize("module", ["servelab.memory", "servelab.policies", "servelab.request",
                                    "servelab.engine", "servelab.outputs", "servelab.config",
                                    "servelab.options"])
def test_import_pulls_in_no_heavy_dependency(module):
    code = (f"import sys, {module}\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
            f"print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"
