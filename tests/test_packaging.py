"""The distribution installs every component under the one `servelab` namespace."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = ("memory", "policies", "simulator", "backends", "traces", "reports", "validation",
              "sweeps")


def _source_packages() -> set[str]:
    """Every folder with an __init__.py, as the module path it must install to."""
    pkgs = {"servelab"}
    for comp in COMPONENTS:
        for init in (REPO / comp).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO).parts
            pkgs.add(".".join(("servelab",) + rel))
    return pkgs


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The wheel, and what building it printed."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-w", str(out), str(REPO)],
                          check=True, capture_output=True, text=True)
    (whl,) = out.glob("servelab-*.whl")
    return whl, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def wheel(built) -> Path:
    return built[0]


def test_building_prints_no_packaging_warning(built):
    """setuptools warns about every importable folder the configuration leaves out (the
    data folders did, in ~170 lines of boxes per install)."""
    _, log = built
    assert "absent from the `packages` configuration" not in log
    assert "Package would be ignored" not in log


def test_wheel_ships_every_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = [p for comp in ("servelab",) + COMPONENTS for p in (REPO / comp).rglob("data/**/*.json")]
    assert data
    for path in data:
        rel = path.relative_to(REPO)
        installed = rel if rel.parts[0] == "servelab" else Path("servelab", *rel.parts)
        assert installed.as_posix() in names, rel


def test_wheel_holds_every_component_under_servelab(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"servelab", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for pkg in _source_packages():
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    # nothing generic at the top level of site-packages
    for comp in COMPONENTS:
        assert not any(n.startswith(comp + "/") for n in names)
    assert any(n.startswith("servelab/data/models/") and n.endswith(".json") for n in names)


def test_wheel_declares_console_script_and_light_core_dependencies(wheel):
    zf = zipfile.ZipFile(wheel)
    meta_dir = next(n.split("/")[0] for n in zf.namelist() if n.endswith("METADATA"))
    entry = zf.read(f"{meta_dir}/entry_points.txt").decode()
    assert "servelab = servelab.cli:main" in entry
    meta = zf.read(f"{meta_dir}/METADATA").decode()
    core = [line for line in meta.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not any(heavy in line for line in core for heavy in ("torch", "triton", "transformers", "ray"))
    assert any("extra == \"backend\"" in line and "torch" in line for line in meta.splitlines())


def test_every_source_package_is_installed_in_this_environment():
    import importlib

    for pkg in sorted(_source_packages()):
        importlib.import_module(pkg)


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "servelab", "--help"], check=True,
                         capture_output=True, text=True).stdout
    assert "usage: servelab" in out


def test_the_missing_backend_check_names_the_backend_extra():
    import re
    import tomllib

    from servelab.backends.cli import BACKEND_MODULES

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["backend"]
    assert sorted(re.match(r"[A-Za-z0-9_-]+", req).group() for req in extra) == sorted(BACKEND_MODULES)
