"""Records held as columns: a table reads back the records it was built from, a log that
converts in chunks equals one built at once, bad values are named."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.record_table import RecordLog, RecordTable
from servelab.records import RequestRecord, StepRecord

REQUESTS = [
    RequestRecord(3, 0.5, 10, 4, "finished", 0.5, 0.75, 1.0, tenant="a", slo_ttft_ms=200.0),
    RequestRecord(1, 0.25, 7, 0, "rejected", finish_s=0.25, reject_reason="too long"),
    RequestRecord(2, 0.25, 9, 2, "finished", 0.3, 0.4, 0.9, n=2, priority=-3),
]


def test_a_table_is_a_sequence_of_the_records_it_holds():
    table = RecordTable.from_records(RequestRecord, REQUESTS)
    assert len(table) == 3 and list(table) == REQUESTS
    assert table[0] == REQUESTS[0] and table[-1] == REQUESTS[-1]
    assert list(table[1:]) == REQUESTS[1:]
    with pytest.raises(IndexError):
        table[3]
    assert table.column("arrival_s").tolist() == [0.5, 0.25, 0.25]
    assert np.isnan(table.column("slo_ttft_ms")[1:]).all()     # None is NaN in a column
    with pytest.raises(ValueError):
        table.column("arrival_s")[0] = 1.0                    # columns are read-only views


def test_sorted_by_is_a_stable_sort():
    table = RecordTable.from_records(RequestRecord, REQUESTS)
    assert [r.request_id for r in table.sorted_by("request_id")] == [1, 2, 3]
    assert [r.request_id for r in table.sorted_by("arrival_s")] == [1, 2, 3]  # ties keep order
    ordered = table.sorted_by("request_id")
    assert ordered.sorted_by("request_id") is ordered


def test_concat_keeps_the_order_of_the_parts():
    a = RecordTable.from_records(RequestRecord, REQUESTS[:1])
    b = RecordTable.from_records(RequestRecord, REQUESTS[1:])
    assert list(RecordTable.concat(RequestRecord, [a, b])) == REQUESTS
    assert list(a) == REQUESTS[:1]                            # the parts are left intact
    assert list(RecordTable.concat(RequestRecord, [])) == []


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 40), chunk=st.integers(1, 7))
def test_a_log_converted_in_chunks_equals_the_records(n, chunk):
    steps = [StepRecord(i * 0.5, 0.25, i, 1, 0, 2, 3, 0, i % 5, 9, num_steps=1 + i % 3,
                        decode_context_sum=i * i) for i in range(n)]
    log = RecordLog(StepRecord, chunk_rows=chunk)
    for s in steps[: n // 2]:
        log.append(s)
    log.extend(steps[n // 2:])
    assert len(log) == n
    first = log.table()
    assert list(first) == steps
    log.extend(steps[:1])
    assert list(log.table()) == steps + steps[:1]             # appending after table() goes on
    assert list(first) == steps                               # and leaves the first table alone


@pytest.mark.parametrize("record, message", [
    (RequestRecord(5, math.inf, 1, 1, "rejected"), "request 5: arrival_s must be a finite number, got inf"),
    (RequestRecord(5, 0.0, 1, 1, "rejected", scheduled_s=math.nan),
     "request 5: scheduled_s must be a finite number, got nan"),
    (RequestRecord(5, 0.0, True, 1, "rejected"), "request 5: prompt_tokens must be an integer, got True"),
    (RequestRecord(5, 0.0, 1.0, 1, "rejected"), "request 5: prompt_tokens must be an integer, got 1.0"),
    (RequestRecord(5, 0.0, 2**64, 1, "rejected"), "request 5: prompt_tokens must fit in 64 bits"),
    (RequestRecord(5, 10**400, 1, 1, "rejected"), "request 5: arrival_s must be a finite number"),
    (RequestRecord(5, 0.0, 1, 1, 7), "request 5: status must be a string, got 7"),
])
def test_a_bad_value_is_named_by_record_and_field(record, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        RecordTable.from_records(RequestRecord, REQUESTS + [record])


def test_numpy_numbers_are_stored_as_the_numbers_they_are():
    record = RequestRecord(np.int64(4), np.float64(0.5), np.int32(3), 1, "finished", 0.5, 0.6, 0.7)
    (back,) = RecordTable.from_records(RequestRecord, [record])
    assert back == record and type(back.request_id) is int and type(back.arrival_s) is float


def test_fields_that_are_not_flat_are_not_held():
    record = RequestRecord(0, 0.0, 1, 2, "finished", 0.0, 0.5, 1.0, token_times=[0.5, 1.0])
    (back,) = RecordTable.from_records(RequestRecord, [record])
    assert back.token_times is None and "token_times" not in RecordTable.from_records(
        RequestRecord, [record]).columns


def test_int_columns_are_stored_narrow_and_handed_out_as_int64():
    steps = [StepRecord(0.0, 1.0, 30_000, 1, 0, 2, 3, 0, 1, 9, decode_context_sum=2**40)] * 2
    table = RecordTable.from_records(StepRecord, steps)
    assert table._columns["num_prefill_tokens"].dtype == np.int16      # 2 bytes a row, not 8
    assert table._columns["decode_context_sum"].dtype == np.int64
    prefill = table.column("num_prefill_tokens")
    assert prefill.dtype == np.int64 and int(prefill.sum()) == 60_000   # no int16 overflow
    assert table.column("num_prefill_tokens", slice(1, 2)).tolist() == [30_000]
    assert list(table) == steps
