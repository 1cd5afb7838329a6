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


def test_a_policy_with_its_own_victim_order_must_declare_it():
    """The scheduler reads the declaration, never which methods a policy overrides: a
    victim_key without victims_by_admission = False would be ignored when a running
    request must give up its memory, so the class is refused."""
    key = {"waiting_key": lambda self, r: (r.request_id,),
           "victim_key": lambda self, r, admit_seq: (r.prompt_len, r.request_id)}
    with pytest.raises(TypeError, match="does not declare victims_by_admission = False"):
        type("Sneaky", (Policy,), key)
    assert not type("Declared", (Policy,), {**key, "victims_by_admission": False}).victims_by_admission
    assert FCFSPolicy.victims_by_admission
    from servelab.policies import policy_classes
    own_order = sorted(name for name, cls in policy_classes().items() if not cls.victims_by_admission)
    assert own_order == ["edf", "fair", "lsf", "mlfq", "priority", "sjf"]


def test_routers_have_one_registry():
    from servelab.simulator.router import Router, make_router, register_router, router_names
    assert router_names() == ["round-robin", "least-outstanding", "prefix-affinity"]
    with pytest.raises(ValueError, match="router name 'round-robin' is already registered by "
                                         "servelab.simulator.router.RoundRobinRouter"):
        register_router("round-robin")(type("Other", (Router,), {"route": lambda self, r, o: 0}))
    with pytest.raises(ValueError, match="unknown router 'random'; known: round-robin, "
                                         "least-outstanding, prefix-affinity"):
        make_router("random", 2)
    assert make_router("prefix-affinity", 3).describe()["name"] == "prefix-affinity"


def test_trace_formats_have_one_registry_that_detection_reads(monkeypatch, tmp_path):
    from servelab.traces.formats import (TRACE_FORMATS, TraceFormat, detect, register_trace_format,
                                         trace_format_names)
    from servelab.traces.loaders import load_trace
    from servelab.traces.record import TraceError
    assert trace_format_names() == ["azure", "splitwise", "mooncake", "lengths", "burstgpt", "servelab"]
    with pytest.raises(ValueError, match="trace format name 'azure' is already registered"):
        register_trace_format(TraceFormat("azure", {"prompt": "a", "output": "b"}))
    with pytest.raises(TraceError, match="unknown trace format 'csv'; expected auto or one of "
                                         "azure, splitwise, mooncake, lengths, burstgpt, servelab"):
        load_trace(tmp_path / "none.csv", format="csv")
    for bad, message in [({"name": "x", "columns": {"prompt": "a"}}, "needs a column for output"),
                         ({"name": "x", "columns": {"prompt": "a", "output": "b", "size": "c"}},
                          "unknown column role"),
                         ({"name": "x", "columns": {"prompt": "A", "output": "b"}}, "lower-case"),
                         ({"name": "x", "columns": {"prompt": "a", "output": "a"}}, "its own column"),
                         ({"name": "auto", "columns": {"prompt": "a", "output": "b"}}, "other than 'auto'"),
                         ({"name": "x", "columns": {"prompt": "a", "output": "b"}, "time_unit": "h"},
                          "time_unit must be one of"),
                         ({"name": "x", "columns": {"time": "t", "prompt": "a", "output": "b"},
                           "time_unit": "datetime", "json_lines": True}, "JSON-lines")]:
        with pytest.raises(ValueError, match=message):
            TraceFormat(**bad)
    # the most specific format wins: a length table's columns are also in Splitwise's header
    assert detect("arrived_at,num_prefill_tokens,num_decode_tokens").name == "splitwise"
    assert detect("num_prefill_tokens,num_decode_tokens,pd_ratio").name == "lengths"
    monkeypatch.setattr(TRACE_FORMATS, "_entries", dict(TRACE_FORMATS._entries))  # undone after
    register_trace_format(TraceFormat("timed-lengths", {"time": "t_us", "prompt": "num_prefill_tokens",
                                                        "output": "num_decode_tokens"}, time_unit="us"))
    assert detect("T_us, num_prefill_tokens, num_decode_tokens").name == "timed-lengths"
    path = tmp_path / "t.csv"
    path.write_text("t_us,num_prefill_tokens,num_decode_tokens\n5000000,10,2\n5500000,11,3\n")
    trace = load_trace(path)
    assert (trace.format, [r.arrival_s for r in trace.records]) == ("timed-lengths", [0.0, 0.5])
    path.write_text("t_us,num_prefill_tokens,num_decode_tokens\n5000000,10,2\n\"4000000\",11,3\n")
    with pytest.raises(TraceError, match=r"line 3: out-of-order timestamp: time 4000000.0 us"):
        load_trace(path)


def test_the_command_line_imports_the_users_own_modules_named_in_servelab_plugins(
        tmp_path, monkeypatch, capsys):
    """A router in a module of the user's, outside the package, named by $SERVELAB_PLUGINS:
    the command line offers it (it had no way to import such a module); a module that
    cannot be imported is one line."""
    from servelab.cli import main
    from servelab.simulator.router import ROUTERS

    # the registration is the process's: undone after the test (and the module forgotten)
    monkeypatch.setattr(ROUTERS, "_entries", dict(ROUTERS._entries))
    monkeypatch.delitem(sys.modules, "my_servelab_router", raising=False)
    (tmp_path / "my_servelab_router.py").write_text(
        "from servelab.simulator.router import Router, register_router\n\n"
        "@register_router('always-last')\n"
        "class AlwaysLast(Router):\n"
        "    def route(self, req, outstanding):\n"
        "        return self.num_replicas - 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SERVELAB_PLUGINS", "my_servelab_router")
    assert main(["simulate", "--num-requests", "20", "--replicas", "2", "--router", "always-last",
                 "--out", str(tmp_path / "run")]) == 0
    monkeypatch.setenv("SERVELAB_PLUGINS", "no_such_servelab_plugin")
    assert main(["simulate", "--out", str(tmp_path / "x")]) == 2
    sys.modules.pop("my_servelab_router", None)
    assert capsys.readouterr().err == ("servelab: error: $SERVELAB_PLUGINS names "
                                       "'no_such_servelab_plugin', which cannot be imported: "
                                       "No module named 'no_such_servelab_plugin'\n")
