"""The command line's one bounded number parser (`servelab.options.number`) and the flags
read through it: each bound is where it should be, on the right side of open or closed, and
a bad value is one line stating the accepted range."""
from __future__ import annotations

import argparse
import math
import pickle

import pytest

from servelab import options
from servelab._validate import bounds_text, check_float, check_int, within
from servelab.cli import main
from servelab.options import (fraction, non_negative_float, non_negative_int, number, positive_float,
                              positive_int)


def refusal(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        parse(text)
    message = str(exc.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("parse, text, value", [
    (positive_int, "1", 1), (positive_int, " 7 ", 7), (non_negative_int, "0", 0),
    (positive_float, "1e-9", 1e-9), (positive_float, "3", 3.0), (non_negative_float, "0", 0.0),
    (fraction, "1", 1.0), (fraction, "0.5", 0.5),
    (number(int, low=-2, high=2), "-2", -2), (number(int, low=-2, high=2), "2", 2),
    (number(float, low=0, high=1, high_open=True), "0", 0.0),
    (number(float), "-1e300", -1e300),
])
def test_values_inside_the_range_are_read_as_their_kind(parse, text, value):
    got = parse(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("parse, text, message", [
    (positive_int, "0", "expected an integer >= 1, got 0"),
    (positive_int, "-2", "expected an integer >= 1, got -2"),
    (non_negative_int, "-1", "expected an integer >= 0, got -1"),
    (positive_float, "0", "expected a finite number > 0, got '0'"),
    (positive_float, "-0.0", "expected a finite number > 0, got '-0.0'"),
    (positive_float, "inf", "expected a finite number > 0, got 'inf'"),
    (positive_float, "nan", "expected a finite number > 0, got 'nan'"),
    (non_negative_float, "-1e-300", "expected a finite number >= 0, got '-1e-300'"),
    (fraction, "0", "expected a number in (0, 1], got '0'"),
    (fraction, "1.0000001", "expected a number in (0, 1], got '1.0000001'"),
    (fraction, "inf", "expected a number in (0, 1], got 'inf'"),
    (number(float, low=0, high=1, high_open=True), "1", "expected a number in [0, 1), got '1'"),
    (number(int, low=-2, high=2), "3", "expected an integer in [-2, 2], got 3"),
    (number(int, high=8), "9", "expected an integer <= 8, got 9"),
    (number(float, high=0, high_open=True), "0", "expected a number < 0, got '0'"),
    (number(float), "-inf", "expected a finite number, got '-inf'"),
])
def test_values_outside_the_range_are_refused_stating_it(parse, text, message):
    assert refusal(parse, text) == message


@pytest.mark.parametrize("parse, text, message", [
    (positive_int, "1.5", "expected an integer, got '1.5'"),     # floats are not integers
    (positive_int, "1e3", "expected an integer, got '1e3'"),
    (non_negative_int, "", "expected an integer, got ''"),
    (positive_float, "lots", "expected a number, got 'lots'"),
    (fraction, "half", "expected a number, got 'half'"),
])
def test_text_that_is_not_the_kind_is_refused(parse, text, message):
    assert refusal(parse, text) == message


def test_number_reads_only_ints_and_floats():
    with pytest.raises(TypeError, match="int or float"):
        number(complex)


def test_the_range_check_and_its_wording_are_the_configs():
    """One range check: the configs' validators and the parser agree on every bound."""
    assert within(0, 0) and not within(0, 0, lo_open=True) and within(1, 0, 1)
    assert not within(1, 0, 1, hi_open=True) and not within(math.nan, 0) and within(math.nan)
    assert bounds_text(0, 1, lo_open=True) == "in (0, 1]" and bounds_text() == ""
    with pytest.raises(ValueError, match=r"^C\.x must be in \[1, 4\], got 5$"):
        check_int("C", "x", 5, 1, 4)
    with pytest.raises(ValueError, match=r"^C\.x must be <= 4, got 5$"):
        check_int("C", "x", 5, None, 4)
    with pytest.raises(ValueError, match=r"^C\.y must be > 0.0, got 0.0$"):
        check_float("C", "y", 0.0, 0.0, 1.0, lo_open=True)
    with pytest.raises(ValueError, match=r"^C\.y must be <= 1.0, got 2.0$"):
        check_float("C", "y", 2.0, 0.0, 1.0, lo_open=True)


def test_the_common_ranges_are_numbers_and_pickle():
    """The common ranges are `number`'s (a second implementation would drift), and they
    pickle as the functions they replaced did (a policy's flags carry them)."""
    for name in ("positive_int", "non_negative_int", "positive_float", "non_negative_float",
                 "fraction"):
        parse = getattr(options, name)
        assert isinstance(parse, options.Number), name
        assert pickle.loads(pickle.dumps(parse)) == parse
    assert positive_int.expected == "an integer >= 1" and fraction.expected == "a number in (0, 1]"


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--max-num-seqs", "0"], "argument --max-num-seqs: expected an integer >= 1, got 0"),
    (["simulate", "--tenant-burst", "0.5"],
     "argument --tenant-burst: expected a finite number >= 1, got '0.5'"),
    (["simulate", "--tenant-burst", "0"], "argument --tenant-burst: expected a finite number >= 1, got '0'"),
    (["simulate", "--watermark", "-0.1"], "argument --watermark: expected a finite number >= 0, got '-0.1'"),
    (["simulate", "--cpu-kv-blocks", "2.5"], "argument --cpu-kv-blocks: expected an integer, got '2.5'"),
    (["compare", "--tps", "1,0"], "argument --tps: expected an integer >= 1, got 0"),
    (["compare", "--workers", "0"], "argument --workers: expected an integer >= 1, got 0"),
    (["compare", "--block-managers", "paged,heap"], "argument --block-managers: expected one of paged"),
    (["compare", "--preemptions", "swap,pause"], "argument --preemptions: expected one of recompute, swap"),
    (["capacity", "--attainment", "1.5"], "argument --attainment: expected a number in (0, 1], got '1.5'"),
    (["capacity", "--attainment", "0"], "argument --attainment: expected a number in (0, 1], got '0'"),
    (["capacity", "--tolerance", "1"], "argument --tolerance: expected a number in (0, 1), got '1'"),
    (["capacity", "--p99-ttft-ms", "0"], "argument --p99-ttft-ms: expected a finite number > 0, got '0'"),
    (["plan", "--max-gpus", "0"], "argument --max-gpus: expected an integer >= 1, got 0"),
    (["plan", "--gpu-price", "h100-sxm=0"], "argument --gpu-price: expected a finite number > 0, got '0'"),
])
def test_flags_refuse_a_value_out_of_range_in_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_the_list_flags_offer_what_their_single_flag_offers():
    """--block-managers and --preemptions take their names from `simulate`'s --block-manager
    and --preemption (the registries, read by `servelab.policies.cli_options`)."""
    from servelab.memory import block_manager_names
    from servelab.policies import preemption_names
    from servelab.sweeps import cli as compare_cli

    sub = argparse.ArgumentParser().add_subparsers()
    compare_cli.register(sub)
    compare = sub.choices["compare"]
    args = compare.parse_args(["--out", "x", "--block-managers", ",".join(block_manager_names()),
                               "--preemptions", ",".join(preemption_names()), "--policies", "fcfs"])
    assert args.sweep_block_manager == tuple(block_manager_names())
    assert args.sweep_preemption == tuple(preemption_names())
    _, points = compare_cli.build_points(args, compare)
    assert {p.config.block_manager for p in points} == set(block_manager_names())
    assert {p.config.scheduler.preemption for p in points} == set(preemption_names())
