"""servelab's import structure, read from the source with `ast` (nothing is imported).

(a) DESIGN.md's table of which folder may import which (`MAY_IMPORT` and `LIBRARIES`,
    copied from ../shared/DESIGN.md, "The house", and checked against it), for every
    import a module makes at run time: at module level or inside a function (a deferred
    import is still a dependency).
    Imports under `if TYPE_CHECKING:` are not counted: they name types for annotations and
    run nothing. Third-party libraries: the table gives some folders a library (numpy to
    the core, simpy to simulator/, torch, triton and transformers to backends/,
    matplotlib to reports/: `LIBRARIES`), and a folder may import those of the folders it
    may import (importing reports/ loads matplotlib anyway), no other folder may.
    `memory/` and `policies/` import the standard library and the folders the table
    allows, nothing else (DESIGN.md: "never import torch, triton or simpy"; STYLE.md rule
    1: pure Python), and the core the standard library and numpy. The other dependencies
    of pyproject.toml (pyarrow, scipy, tqdm, ray, safetensors) are not in the table: only
    those two rules constrain them.
(b) No import cycle between modules at module level. Imports inside functions (they run
    when the function is called, after every module has loaded) and under
    `TYPE_CHECKING` (never at run time) are ignored. An import counts as an edge to the
    module it names (`from pkg import name` to `pkg.name` when that is a module, else to
    `pkg`); the parent packages Python initialises on the way are not edges, as a
    package's `__init__` importing its own modules is how a package is built.

Where the code breaks the table today, the exception is listed in `KNOWN_EXCEPTIONS` by
importing module and imported folder, with why; a new import that breaks the table fails,
and so does an exception the code no longer needs (so the list only shrinks).
"""
from __future__ import annotations

import ast
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN = Path(os.environ.get("SERVELAB_SHARED", REPO.parent / "shared")) / "DESIGN.md"
FOLDERS = ("servelab", "memory", "policies", "simulator", "backends", "traces", "reports",
           "validation", "sweeps")
"""Repository folder = the subpackage `servelab.<folder>` (the core: `servelab`)."""

MAY_IMPORT: dict[str, set[str]] = {
    "servelab": set(),
    "memory": {"servelab"},
    "policies": {"servelab", "memory"},
    "simulator": {"servelab", "memory", "policies"},
    "backends": {"servelab", "memory", "policies"},
    "traces": {"servelab"},
    "reports": {"servelab"},
    "validation": {"servelab", "simulator", "reports"},
    "sweeps": {"servelab", "simulator", "reports"},
}
"""Folder -> the other servelab folders it may import (DESIGN.md's table)."""
LIBRARIES: dict[str, set[str]] = {
    "servelab": {"numpy"},
    "simulator": {"simpy"},
    "backends": {"torch", "triton", "transformers"},
    "reports": {"matplotlib"},
}
"""Folder -> the third-party libraries the table gives it."""
TABLE_LIBRARIES = set().union(*LIBRARIES.values())


def libraries_of(folder: str) -> set[str]:
    """The table's libraries a folder may import: its own and those of the folders it may
    import."""
    return set().union(*(LIBRARIES.get(f, set()) for f in {folder, *MAY_IMPORT[folder]}))

KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    # issue #32: a table omission to settle there. The progress bars (STYLE.md: a
    # well-kept library rather than a hand-written one) are tqdm's, loaded only when a bar
    # is shown; the table lists numpy only for the core.
    ("servelab.progress", "tqdm"): "progress bars",
    # issue #32: the simulator replays traces (`TraceRequests` makes each request as it
    # is released) and its command line loads them and writes the reports; the table
    # lists neither traces/ nor reports/ for simulator/. Either the table gains them or
    # `TraceRequests` moves to the core.
    ("servelab.simulator.engine", "traces"): "TraceRequests",
    ("servelab.simulator.disaggregated_cluster", "traces"): "TraceRequests",
    ("servelab.simulator.run", "traces"): "loads the configured trace",
    ("servelab.simulator.cli", "traces"): "the --trace options",
    ("servelab.simulator.cli", "reports"): "the run's health and SLO lines",
    ("servelab.simulator.run", "reports"): "writes the run directory",
    ("servelab.simulator.disaggregated_run", "reports"): "writes the run directory",
    # issue #32: the real backend writes its run directory with reports/ and loads traces;
    # its kernel compile check reads the GPU catalog of simulator/. Not in the table.
    ("servelab.backends.run", "reports"): "writes the run directory",
    ("servelab.backends.cli", "traces"): "the --trace options",
    ("servelab.backends.cli", "reports"): "a run that finished nothing: simulate's rejection line",
    ("servelab.backends.kernels.cuda_compile", "simulator"): "the GPU catalog (SM versions)",
    # issue #32: the real backend's disaggregated prefill/decode prices its KV handoff
    # with the simulator's model of it (simulator/kv_handoff.py); not in the table.
    ("servelab.backends.disaggregated", "simulator"): "the KV handoff's link model",
    # issue #32: validation replays a real run's trace and probes the GPU it runs on.
    ("servelab.validation.real_runs", "traces"): "the real runs' traces",
    ("servelab.validation.replay", "traces"): "writes the replayed trace",
    ("servelab.validation.probe", "torch"): "probes the local GPU (only when asked)",
}
"""(importing module, imported folder or library) -> what the import is for. Each entry
is a known break of the table, with the comment above it saying why it stands."""


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["servelab", *parts[1:]] if parts[0] == "servelab" else ["servelab", *parts])


def folder_of(module: str) -> str | None:
    """The repository folder of a servelab module (None outside servelab)."""
    parts = module.split(".")
    if parts[0] != "servelab":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS[1:] else "servelab"


def source_modules() -> dict[str, Path]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out[module_name(path)] = path
    return out


MODULES = source_modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, where: 'module' | 'function' | 'type', line) for each import
    statement of `module`; `from pkg import name` names `pkg.name` when that is a module
    of the package, else `pkg`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                here = "function" if where == "module" else where
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    visit_one(sub, "type")
                for sub in child.orelse:
                    visit_one(sub, where)
                continue
            visit_one(child, here)

    def visit_one(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.Import):
            out.extend((alias.name, where, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            named = {f"{target}.{alias.name}" for alias in node.names}
            for name in sorted({sub if sub in MODULES else target for sub in named}):
                out.append((name, where, node.lineno))
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            visit(node, where)

    visit(ast.parse(path.read_text(encoding="utf-8")), "module")
    return out


def test_the_table_here_is_design_mds():
    """MAY_IMPORT and LIBRARIES say what DESIGN.md's table says, row by row."""
    if not DESIGN.is_file():
        raise FileNotFoundError(f"DESIGN.md not found at {DESIGN}; set SERVELAB_SHARED")
    rows = re.findall(r"^\| `(\w+)/` \| `[\w.]+` \| .* \| ([\w ,]+) \|$",
                      DESIGN.read_text(encoding="utf-8"), re.M)
    table = {folder: {w.strip() for w in may.split(",")} for folder, may in rows}
    assert set(table) == set(FOLDERS), table
    for folder, may in table.items():
        named = {"servelab" if w in ("core", "core only") else w for w in may} - {"stdlib"}
        assert named & set(FOLDERS) == MAY_IMPORT[folder], folder
        assert named - set(FOLDERS) == LIBRARIES.get(folder, set()), folder


def test_the_modules_are_found_and_read():
    """The walk sees the package (a wrong root would check nothing) and its imports."""
    assert len(MODULES) > 100 and "servelab.policies.scheduler" in MODULES
    found = {(m, w) for m, w, _ in imports("servelab.policies")}
    assert ("servelab.policies.base", "module") in found and ("servelab.memory", "function") in found
    assert ("servelab.config", "type") in {(m, w) for m, w, _ in imports("servelab.memory.registry")}


def _breaks() -> dict[tuple[str, str], list[str]]:
    """(module, imported folder or library) -> 'line: import' for every import that the
    rules of (a) do not allow."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module in MODULES:
        folder = folder_of(module)
        for target, where, line in imports(module):
            if where == "type":
                continue
            top = target.split(".")[0]
            other = folder_of(target)
            if other is not None:
                ok = other == folder or other in MAY_IMPORT[folder]
                key = other
            elif top in stdlib:
                ok, key = True, top
            elif folder in ("memory", "policies"):   # the standard library only
                ok, key = False, top
            elif top in TABLE_LIBRARIES:
                ok, key = top in libraries_of(folder), top
            else:   # a library the table does not name
                ok, key = folder != "servelab", top
            if not ok:
                out[(module, key)].append(f"{line}: {target} ({where} level)")
    return dict(out)


def test_every_import_follows_the_design_table():
    breaks = _breaks()
    new = {k: v for k, v in breaks.items() if k not in KNOWN_EXCEPTIONS}
    assert not new, "imports DESIGN.md's table does not allow:\n" + "\n".join(
        f"  {module} -> {what}: {', '.join(lines)}" for (module, what), lines in sorted(new.items()))
    stale = sorted(set(KNOWN_EXCEPTIONS) - set(breaks))
    assert not stale, f"known exceptions the code no longer needs (remove them): {stale}"


@pytest.mark.parametrize("folder", ["memory", "policies"])
def test_the_shared_components_import_no_third_party_library(folder):
    """The rule DESIGN.md states in words, on its own: policies/ and memory/ run under both
    executors, so they never import torch, triton, simpy (or anything not in the standard
    library), not even inside a function."""
    bad = [(module, target) for module in MODULES if folder_of(module) == folder
           for target, where, _ in imports(module)
           if where != "type" and folder_of(target) is None
           and target.split(".")[0] not in sys.stdlib_module_names | {"__future__"}]
    assert bad == []


def test_the_core_imports_nothing_from_memory_or_policies():
    """Issue #32's rule: the core (servelab/) imports nothing from memory/ or policies/, not
    even inside a function. `servelab.request` did (block keys), and the command-line
    options did (registries: now passed in by `servelab.policies.cli_options`)."""
    found = {(module, folder_of(target)) for module in MODULES if folder_of(module) == "servelab"
             for target, where, _ in imports(module)
             if where != "type" and folder_of(target) in ("memory", "policies")}
    assert found == set()


def test_the_checker_catches_a_forbidden_import(tmp_path, monkeypatch):
    """The rules fire: a core module importing policies/ at module level, and a memory
    module importing numpy inside a function, are both reported."""
    core, mem = tmp_path / "servelab" / "x_probe.py", tmp_path / "memory" / "x_probe.py"
    core.parent.mkdir()
    mem.parent.mkdir()
    core.write_text("from servelab.policies import Policy\n")
    mem.write_text("def f():\n    import numpy\n")
    monkeypatch.setitem(MODULES, "servelab.x_probe", core)
    monkeypatch.setitem(MODULES, "servelab.memory.x_probe", mem)
    breaks = _breaks()
    assert breaks[("servelab.x_probe", "policies")] == ["1: servelab.policies (module level)"]
    assert breaks[("servelab.memory.x_probe", "numpy")] == ["2: numpy (function level)"]


def test_relative_and_type_only_imports_are_read_as_python_reads_them(tmp_path, monkeypatch):
    mod = tmp_path / "memory" / "x_probe.py"
    mod.parent.mkdir()
    mod.write_text("from typing import TYPE_CHECKING\n"
                   "from . import paged, base\n"            # two modules of the package
                   "from .registry import make_block_manager\n"
                   "from . import no_such_module\n"          # a name of the package
                   "if TYPE_CHECKING:\n    from servelab.config import CacheConfig\n"
                   "class C:\n    def f(self):\n        import servelab.policies\n")
    monkeypatch.setitem(MODULES, "servelab.memory.x_probe", mod)
    assert imports("servelab.memory.x_probe") == [
        ("typing", "module", 1), ("servelab.memory.base", "module", 2),
        ("servelab.memory.paged", "module", 2), ("servelab.memory.registry", "module", 3),
        ("servelab.memory", "module", 4), ("servelab.config", "type", 6),
        ("servelab.policies", "function", 9)]


def module_graph() -> dict[str, set[str]]:
    """Module -> the servelab modules it imports at module level (see (b))."""
    return {module: {target for target, where, _ in imports(module)
                     if where == "module" and target in MODULES and target != module}
            for module in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted; a module importing itself is not counted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_at_module_level():
    found = cycles(module_graph())
    assert found == [], "modules that import each other at module level:\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found)
