"""Extension points: one registry each, names unique, unknown names clear errors."""
from __future__ import annotations

import sys

import pytest

from servelab.memory import PagedBlockManager, block_manager_names, register_block_manager
from servelab.policies import (FCFSPolicy, Policy, make_preemption, preemption_names,
                               register_policy, register_preemption)
from servelab.policies.preemption import Recompute
from servelab.registry import Registry


def test_a_name_is_taken_once_and_unknown_names_list_the_known():
    r = Registry("widget")
    r.add("a", int)
    r.add("a", int)                                   # the same entry again: harmless
    with pytest.raises(ValueError, match=r"widget name 'a' is already registered by "
                                         r"builtins.int; builtins.float cannot take it"):
        r.add("a", float)
    with pytest.raises(ValueError, match=r"unknown widget 'b'; known: a"):
        r.get("b")
    with pytest.raises(ValueError, match="non-empty string"):
        r.add("", str)
    assert r.names() == ["a"] and r.get("a") is int


def test_each_extension_point_rejects_a_second_entry_under_a_taken_name():
    with pytest.raises(ValueError, match="block manager name 'paged' is already registered"):
        register_block_manager("paged", lambda cache, max_model_len: PagedBlockManager(16, 8))
    with pytest.raises(ValueError, match="preemption name 'swap' is already registered"):
        register_preemption("swap")(Recompute)
    with pytest.raises(ValueError, match="policy name 'fcfs' is already registered"):
        register_policy("fcfs")(type("Other", (FCFSPolicy,), {}))
    assert {"paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"} <= set(block_manager_names())
    assert preemption_names() == ["recompute", "swap"]
    assert make_preemption("swap").name == "swap"


def test_a_policy_that_accounts_service_must_declare_it():
    with pytest.raises(TypeError, match="does not declare charges_service = True"):
        type("Sneaky", (Policy,), {"waiting_key": lambda self, r: (r.request_id,),
                                   "on_service": lambda self, r, p, o: None})


def test_a_package_imports_every_public_module_so_a_new_file_registers_itself(tmp_path, monkeypatch):
    pkg = tmp_path / "plugins_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from servelab.registry import Registry, import_submodules\n"
        "WIDGETS = Registry('widget')\n"
        "import_submodules(__name__, __path__)\n")
    (pkg / "round.py").write_text("from plugins_demo import WIDGETS\nWIDGETS.add('round', 1)\n")
    (pkg / "square.py").write_text("from plugins_demo import WIDGETS\nWIDGETS.add('square', 2)\n")
    (pkg / "_private.py").write_text("raise AssertionError('a private module is not imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import plugins_demo
    try:
        assert plugins_demo.WIDGETS.names() == ["round", "square"]
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "plugins_demo"]:
            del sys.modules[name]
