"""Run-directory files: exact round trips (CSV and Parquet), deterministic bytes, atomic
writes, clear errors."""
from __future__ import annotations

import csv
import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.record_table import stored_fields
from servelab.records import RequestRecord, StepRecord
from servelab.reports.runio import (
    REQUEST_COLUMNS,
    REQUEST_EXTRA_COLUMNS,
    STEP_COLUMNS,
    read_json,
    read_requests,
    read_steps,
    write_json,
    write_records,
    write_requests,
    write_steps,
)

REQUESTS = [
    RequestRecord(0, 0.1 + 0.2, 10, 5, "finished", scheduled_s=0.3, first_token_s=1 / 3,
                  finish_s=1e3 + 1e-9, num_preemptions=2, tenant="team, \"quoted\"", priority=-1),
    RequestRecord(7, 1e-300, 2**40, 1, "finished", scheduled_s=1.0, first_token_s=1.5,
                  finish_s=1.5),
    RequestRecord(9, 2.0, 5000, 0, "rejected", finish_s=2.0,
                  reject_reason="prompt longer than\nthe whole KV cache"),
    RequestRecord(11, 3.0, 1, 0, "rejected"),  # every optional time is None
]
STEPS = [
    StepRecord(0.0, 0.012345678901234567, 512, 3, 2, 5, 1, 0, 40, 1000),
    StepRecord(0.1, 1.5, 0, 7, 0, 7, 0, 2, 60, 1000, num_preempted=1, num_steps=100,
               prefill_context_sum=1, prefill_q_context_sum=2, prefill_q_sq_sum=3,
               decode_context_sum=4, num_swap_blocks=5, num_copy_blocks=6),
]


FORMATS = ["csv", "parquet"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_requests_round_trip_with_none_cells(tmp_path, fmt):
    path = tmp_path / f"requests.{fmt}"
    write_requests(path, REQUESTS)
    assert list(read_requests(path)) == REQUESTS


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_cache_counts_round_trip_as_ints_and_give_the_same_summary(tmp_path, fmt):
    from servelab.reports.columns import column
    from servelab.reports.metrics import summarize

    records = [RequestRecord(i, 1.0 * i, prompt, 3, "finished", scheduled_s=i + 1.0,
                             first_token_s=i + 2.0, finish_s=i + 3.0, cached_tokens=c,
                             cpu_cached_tokens=g)
               for i, (prompt, c, g) in enumerate([(8, 4, 2), (2**40, 2**40 - 16, 16), (5, 0, 0)])]
    records.append(RequestRecord(3, 3.0, 1, 0, "rejected"))
    path = tmp_path / f"requests.{fmt}"
    write_requests(path, records)
    table = read_requests(path)
    assert list(table) == records
    assert column(table, "cached_tokens") == [4, 2**40 - 16, 0, None]
    assert all(type(v) is int for v in column(table, "cpu_cached_tokens")[:3])
    mine, back = summarize(records, []), summarize(table, [])
    assert mine["prefix_cache_hit_rate"] == back["prefix_cache_hit_rate"] > 0


def test_csv_layout_header_none_cells_and_unquoted_text(tmp_path):
    path = tmp_path / "requests.csv"
    write_requests(path, [REQUESTS[1], REQUESTS[3]])   # no text cell needs quotes: none has them
    lines = path.read_text().split("\n")
    assert lines[0] == ",".join(REQUEST_COLUMNS)  # no SLO and n == 1: no extra columns
    assert lines[-1] == "" and "\r" not in path.read_text()
    # None is an empty cell: the last request has no times, ttft/tpot/e2el.
    assert lines[-2] == "11,3,1,0,,,,,,,0,default,0,rejected,"


def test_text_that_needs_quotes_is_quoted(tmp_path):
    path = tmp_path / "requests.csv"
    write_requests(path, REQUESTS)
    text = path.read_text()
    assert '"team, ""quoted"""' in text and '"prompt longer than\nthe whole KV cache"' in text
    with open(path, newline="", encoding="utf-8") as f:
        assert list(csv.reader(f))[1][11] == 'team, "quoted"'


@pytest.mark.parametrize("fmt", FORMATS)
def test_requests_extra_columns_round_trip(tmp_path, fmt):
    records = REQUESTS + [RequestRecord(12, 4.0, 3, 2, "finished", 4.0, 4.5, 5.0, n=3,
                                        slo_ttft_ms=250.0, slo_tpot_ms=None)]
    path = tmp_path / f"requests.{fmt}"
    write_requests(path, records)
    if fmt == "csv":
        assert path.read_text().split("\n")[0] == ",".join(REQUEST_COLUMNS + REQUEST_EXTRA_COLUMNS)
    assert list(read_requests(path)) == records


def test_carriage_returns_in_text_round_trip(tmp_path):
    records = [RequestRecord(0, 0.0, 1, 0, "rejected", tenant="a\rb", reject_reason="\r"),
               RequestRecord(1, 0.0, 1, 0, "rejected", reject_reason="\r\n,\"")]
    write_requests(tmp_path / "r.csv", records)
    assert list(read_requests(tmp_path / "r.csv")) == records


def test_token_times_are_not_stored(tmp_path):
    record = RequestRecord(0, 0.0, 1, 2, "finished", 0.0, 0.5, 1.0, token_times=[0.5, 1.0])
    write_requests(tmp_path / "r.csv", [record])
    (back,) = read_requests(tmp_path / "r.csv")
    assert back.token_times is None and back.finish_s == 1.0


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


_FLOATS = {name for name, kind in {**stored_fields(RequestRecord), **stored_fields(StepRecord)}.items()
           if kind.startswith("float")} | {"ttft_ms", "tpot_ms", "e2el_ms"}


def _assert_cells_are_the_records(path, records, names) -> None:
    """Every cell, read with the csv module (and float() for a float column), is the
    record's value bit for bit; a derived column's is what the record computes."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == tuple(names) and len(rows) == len(records) + 1
    for row, record in zip(rows[1:], records):
        for name, cell in zip(names, row):
            value = getattr(record, name)
            if value is None:
                assert cell == "", (name, cell)
            elif name in _FLOATS:
                assert _bits(float(cell)) == _bits(float(value)), (name, cell, value)
            else:
                assert cell == str(value), (name, cell, value)


def test_floats_are_written_as_shortest_text_that_reads_back_exactly(tmp_path):
    path = tmp_path / "requests.csv"
    write_requests(path, REQUESTS)
    _assert_cells_are_the_records(path, REQUESTS, REQUEST_COLUMNS)
    row = path.read_text().split("\n")[1]
    assert row.startswith("0,0.30000000000000004,10,5,0.3,0.3333333333333333,1000.000000001,")
    steps = tmp_path / "steps.csv"
    write_steps(steps, STEPS)
    _assert_cells_are_the_records(steps, STEPS, STEP_COLUMNS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_steps_round_trip(tmp_path, fmt):
    path = tmp_path / f"steps.{fmt}"
    write_steps(path, STEPS)
    if fmt == "csv":
        assert path.read_text().split("\n")[0] == ",".join(STEP_COLUMNS)
    assert list(read_steps(path)) == STEPS


@pytest.mark.parametrize("values", [
    [0, 1, 2, 32767], [0, 32768], [-1, 5], [3, 2**40, 7], [True, 1], [2**63, 1],
])
def test_int_columns_are_written_as_str(tmp_path, values):
    """An int cell is str(int); a bool is not an int cell, nor is an int beyond 64 bits."""
    records = [RequestRecord(i, 0.0, 1, 0, "rejected", priority=v) for i, v in enumerate(values)]
    path = tmp_path / "r.csv"
    if any(type(v) is bool or v >= 2**63 for v in values):
        with pytest.raises(ValueError, match="request 0: priority must"):
            write_requests(path, records)
        assert not path.exists()
        return
    write_requests(path, records)
    column = REQUEST_COLUMNS.index("priority")
    cells = [line.split(",")[column] for line in path.read_text().splitlines()[1:]]
    assert cells == [str(v) for v in values]
    assert [r.priority for r in read_requests(path)] == values


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_files_round_trip(tmp_path, fmt):
    write_requests(tmp_path / f"r.{fmt}", [])
    write_steps(tmp_path / f"s.{fmt}", [])
    assert list(read_requests(tmp_path / f"r.{fmt}")) == []
    assert list(read_steps(tmp_path / f"s.{fmt}")) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_writes_are_deterministic_and_leave_no_temporary_files(tmp_path, fmt):
    write_requests(tmp_path / f"a.{fmt}", REQUESTS)
    write_requests(tmp_path / f"b.{fmt}", list(REQUESTS))
    assert (tmp_path / f"a.{fmt}").read_bytes() == (tmp_path / f"b.{fmt}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"a.{fmt}", f"b.{fmt}"]


def test_a_run_directory_holds_one_format_and_is_read_as_such(tmp_path):
    write_records(tmp_path, REQUESTS, STEPS, "csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.csv", "steps.csv"]
    write_records(tmp_path, REQUESTS, STEPS, "parquet")   # the CSV files are replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.parquet", "steps.parquet"]
    assert list(read_requests(tmp_path)) == REQUESTS and list(read_steps(tmp_path)) == STEPS
    with pytest.raises(ValueError, match="output format must be one of csv, parquet"):
        write_records(tmp_path, REQUESTS, STEPS, "feather")
    (tmp_path / "steps.parquet").unlink()
    with pytest.raises(ValueError, match="expected one of steps.csv or steps.parquet, found neither"):
        read_steps(tmp_path)


_finite = st.floats(allow_nan=False, allow_infinity=False)
_optional = st.none() | _finite
_text = st.text(alphabet=st.characters(blacklist_categories=["Cs"]))


def _writable(record: RequestRecord) -> bool:
    """Whether the derived columns exist and are finite (huge finite times overflow in ms)."""
    try:
        derived = (record.ttft_ms, record.tpot_ms, record.e2el_ms)
    except TypeError:  # finished, first_token_s set, finish_s None: no tpot_ms
        return False
    return all(v is None or math.isfinite(v) for v in derived)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.builds(
    RequestRecord, request_id=st.integers(-2**63, 2**63 - 1), arrival_s=_finite,
    prompt_tokens=st.integers(0, 2**62), output_tokens=st.integers(0, 10**6),
    status=st.sampled_from(["finished", "rejected"]), scheduled_s=_optional,
    first_token_s=_optional, finish_s=_optional, num_preemptions=st.integers(0, 100),
    tenant=_text, priority=st.integers(-100, 100), reject_reason=_text, slo_ttft_ms=_optional,
    slo_tpot_ms=_optional, n=st.integers(1, 8), token_times=st.none()), max_size=5))
def test_requests_round_trip_property(tmp_path, records):
    path = tmp_path / "requests.csv"  # each example overwrites it
    if not all(map(_writable, records)):
        with pytest.raises(ValueError, match=r"^request -?[0-9]+: (ttft|tpot|e2el)_ms "):
            write_requests(path, records)
        return
    write_requests(path, records)
    assert list(read_requests(path)) == records
    _assert_cells_are_the_records(path, records, REQUEST_COLUMNS + REQUEST_EXTRA_COLUMNS
                                  if len(path.read_text().split("\n")[0].split(",")) > 15
                                  else REQUEST_COLUMNS)
    parquet = tmp_path / "requests.parquet"
    write_requests(parquet, records)
    assert list(read_requests(parquet)) == records


def test_json_keeps_order_indent_and_trailing_newline(tmp_path):
    obj = {"z": 1, "a": [1.5, 0.1 + 0.2], "m": {"b": None, "a": "x"}}
    path = tmp_path / "summary.json"
    write_json(path, obj)
    text = path.read_text()
    assert text == json.dumps(obj, indent=2) + "\n"
    assert list(read_json(path)) == ["z", "a", "m"]
    assert read_json(path) == obj


@pytest.mark.parametrize("bad, error", [({"x": math.nan}, ValueError),
                                        ({"x": np.int64(1)}, TypeError)])
def test_json_refuses_nan_and_numpy_and_keeps_the_old_file(tmp_path, bad, error):
    path = tmp_path / "summary.json"
    write_json(path, {"ok": 1})
    with pytest.raises(error):
        write_json(path, bad)
    assert read_json(path) == {"ok": 1}
    assert os.listdir(tmp_path) == ["summary.json"]


def test_csv_write_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "requests.csv"
    write_requests(path, REQUESTS)
    before = path.read_bytes()
    broken = RequestRecord(5, math.inf, 1, 1, "rejected")
    with pytest.raises(ValueError, match="request 5: arrival_s must be a finite number"):
        write_requests(path, REQUESTS + [broken])
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["requests.csv"]


def test_bad_step_value_is_named_on_write(tmp_path):
    with pytest.raises(ValueError, match="step record 1: num_steps must be an integer"):
        write_steps(tmp_path / "s.csv", [STEPS[0], StepRecord(0.0, 1.0, 0, 1, 0, 1, 0, 0, 1, 4,
                                                                  num_steps=2.0)])


def test_read_json_names_file_and_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "a": 1,\n  "b": \n}\n')
    with pytest.raises(ValueError, match=r"config\.json:4:1: invalid JSON"):
        read_json(path)


def _good_row() -> list[str]:
    return ["1", "0.5", "10", "2", "0.5", "0.75", "1.0", "250.0", "250.0", "500.0", "0",
            "a", "0", "finished", ""]


@pytest.mark.parametrize("column, cell, message", [
    ("request_id", "1.0", "column 'request_id': expected an integer, got '1.0'"),
    ("arrival_s", "soon", "column 'arrival_s': expected a number, got 'soon'"),
    ("arrival_s", "", "column 'arrival_s': expected a number, got ''"),
    ("finish_s", "nan", "column 'finish_s': expected a finite number, got 'nan'"),
    ("status", "running", "column 'status': expected one of finished, rejected, got 'running'"),
    ("ttft_ms", "999.0", "column 'ttft_ms' is 999.0 but the timestamps give 250.0"),
    ("tpot_ms", "", "column 'tpot_ms' is None but the timestamps give 250.0"),
])
def test_malformed_request_cell_names_file_line_and_column(tmp_path, column, cell, message):
    row = _good_row()
    path = tmp_path / "requests.csv"
    path.write_text(",".join(REQUEST_COLUMNS) + "\n" + ",".join(row) + "\n")
    assert len(read_requests(path)) == 1  # the good row is good
    row[REQUEST_COLUMNS.index(column)] = cell
    path.write_text(",".join(REQUEST_COLUMNS) + "\n" + ",".join(_good_row()) + "\n\n"
                    + ",".join(row) + "\n")
    with pytest.raises(ValueError) as info:
        read_requests(path)
    assert str(info.value) == f"{path}:4: {message}"


def test_wrong_cell_count_and_header_are_named(tmp_path):
    path = tmp_path / "requests.csv"
    path.write_text(",".join(REQUEST_COLUMNS) + "\n" + ",".join(_good_row()[:-1]) + "\n")
    with pytest.raises(ValueError, match=r"requests\.csv:2: expected 15 cells, got 14"):
        read_requests(path)
    path.write_text(",".join(reversed(REQUEST_COLUMNS)) + "\n")
    with pytest.raises(ValueError, match=r"requests\.csv:1: unexpected columns reject_reason,"):
        read_requests(path)
    path.write_text("")
    with pytest.raises(ValueError, match=r"requests\.csv: empty file"):
        read_requests(path)
    steps = tmp_path / "steps.csv"
    write_steps(steps, STEPS)
    with pytest.raises(ValueError, match=r"steps\.csv:1: unexpected columns start_s,"):
        read_requests(steps)


def test_malformed_step_cell(tmp_path):
    path = tmp_path / "steps.csv"
    write_steps(path, STEPS)
    text = path.read_text().replace(",1000,1,100,", ",1000,1,lots,")
    Path(path).write_text(text)
    with pytest.raises(ValueError,
                       match=r"steps\.csv:3: column 'num_steps': expected an integer, got 'lots'"):
        read_steps(path)


def test_a_bad_cell_after_a_multi_line_cell_is_named_by_its_own_line(tmp_path):
    records = REQUESTS + [RequestRecord(20, 5.0, 3, 2, "finished", 5.0, 5.5, 6.0)]
    path = tmp_path / "requests.csv"
    write_requests(path, records)
    # request 9's reason spans lines 4-5, so request 11 sits on line 6
    lines = path.read_text().split("\n")
    assert lines[5].startswith("11,")
    lines[5] = lines[5].replace(',"rejected",', ',"lost",')
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=r"requests\.csv:6: column 'status': .* got 'lost'"):
        read_requests(path)
    with pytest.raises(ValueError, match="request 20: arrival_s must be a finite number"):
        write_requests(path, records[:-1] + [RequestRecord(20, math.nan, 3, 2, "rejected")])


def test_a_damaged_parquet_file_and_wrong_columns_are_named(tmp_path):
    path = tmp_path / "steps.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"steps\.parquet: not a readable Parquet file"):
        read_steps(path)
    write_steps(path, STEPS)
    with pytest.raises(ValueError, match=r"steps\.parquet: unexpected columns start_s,"):
        read_requests(path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for column, values in (("duration_s", [math.inf, 1.0]), ("num_steps", [None, 1])):
        bad = table.set_column(table.column_names.index(column), column, pa.array(values))
        pq.write_table(bad, path)
        with pytest.raises(ValueError, match=rf"steps\.parquet: column '{column}' holds a value out of place"):
            read_steps(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_table_is_written_a_batch_of_rows_at_a_time(tmp_path, monkeypatch, fmt):
    from servelab.reports import runio

    records = REQUESTS * 3
    steps = STEPS * 5
    write_requests(tmp_path / f"whole.{fmt}", records)
    monkeypatch.setattr(runio, "_BATCH_ROWS", 2)
    write_requests(tmp_path / f"batched.{fmt}", records)
    write_steps(tmp_path / f"steps.{fmt}", steps)
    assert list(read_requests(tmp_path / f"batched.{fmt}")) == records
    assert list(read_steps(tmp_path / f"steps.{fmt}")) == steps
    if fmt == "csv":   # the same bytes, however the rows were batched
        assert (tmp_path / "batched.csv").read_bytes() == (tmp_path / "whole.csv").read_bytes()
