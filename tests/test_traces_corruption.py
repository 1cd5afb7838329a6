"""Property tests: corrupted trace files of every format.

Whatever is done to a valid file (cells deleted, garbage injected, timestamps swapped,
lines truncated, invalid bytes inserted), loading either succeeds or raises
TraceFormatError — never another exception — and in drop mode no row disappears
silently: kept + dropped == data rows (non-blank lines after the header).
"""
from __future__ import annotations

import datetime as dt
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.traces.loaders import FAILED_REASON, load_trace
from servelab.traces.record import TraceFormatError


def _azure(rows):
    base = dt.datetime(2023, 11, 16, 23, 59, 50)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, p, o in rows:
        ticks = int(t * 1e7)
        stamp = (base + dt.timedelta(microseconds=ticks // 10)).strftime("%Y-%m-%d %H:%M:%S.%f")
        lines.append(f"{stamp}{ticks % 10},{p},{o}")
    return "\r\n".join(lines)  # CRLF, no final newline, as the real file


def _splitwise(rows):
    return "arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(f"{t!r},{p},{o}\n" for t, p, o in rows)


def _lengths(rows):
    return "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n" + "".join(
        f"{p},{o},{p + o},{p / o!r}\n" for _, p, o in rows)


def _burstgpt(rows):
    head = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    return head + "".join(f"{t:g},{'GPT-4' if p % 2 else 'ChatGPT'},{p},{o if p % 5 else 0},{p + o},"
                          f"{'API log' if o % 2 else 'Conversation log'}\n" for t, p, o in rows)


def _mooncake(rows):
    return "".join(json.dumps({"timestamp": int(t * 1000), "input_length": p, "output_length": o,
                               "hash_ids": list(range(-(-p // 512)))}) + "\n" for t, p, o in rows)


def _servelab(rows):
    head = "arrival_s,prompt_tokens,output_tokens,tenant,priority,slo_ttft_ms,slo_tpot_ms,prefix_block_size,prefix_hashes\n"
    return head + "".join(f"{t!r},{p},{o},t{p % 3},{p % 2},{'' if o % 2 else 500.0},,16,{p} {o}\n"
                          for t, p, o in rows)


RENDER = {"azure": _azure, "splitwise": _splitwise, "lengths": _lengths, "burstgpt": _burstgpt,
          "mooncake": _mooncake, "servelab": _servelab}
REASONS = {"missing column", "extra column", "non-numeric value", "non-finite value", "non-integer value",
           "non-positive length", "implausible length", "invalid timestamp", "out-of-order timestamp",
           "invalid UTF-8", "malformed quoting", "invalid JSON", "invalid field", "invalid prefix hashes",
           "invalid model", "invalid tenant", "invalid SLO", "negative arrival", FAILED_REASON}
GARBAGE = st.one_of(
    st.sampled_from(["", " ", "abc", "nan", "NaN", "-inf", "Infinity", "1e999", "-5", "0", "0.0", "1.5", "-0",
                     "1_000", "0x1F", "١٢", "\"", '"a,b"', '""', "9" * 40, "{", "[]", "null", "\x00", "\t", "2023-13-01",
                     "2023-11-16 25:61:61", "1e5", "+7", " 12 ", "\u2028", "\r"]),
    st.text(max_size=12))


@st.composite
def _file(draw, fmt):
    n = draw(st.integers(1, 15))
    gaps = draw(st.lists(st.floats(0, 5, allow_nan=False), min_size=n, max_size=n))
    times, t = [], 0.0
    for g in gaps:
        t = round(t + g, 3)
        times.append(t)
    rows = [(t, draw(st.integers(1, 5000)), draw(st.integers(1, 900))) for t in times]
    data = RENDER[fmt](rows).encode()
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from([_delete_cell, _inject, _inject, _swap_times, _truncate, _bad_bytes, _dup_line]))
        data = op(draw, data)
    return data


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def _pick_line(draw, lines):
    return draw(st.integers(0, len(lines) - 1))


def _delete_cell(draw, data):
    lines = _lines(data)
    i = _pick_line(draw, lines)
    cells = lines[i].split(b",")
    del cells[draw(st.integers(0, len(cells) - 1))]
    lines[i] = b",".join(cells)
    return b"\n".join(lines)


def _inject(draw, data):
    lines = _lines(data)
    i = _pick_line(draw, lines)
    cells = lines[i].split(b",")
    cells[draw(st.integers(0, len(cells) - 1))] = draw(GARBAGE).encode()
    lines[i] = b",".join(cells)
    return b"\n".join(lines)


def _swap_times(draw, data):
    lines = _lines(data)
    i, j = _pick_line(draw, lines), _pick_line(draw, lines)
    a, b = lines[i].split(b",", 1), lines[j].split(b",", 1)
    a[0], b[0] = b[0], a[0]
    lines[i], lines[j] = b",".join(a), b",".join(b)
    return b"\n".join(lines)


def _truncate(draw, data):
    return data[:draw(st.integers(0, len(data)))]


def _bad_bytes(draw, data):
    k = draw(st.integers(0, len(data)))
    return data[:k] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xe2\x82", b"\x80\x80"])) + data[k:]


def _dup_line(draw, data):
    lines = _lines(data)
    i = _pick_line(draw, lines)
    lines.insert(draw(st.integers(0, len(lines))), lines[i])
    return b"\n".join(lines)


def _data_rows(data: bytes, has_header: bool) -> int:
    """Non-blank lines after the header, the same way the loader splits lines."""
    try:
        lines = data.decode("utf-8-sig").replace("\r\n", "\n").split("\n")
    except UnicodeDecodeError:
        body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
        lines = [raw.removesuffix(b"\r").decode("utf-8", errors="replace") for raw in body.split(b"\n")]
    nonblank = [line for line in lines if line.strip()]
    return len(nonblank) - (1 if has_header and nonblank else 0)


@pytest.mark.parametrize("fmt", sorted(RENDER))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_files_fail_only_with_trace_format_error_and_drop_nothing_silently(tmp_path_factory, fmt, data):
    raw = data.draw(_file(fmt))
    path = tmp_path_factory.mktemp("corrupt") / f"t.{fmt}"
    path.write_bytes(raw)
    rows = _data_rows(raw, has_header=fmt != "mooncake")
    options = {"rate": 2.0} if fmt == "lengths" else {}
    for mode in ("error", "drop"):
        try:
            trace = load_trace(path, format=fmt, on_bad_row=mode, **options)
        except TraceFormatError as exc:
            assert exc.path == str(path)
            assert exc.line is None or 1 <= exc.line <= raw.count(b"\n") + 1
            continue
        assert len(trace) + trace.num_dropped == rows == trace.source_rows
        assert {i.reason for i in trace.dropped} <= (REASONS if mode == "drop" else {FAILED_REASON})
        assert all(b.arrival_s >= a.arrival_s >= 0 for a, b in zip(trace.records, trace.records[1:]))


@pytest.mark.parametrize("fmt", sorted(RENDER))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_uncorrupted_files_load_completely_with_format_detection(tmp_path_factory, fmt, data):
    n = data.draw(st.integers(1, 10))
    rows = [(float(i), data.draw(st.integers(1, 4000)), data.draw(st.integers(1, 900))) for i in range(n)]
    raw = RENDER[fmt](rows).encode()
    path = tmp_path_factory.mktemp("clean") / "t"
    path.write_bytes(raw)
    trace = load_trace(path, **({"rate": 2.0} if fmt == "lengths" else {}))
    assert trace.format == fmt
    failed = sum(1 for _, p, _ in rows if p % 5 == 0) if fmt == "burstgpt" else 0
    assert len(trace) == n - failed and trace.num_dropped == failed
    kept = [(p, o) for _, p, o in rows if not (fmt == "burstgpt" and p % 5 == 0)]
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.records] == kept


def _outcome(path, fmt, mode):
    try:
        trace = load_trace(path, format=fmt, on_bad_row=mode, **({"rate": 2.0} if fmt == "lengths" else {}))
    except TraceFormatError as exc:
        return str(exc)
    return trace.records, trace.source_rows, trace.dropped, trace.notes


@pytest.mark.parametrize("fmt", sorted(RENDER))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_bulk_path_agrees_with_the_row_parser_on_corrupted_files(tmp_path_factory, monkeypatch, fmt, data):
    """pyarrow's readers (`traces._arrow`) take a file only when they read it exactly as the
    row parser does: same records, counts and notes, or the same error."""
    from servelab.traces import loaders

    raw = data.draw(_file(fmt))
    path = tmp_path_factory.mktemp("agree") / f"t.{fmt}"
    path.write_bytes(raw)
    for mode in ("error", "drop"):
        bulk = _outcome(path, fmt, mode)
        with monkeypatch.context() as m:
            m.setattr(loaders, "_bulk_columns", lambda *a, **k: None)
            rows = _outcome(path, fmt, mode)
        assert bulk == rows
