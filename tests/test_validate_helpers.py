"""`servelab._validate.check_bounded` and the parsers rebuilt on the one number parser
(issue #32): each accepts its range's edges and refuses just past them, with one line."""
from __future__ import annotations

import math

import pytest

from servelab._validate import check_bounded
from servelab.traces.distributions import ArrivalProcess
from servelab.traces.record import TraceError
from servelab.traces.transforms import _count, _positive
from servelab.validation.calibrate_cli import _holdout
from servelab.validation.cli import _fraction
from servelab.vllm_args import _fraction as vllm_fraction, _int as vllm_int


@pytest.mark.parametrize("value, kwargs", [
    (1e-9, {"lo": 0, "lo_open": True}), (0, {"lo": 0}), (1, {"lo": 0, "hi": 1}),
    (3, {"lo": 0, "integer": True}), (0.5, {}),
])
def test_check_bounded_accepts_the_range(value, kwargs):
    check_bounded("x", value, **kwargs)


@pytest.mark.parametrize("value, kwargs, message", [
    (0, {"lo": 0, "lo_open": True}, "x must be a finite number > 0, got 0"),
    (-1e-9, {"lo": 0}, "x must be a finite number >= 0, got -1e-09"),
    (1.5, {"lo": 0, "hi": 1, "hi_open": True}, "x must be a finite number in [0, 1), got 1.5"),
    (math.inf, {}, "x must be a finite number, got inf"),
    (math.nan, {"lo": 0}, "x must be a finite number >= 0, got nan"),
    (True, {"lo": 0}, "x must be a finite number >= 0, got True"),
    (2.0, {"lo": 0, "integer": True}, "x must be an int >= 0, got 2.0"),
    (-1, {"lo": 0, "integer": True}, "x must be an int >= 0, got -1"),
])
def test_check_bounded_refuses_with_one_line(value, kwargs, message):
    with pytest.raises(ValueError) as e:
        check_bounded("x", value, **kwargs)
    assert str(e.value) == message


def test_check_bounded_raises_the_callers_error():
    with pytest.raises(TraceError, match="factor must be a finite number > 0, got 0"):
        _positive("factor", 0)
    with pytest.raises(TraceError, match="n must be an int >= 0, got -1"):
        _count("n", -1)
    assert _count("n", 0) == 0 and _positive("factor", 2.5) == 2.5
    with pytest.raises(TraceError, match=r"ArrivalProcess\.rate must be a finite number > 0, got 0"):
        ArrivalProcess(rate=0)
    with pytest.raises(TraceError, match=r"ArrivalProcess\.cv must be a finite number >= 0, got -0\.1"):
        ArrivalProcess(rate=1, cv=-0.1)
    ArrivalProcess(rate=1, cv=0)


@pytest.mark.parametrize("parse, good, bad, message", [
    (_fraction, ["1e-9", "0.999"], ["0", "1"], "expected a number in (0, 1), got '{}'"),
    (_holdout, ["0", "0.999"], ["-0.01", "1"], "expected a number in [0, 1), got '{}'"),
])
def test_cli_share_parsers_keep_their_range(parse, good, bad, message):
    import argparse
    for text in good:
        assert parse(text) == float(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError) as e:
            parse(text)
        assert str(e.value) == message.format(text)


def test_vllm_args_parsers_prefix_the_flag():
    assert vllm_int("--max-model-len", "2", low=2) == 2 and vllm_fraction("--g", "1") == 1.0
    with pytest.raises(ValueError, match=r"^--vllm-args --max-model-len: expected an integer >= 2, got 1$"):
        vllm_int("--max-model-len", "1", low=2)
    with pytest.raises(ValueError, match=r"^--vllm-args --tp: expected an integer, got 'x'$"):
        vllm_int("--tp", "x")
    with pytest.raises(ValueError, match=r"^--vllm-args --g: expected a fraction in \(0, 1\], got '0'$"):
        vllm_fraction("--g", "0")
    with pytest.raises(ValueError, match=r"^--vllm-args --g: expected a finite number, got 'nan'$"):
        vllm_fraction("--g", "nan")


def test_check_bounded_words_the_noun_a_module_uses():
    from servelab.simulator.footprint import _check_degree
    from servelab.simulator.router import make_router, router_names
    with pytest.raises(ValueError, match=r"^tp must be an integer >= 1, got 0$"):
        _check_degree("tp", 0)
    with pytest.raises(ValueError, match=r"^num_replicas must be an integer >= 1, got True$"):
        make_router(router_names()[0], True)
    _check_degree("tp", 1)


def test_check_float_note_follows_the_range():
    from servelab._validate import check_float
    check_float("P", "x", math.inf, 0, lo_open=True, note="inf: no limit")    # inf passes
    with pytest.raises(ValueError, match=r"^P\.x must be > 0 \(inf: no limit\), got 0$"):
        check_float("P", "x", 0, 0, lo_open=True, note="inf: no limit")
    with pytest.raises(ValueError, match=r"^P\.x must be >= 1 \(1: none\), got 0\.5$"):
        check_float("P", "x", 0.5, 1, note="1: none")
    with pytest.raises(ValueError, match=r"^P\.x must be a number, got nan$"):      # no note
        check_float("P", "x", math.nan, 1, note="1: none")
    with pytest.raises(ValueError, match=r"^P\.x must be in \[0, 1\], got 2$"):       # none given
        check_float("P", "x", 2, 0, 1)


@pytest.mark.parametrize("field, value, message", [
    ("split_k_min", 0, r"^GemmParams\.split_k_min must be > 0 \(inf: no limit\), got 0$"),
    ("overlap", 0.5, r"^GemmParams\.overlap must be >= 1 \(1: no overlap, inf: full\), got 0\.5$"),
    ("overlap", True, r"^GemmParams\.overlap must be a number, got True$"),
    ("floor_s", "x", r"^GemmParams\.floor_s must be a number, got 'x'$"),
])
def test_kernel_params_keep_their_hints(field, value, message):
    from servelab.simulator.kernels import GemmParams
    if field != "floor_s":
        GemmParams(**{field: math.inf})                 # inf: no limit / full overlap
    with pytest.raises(ValueError, match=message):
        GemmParams(**{field: value})


def _config_checks():
    """Config checks moved onto `check_bounded` (issue #32): each case builds one bad value."""
    from pathlib import Path

    from servelab.simulator.cost_model import CostModel
    from servelab.simulator.links import LinkSpec
    from servelab.simulator.pricing import _check
    from servelab.simulator.run import SimulationConfig
    from servelab.sweeps.runner import SweepRunner
    from servelab.traces.transforms import Assignment
    from servelab.validation.validate import ValidateOptions
    return [
        (lambda: LinkSpec("x", 0, 1), ValueError, "link x: bandwidth_gbps must be a finite number > 0, got 0"),
        (lambda: LinkSpec("x", None, math.inf), ValueError,
         "link x: latency_us must be a finite number >= 0, got inf"),
        (lambda: Assignment(priority=1.5), TraceError, "Assignment.priority must be an int, got 1.5"),
        (lambda: SweepRunner(Path("unused"), workers=0), ValueError, "workers must be an integer >= 1, got 0"),
        (lambda: ValidateOptions(split_seed=-1), ValueError, "split_seed must be an integer >= 0, got -1"),
        (lambda: _check("gemm", {"m": True, "n": 1, "k": 1}), ValueError, "--m must be an integer >= 1, got True"),
        (lambda: SimulationConfig(kv_offload_gb=-1), ValueError,
         "SimulationConfig.kv_offload_gb must be a finite number >= 0, got -1"),
        (lambda: SimulationConfig(rate=0), ValueError, "SimulationConfig.rate must be a finite number > 0, got 0"),
        (lambda: CostModel("tiny-llama", "cpu", block_size=2.5), ValueError,
         "block_size must be an integer >= 1, got 2.5"),
        (lambda: CostModel("tiny-llama", "cpu", step_overhead_s=math.nan), ValueError,
         "step_overhead_s must be a finite number >= 0, got nan"),
    ]


def test_config_checks_refuse_with_one_line():
    for build, error, message in _config_checks():
        with pytest.raises(error) as e:
            build()
        assert type(e.value) is error and str(e.value) == message
