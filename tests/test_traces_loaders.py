"""Loaders against the real public traces (figures from ../shared/traces/README.md) and
against small hand-written files for every format, including the bad-row rules."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.simulator.run import SimulationConfig, load_workload
from servelab.traces import loaders
from servelab.traces.loaders import FAILED_REASON, detect_format, load_trace
from servelab.traces.record import TraceError, TraceFormatError
from servelab.traces.stats import prefix_hit_ratio, trace_stats

# file, rows, span_s, (prompt mean, p50, p90, p99, max), (output mean, p50, p90, p99, max), mean rate
REAL = {
    "AzureLLMInferenceTrace_code.csv": (8819, 3435.9, (2047.8, 1469, 5187.6, 7436, 7437), (27.9, 13, 55, 251.5, 1899), 2.57),
    "AzureLLMInferenceTrace_conv.csv": (19366, 3501.7, (1154.7, 1020, 2734.5, 4142, 14050), (211.1, 129, 424, 601, 1000), 5.53),
    "splitwise_code.csv": (8819, 3435.9, (2047.8, 1469, 5187.6, 7436, 7437), (27.9, 13, 55, 251.5, 1899), 2.57),
    "splitwise_conv.csv": (19366, 3501.7, (1154.7, 1020, 2734.5, 4142, 14050), (211.1, 129, 424, 601, 1000), 5.53),
    "mooncake_conversation_trace.jsonl": (12031, 3537.0, (12035.1, 6909, 27367, 85400.4, 126195), (342.6, 350, 597, 1118.5, 2000), 3.40),
}
LENGTHS = {
    "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv": (28257, (2588.1, 2730, 3702, 3933.4, 4054), (291.4, 167, 372, 3271.3, 4056)),
    "sharegpt_8k_filtered_stats_llama2_tokenizer.csv": (30731, (2340.0, 1730, 5696, 7433.7, 8141), (438.7, 415, 834, 998, 1024)),
    "bwb_stats_llama2_tokenizer_filtered_v2.csv": (33768, (1067.2, 1037, 1453, 1800, 3504), (1612.8, 1601, 2149, 2533, 2858)),
}


def _check_summary(s, expected):
    mean, p50, p90, p99, mx = expected
    assert s.mean == pytest.approx(mean, abs=0.05)
    assert (s.p50, s.p90, s.max) == pytest.approx((p50, p90, mx), abs=1e-6)
    assert s.p99 == pytest.approx(p99, abs=0.051)


@pytest.mark.parametrize("name", list(REAL))
def test_real_timed_traces_match_the_readme(traces_dir, name):
    rows, span, prompt, output, rate = REAL[name]
    trace = load_trace(traces_dir / name)
    st = trace_stats(trace)
    assert len(trace) == rows and trace.source_rows == rows and trace.num_dropped == 0
    assert trace.records[0].arrival_s == 0.0
    assert st.span_s == pytest.approx(span, abs=0.05)
    assert st.mean_rate == pytest.approx(rate, abs=0.005)
    _check_summary(st.prompt, prompt)
    _check_summary(st.output, output)


@pytest.mark.parametrize("name", list(LENGTHS))
def test_real_length_tables_match_the_readme_and_get_drawn_arrivals(traces_dir, name):
    rows, prompt, output = LENGTHS[name]
    trace = load_trace(traces_dir / name, rate=8.0, seed=1)
    assert trace.format == "lengths" and len(trace) == rows == trace.source_rows
    st = trace_stats(trace)
    _check_summary(st.prompt, prompt)
    _check_summary(st.output, output)
    assert st.mean_rate == pytest.approx(8.0, rel=0.03)
    assert st.interarrival_cv == pytest.approx(1.0, abs=0.03)
    again = load_trace(traces_dir / name, rate=8.0, seed=1)
    assert again.records == trace.records
    bursty = load_trace(traces_dir / name, rate=8.0, cv=3.0, seed=1)
    assert trace_stats(bursty).interarrival_cv == pytest.approx(3.0, rel=0.1)
    assert [r.prompt_tokens for r in bursty.records] == [r.prompt_tokens for r in trace.records]


def test_azure_times_equal_splitwise_relative_seconds(traces_dir):
    for kind in ("code", "conv"):
        azure = load_trace(traces_dir / f"AzureLLMInferenceTrace_{kind}.csv")
        split = load_trace(traces_dir / f"splitwise_{kind}.csv")
        assert azure.format == "azure" and split.format == "splitwise"
        a = np.array([r.arrival_s for r in azure.records])
        s = np.array([r.arrival_s for r in split.records])
        assert np.abs(a - s).max() <= 2.1e-7
        assert [(r.prompt_tokens, r.output_tokens) for r in azure.records] == \
               [(r.prompt_tokens, r.output_tokens) for r in split.records]
    assert any("time origin 2023-11-16 18:15:46.6805900" in n for n in azure.notes)


def test_mooncake_hashes_blocks_and_batched_timestamps(traces_dir):
    trace = load_trace(traces_dir / "mooncake_conversation_trace.jsonl")
    assert all(r.prefix_block_size == 512 and len(r.prefix_hashes) == math.ceil(r.prompt_tokens / 512)
               for r in trace.records)
    assert all(r.prefix_hashes[0] == 0 for r in trace.records)
    assert len({r.arrival_s for r in trace.records}) == 1180
    assert trace.records[-1].arrival_s == 3536.999
    assert prefix_hit_ratio(trace) == pytest.approx(0.374, abs=0.0005)


def test_fast_and_row_by_row_paths_agree_on_real_files(traces_dir, monkeypatch):
    names = ["AzureLLMInferenceTrace_code.csv", "splitwise_conv.csv", "bwb_stats_llama2_tokenizer_filtered_v2.csv",
             "mooncake_conversation_trace.jsonl"]
    bulk = loaders._bulk_columns
    taken = []
    monkeypatch.setattr(loaders, "_bulk_columns", lambda *a: taken.append(bulk(*a)) or taken[-1])
    fast = [load_trace(traces_dir / n, rate=3.0 if "bwb" in n else None) for n in names]
    assert len(taken) == len(names) and None not in taken   # every real file is clean
    monkeypatch.setattr(loaders, "_bulk_columns", lambda *a, **k: None)
    slow = [load_trace(traces_dir / n, rate=3.0 if "bwb" in n else None) for n in names]
    for f, s in zip(fast, slow):
        assert f.records == s.records and f.source_rows == s.source_rows and f.notes == s.notes


# ----------------------------------------------------------------------------- small files
def _write(tmp_path, text: str | bytes, name: str = "t.csv"):
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"


@pytest.mark.parametrize("pad", ["", " "])
def test_azure_keeps_100ns_precision_across_midnight(tmp_path, pad):
    # pad forces the row-by-row path (the bulk regex does not accept spaces)
    body = [f"2023-11-16 23:59:59.9999998,{pad}10,5", "2023-11-16 23:59:59.9999999,11,6",
            "2023-11-17 00:00:00.0000001,12,7", "2023-11-17 00:00:01,13,8"]
    trace = load_trace(_write(tmp_path, AZURE + "\r\n".join(body)))
    assert [r.arrival_s for r in trace.records] == [0.0, 1e-7, 3e-7, 1.0000002]
    assert trace.notes[-1] == "time origin 2023-11-16 23:59:59.9999998 (the first kept row)"


def test_detects_every_format_from_its_header(tmp_path):
    heads = {
        "azure": AZURE, "splitwise": "arrived_at,num_prefill_tokens,num_decode_tokens\n",
        "lengths": "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n",
        "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n",
        "servelab": "arrival_s,prompt_tokens,output_tokens,tenant\n",
        "mooncake": '{"timestamp": 0, "input_length": 3, "output_length": 1}\n',
    }
    for fmt, head in heads.items():
        assert detect_format(_write(tmp_path, head)) == fmt
    with pytest.raises(TraceFormatError, match=r"t.csv, line 1: cannot tell the trace format"):
        load_trace(_write(tmp_path, "a,b,c\n1,2,3\n"))
    with pytest.raises(TraceFormatError, match="holds no rows"):
        load_trace(_write(tmp_path, "\n \n"))
    with pytest.raises(TraceFormatError, match=r"line 1: the azure format needs column\(s\) generatedtokens"):
        load_trace(_write(tmp_path, "TIMESTAMP,ContextTokens\n2023-11-16 00:00:00,1\n"), format="azure")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(_write(tmp_path, AZURE), format="csv")


def test_blank_lines_are_not_rows_and_header_columns_may_move(tmp_path):
    text = "\n\nnum_decode_tokens,pd_ratio,num_prefill_tokens\n5,0.1,50\n\n  \n6,x,60\n"
    trace = load_trace(_write(tmp_path, text), rate=1.0)
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.records] == [(50, 5), (60, 6)]
    assert trace.source_rows == 2


def test_lengths_need_a_rate_and_cv_only_applies_to_them(tmp_path):
    lengths = _write(tmp_path, "num_prefill_tokens,num_decode_tokens\n5,6\n", "l.csv")
    with pytest.raises(TraceError, match="length-only table.*rate"):
        load_trace(lengths)
    with pytest.raises(TraceError, match="cv applies only"):
        load_trace(_write(tmp_path, AZURE + "2023-11-16 00:00:00,1,1"), cv=2.0)


def test_timed_trace_rate_option_rescales_and_max_model_len_clips(tmp_path):
    path = _write(tmp_path, "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,4\n1,3000,50\n2,20,5\n")
    trace = load_trace(path, rate=3.0, max_model_len=1024)
    assert [r.arrival_s for r in trace.records] == [0.0, 0.5, 1.0]
    assert trace.records[1].prompt_tokens == 1023 and trace.records[1].output_tokens == 1
    assert trace.num_clipped == 1                        # one request, clipped twice
    assert [i.count for i in trace.clipped] == [1, 1]    # prompt, output


def test_a_rate_applies_to_the_requests_kept_not_to_the_whole_file(tmp_path):
    # the first three requests arrive a second apart, the rest 0.01 s apart: the file's mean
    # rate is about 5 req/s, the first three's 1 req/s
    times = [0, 1, 2] + [2 + 0.01 * i for i in range(1, 30)]
    path = _write(tmp_path, "arrived_at,num_prefill_tokens,num_decode_tokens\n"
                  + "".join(f"{t},10,4\n" for t in times))
    trace = load_trace(path, rate=4.0, num_requests=3)
    assert [r.arrival_s for r in trace.records] == [0.0, 0.375, 0.75]   # 3 rows over 0.75 s
    assert trace.mean_rate == pytest.approx(4.0)
    config = SimulationConfig(trace=str(path), rate=4.0, num_requests=3)
    assert load_workload(config).mean_rate == pytest.approx(4.0)


BURST = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def test_burstgpt_drops_and_reports_failed_requests_and_uses_model_as_tenant(tmp_path):
    rows = ["5,ChatGPT,472,18,490,Conversation log", "45,GPT-4,1087,0,1087,Conversation log",
            "118,ChatGPT,417,276,693,API log", "130,ChatGPT,900,0,900,API log"]
    path = _write(tmp_path, BURST + "\n".join(rows) + "\n", "burst.csv")
    trace = load_trace(path)
    assert trace.format == "burstgpt" and trace.source_rows == 4
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.tenant) for r in trace.records] == \
           [(0.0, 472, 18, "ChatGPT"), (113.0, 417, 276, "ChatGPT")]
    assert [(i.reason, i.count) for i in trace.dropped] == [(FAILED_REASON, 2)]
    assert trace.dropped[0].example.startswith("line 3:")
    kept = load_trace(path, keep_failed=True)
    assert [r.output_tokens for r in kept.records] == [18, 1, 276, 1]
    assert kept.num_dropped == 0 and kept.num_clipped == 2
    with pytest.raises(TraceError, match="keep_failed applies only to BurstGPT"):
        load_trace(_write(tmp_path, AZURE + "2023-11-16 00:00:00,1,1"), keep_failed=True)


def test_servelab_format_reads_optional_columns_verbatim(tmp_path):
    text = ("arrival_s,prompt_tokens,output_tokens,tenant,priority,slo_ttft_ms,slo_tpot_ms,prefix_block_size,"
            "prefix_hashes\n2.5,40,3,bob,-1,200,,16,7 8 9\n3,5,5,,,,,,\n")
    a, b = load_trace(_write(tmp_path, text)).records
    assert (a.arrival_s, a.tenant, a.priority, a.slo_ttft_ms, a.slo_tpot_ms, a.prefix_hashes, a.prefix_block_size) \
        == (2.5, "bob", -1, 200.0, None, (7, 8, 9), 16)
    assert (b.tenant, b.priority, b.prefix_hashes) == ("default", 0, None)


# ----------------------------------------------------------------------------- bad rows
SPLIT = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
BAD_ROWS = [  # (format header, bad line, reason, words in the message)
    (SPLIT, "1.5,10", "missing column", "expected 3 comma-separated cells, found 2"),
    (SPLIT, "1.5,10,4,9", "extra column", "found 4"),
    (SPLIT, "1.5,ten,4", "non-numeric value", "num_prefill_tokens is 'ten'"),
    (SPLIT, "1.5,1_000,4", "non-numeric value", "num_prefill_tokens"),
    (SPLIT, "1.5,10,-4", "non-positive length", "num_decode_tokens is '-4'"),
    (SPLIT, "1.5,0,4", "non-positive length", "num_prefill_tokens is '0'"),
    (SPLIT, "1.5,10.5,4", "non-integer value", "not an integer"),
    (SPLIT, "nan,10,4", "non-finite value", "arrived_at is 'nan'"),
    (SPLIT, "1.5,NaN,4", "non-finite value", "num_prefill_tokens"),
    (SPLIT, "0.5,10,4", "out-of-order timestamp", "time 0.5 s comes before 1.0 s on line 2"),
    (SPLIT, "1.5,99999999999,4", "implausible length", "above"),
    (AZURE, "2023-11-16 24:00:00.0,10,4", "invalid timestamp", "not a time of day"),
    (AZURE, "2023-02-30 10:00:00.0,10,4", "invalid timestamp", "not a calendar date"),
    (AZURE, "16/11/2023 10:00,10,4", "invalid timestamp", "expected YYYY-MM-DD"),
    (AZURE, "2023-11-16 00:00:00.5,10,4", "out-of-order timestamp", "2023-11-16 00:00:00.5000000 comes before"),
    (BURST, "3,,10,4,14,API log", "invalid model", "expected a model name"),
    ("arrival_s,prompt_tokens,output_tokens,prefix_block_size,prefix_hashes\n", "3,10,4,16,1 x",
     "invalid prefix hashes", "space-separated"),
    ("arrival_s,prompt_tokens,output_tokens,prefix_block_size,prefix_hashes\n", "3,10,4,,1 2",
     "invalid prefix hashes", "given together"),
    ("arrival_s,prompt_tokens,output_tokens\n", "-3,10,4", "negative arrival", ">= 0"),
    ("arrival_s,prompt_tokens,output_tokens,slo_ttft_ms\n", "3,10,4,-2", "invalid SLO", "> 0 ms"),
    ("arrival_s,prompt_tokens,output_tokens\n", '3,"10,4', "missing column", "found 2"),
]
AROUND = {SPLIT: ("1.0,5,5", "2.0,5,5"), AZURE: ("2023-11-16 00:00:01,5,5", "2023-11-16 00:00:02,5,5"),
          BURST: ("1,M,5,5,10,API log", "2,M,5,5,10,API log")}


@pytest.mark.parametrize("header, bad, reason, words", BAD_ROWS)
def test_bad_row_error_names_file_line_and_problem_and_drop_mode_counts_it(tmp_path, header, bad, reason, words):
    extra = "," * (header.count(",") - 2)
    first, last = AROUND.get(header, ("1.0,5,5" + extra, "2.0,5,5" + extra))
    path = _write(tmp_path, header + f"{first}\n{bad}\n{last}\n", "bad.csv")
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    err = info.value
    assert (err.path, err.line) == (str(path), 3)
    assert str(err).startswith(f"{path}, line 3: {reason}: ") and words in str(err)
    assert isinstance(err, ValueError)
    trace = load_trace(path, on_bad_row="drop")
    assert len(trace) == 2 and trace.source_rows == 3
    assert [(i.reason, i.count) for i in trace.dropped] == [(reason, 1)]
    assert trace.dropped[0].example.startswith("line 3: ")


MOON_BAD = [
    ('{"timestamp": 5, "input_length": 10}', "invalid field", "output_length is None"),
    ('{"timestamp": "5", "input_length": 10, "output_length": 2}', "invalid field", "timestamp is '5'"),
    ('{"timestamp": 5, "input_length": 0, "output_length": 2}', "non-positive length", "input_length is 0"),
    ('{"timestamp": 5, "input_length": 2.5, "output_length": 2}', "invalid field", "input_length is 2.5"),
    ('{"timestamp": NaN, "input_length": 2, "output_length": 2}', "invalid field", "timestamp is nan"),
    ('{"timestamp": 5, "input_length": 2, "output_length": 2, "hash_ids": [1, -1]}', "invalid prefix hashes", ""),
    ('{"timestamp": 5, "input_length": 2, "output_length": 2, "hash_ids": []}', "invalid prefix hashes", ""),
    ('{"timestamp": 5, "input_length": 2, "output_length": 2', "invalid JSON", "not a JSON object"),
    ("[1, 2]", "invalid JSON", "found list"),
    ("[" * 100000, "invalid JSON", ""),
    ('{"timestamp": 0, "input_length": 2, "output_length": 2}', "out-of-order timestamp", "0 ms comes before 1000 ms"),
]


@pytest.mark.parametrize("bad, reason, words", MOON_BAD)
def test_mooncake_bad_lines(tmp_path, bad, reason, words):
    ok = [json.dumps({"timestamp": t, "input_length": 600, "output_length": 3, "hash_ids": [0, t + 1]})
          for t in (1000, 2000)]
    path = _write(tmp_path, "\n".join([ok[0], bad, ok[1]]), "m.jsonl")
    with pytest.raises(TraceFormatError, match=rf"m.jsonl, line 2: {reason}: .*{words}"):
        load_trace(path)
    trace = load_trace(path, on_bad_row="drop")
    assert [r.arrival_s for r in trace.records] == [0.0, 1.0] and trace.source_rows == 3
    assert [(i.reason, i.count) for i in trace.dropped] == [(reason, 1)]


def test_invalid_utf8_line_is_a_bad_row(tmp_path):
    path = _write(tmp_path, SPLIT.encode() + b"0,1,1\n1,\xff\xfe,2\n2,3,4\n")
    with pytest.raises(TraceFormatError, match=r"line 3: invalid UTF-8"):
        load_trace(path)
    trace = load_trace(path, on_bad_row="drop")
    assert len(trace) == 2 and trace.dropped[0].reason == "invalid UTF-8"
    with pytest.raises(TraceFormatError, match="line 1: the first line is not valid UTF-8"):
        load_trace(_write(tmp_path, b"\xffTIMESTAMP\n"))


def test_drop_mode_keeps_the_longest_ordered_run_around_a_bad_timestamp(tmp_path):
    # One far-future time must cost one row, not every row after it.
    rows = ["0,1,1", "1,1,1", "99999,1,1", "2,1,1", "3,1,1", "2.5,1,1", "4,1,1"]
    trace = load_trace(_write(tmp_path, SPLIT + "\n".join(rows)), on_bad_row="drop")
    assert [r.arrival_s for r in trace.records] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [(i.reason, i.count) for i in trace.dropped] == [("out-of-order timestamp", 2)]
    assert trace.dropped[0].example.startswith("line 4: time 99999.0 s")


def test_ties_are_in_order_and_kept(tmp_path):
    trace = load_trace(_write(tmp_path, SPLIT + "1,1,1\n1,2,2\n1,3,3\n"))
    assert [r.prompt_tokens for r in trace.records] == [1, 2, 3]


def test_on_bad_row_must_be_known(tmp_path):
    with pytest.raises(ValueError, match="on_bad_row"):
        load_trace(_write(tmp_path, SPLIT + "1,1,1\n"), on_bad_row="skip")


# ----------------------------------------------------------------------------- bulk servelab path
_SERVELAB_HEAD = "arrival_s,prompt_tokens,output_tokens,tenant,priority,slo_ttft_ms,slo_tpot_ms,prefix_block_size,prefix_hashes"
_CELLS = {  # per column: clean values the bulk path takes, and odd ones it must leave to the row parser
    "arrival_s": ["0", "0.5", "1e2", "3.25", "-0.0", "-1", " 2", "nan", "1e999", "+4", ".5", "7."],
    "prompt_tokens": ["1", "12", "4096", "0", "12.0", "2147483648", " 9", "x"],
    "output_tokens": ["1", "7", "300", "-3", "1e3", "2147483648"],
    "tenant": ["", "a", "team b", "\u00e9t\u00e9", "x\ty", "\u2028"],
    "priority": ["", "0", "-2", "15", "1.0", " 3", "+1", "p"],
    "slo_ttft_ms": ["", "500", "0.5", "0", "-1", "inf", " 9"],
    "slo_tpot_ms": ["", "50", "1e1", "nan"],
    "prefix_block_size": ["", "", "", "16"],
    "prefix_hashes": ["", "", "", "1 2"],
}


@st.composite
def _servelab_files(draw):
    columns = _SERVELAB_HEAD.split(",")
    keep = draw(st.lists(st.sampled_from(columns[3:]), unique=True))
    required = [c for c in columns[:3] if c != draw(st.sampled_from([None, None, None, *columns[:3]]))]
    header = required + [c for c in columns[3:] if c in keep] + draw(st.sampled_from([[], ["note"]]))
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        odd = draw(st.sampled_from([None, *header]))  # at most one odd cell a row
        row = [draw(st.sampled_from(_CELLS[c] if c == odd else _CELLS[c][:3])) if c in _CELLS else "n"
               for c in header]
        rows.append(",".join(row))
    if draw(st.booleans()):
        rows.sort(key=lambda r: r.split(",")[0])
    return ",".join(header) + "\n" + "\n".join(rows) + "\n"


def _load_or_error(path, on_bad_row):
    try:
        t = load_trace(path, "servelab", on_bad_row=on_bad_row)
    except TraceError as exc:
        return type(exc), str(exc)
    return t.records, t.source_rows, t.dropped, t.notes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_servelab_files(), on_bad_row=st.sampled_from(["error", "drop"]))
def test_servelab_bulk_path_agrees_with_the_row_parser(tmp_path, monkeypatch, text, on_bad_row):
    """The bulk path for servelab's own format gives what the row parser gives, or leaves
    the file to it: same records, counts and notes, or the same error."""
    path = _write(tmp_path, text)
    fast = _load_or_error(path, on_bad_row)
    with monkeypatch.context() as m:
        m.setattr(loaders, "_bulk_columns", lambda *a, **k: None)
        slow = _load_or_error(path, on_bad_row)
    assert fast == slow


def test_servelab_bulk_path_is_taken_for_a_clean_file(tmp_path, monkeypatch):
    text = (_SERVELAB_HEAD + "\n0.5,10,3,a,-2,500,,,\n1.5,4,2,,,,1e1,,\n")
    taken = []
    real = loaders.arrow_csv
    monkeypatch.setattr(loaders, "arrow_csv", lambda *a: taken.append(real(*a)) or taken[-1])
    a, b = load_trace(_write(tmp_path, text)).records
    assert taken and taken[-1] is not None   # the bulk path read it, not the row parser
    assert (a.tenant, a.priority, a.slo_ttft_ms, a.slo_tpot_ms) == ("a", -2, 500.0, None)
    assert (b.tenant, b.priority, b.slo_ttft_ms, b.slo_tpot_ms) == ("default", 0, None, 10.0)


# ----------------------------------------------------------------------------- pyarrow's leniencies
@pytest.mark.parametrize("text", [
    SPLIT + "0,0x1F,3\n",                       # Arrow casts hex to int
    SPLIT + "1e00005,3,3\n",                    # more exponent digits than the row parser takes
    SPLIT + "Infinity,3,3\n", SPLIT + " 1,3,3\n", SPLIT + "1,+3,3\n",
    SPLIT + "1,3,3\r2,3,3\n",                   # a lone CR: a line end for Arrow only
    AZURE + "2023-11-16 18:17,3,3\r\n",         # no seconds: Arrow's timestamp parser takes it
    AZURE + "2023-11-16 18:17:03+01:00,3,3\r\n",
    '{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [1]} '
    '{"timestamp": 2, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n',
    '{"timestamp": 1, "timestamp": 2, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n',
    b'{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n'
    b'{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [1], "x": "\xff"}\n',
])
def test_what_pyarrow_reads_differently_goes_to_the_row_parser(tmp_path, monkeypatch, text):
    path = _write(tmp_path, text, "t.jsonl" if text[:1] in ("{", b"{") else "t.csv")
    bulk = loaders._bulk_columns
    taken = []
    monkeypatch.setattr(loaders, "_bulk_columns", lambda *a: taken.append(bulk(*a)) or taken[-1])
    try:
        got = load_trace(path, on_bad_row="drop").records
    except TraceError as exc:
        got = str(exc)
    assert taken == [None]
    monkeypatch.setattr(loaders, "_bulk_columns", lambda *a: None)
    try:
        assert load_trace(path, on_bad_row="drop").records == got
    except TraceError as exc:
        assert str(exc) == got


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.floats(allow_nan=False, allow_infinity=False).map(repr),
                      st.from_regex(r"\A[+-]?(?:[0-9]{1,25}(?:\.[0-9]{0,25})?|\.[0-9]{1,25})"
                                    r"(?:[eE][+-]?[0-9]{1,4})?\Z")))
def test_pyarrow_reads_a_decimal_as_python_does(text):
    """Times and SLOs are converted by Arrow's cast: correctly rounded, as float() is."""
    import struct

    import pyarrow as pa

    expected = float(text)
    try:
        got = pa.array([text]).cast(pa.float64())[0].as_py()
    except pa.ArrowInvalid:
        got = None
    if math.isfinite(expected):
        assert struct.pack("<d", got) == struct.pack("<d", expected)
    else:   # beyond the float range: either way the bulk path leaves it to the row parser
        assert got is None or math.isinf(got)


@pytest.mark.parametrize("first", ["null", " null, 1", 'null, "input_length": 3600}'])
def test_mooncake_file_opening_with_a_non_object_is_a_bad_line_not_a_crash(tmp_path, first):
    """pyarrow's JSON reader crashes the process on a file whose first value is null; such
    a file never reaches it: the row parser names the line."""
    ok = [json.dumps({"timestamp": t, "input_length": 600, "output_length": 3, "hash_ids": [0, t + 1]})
          for t in (1000, 2000)]
    path = _write(tmp_path, "\n".join([first, *ok]) + "\n", "m.jsonl")
    with pytest.raises(TraceFormatError, match=r"m.jsonl, line 1: invalid JSON"):
        load_trace(path, "mooncake")
    trace = load_trace(path, "mooncake", on_bad_row="drop")
    assert [r.arrival_s for r in trace.records] == [0.0, 1.0] and trace.source_rows == 3


def test_mooncake_null_prefix_hash_is_a_bad_line(tmp_path):
    """A null among a line's hash_ids is an invalid prefix hash, on the bulk path too."""
    lines = [json.dumps({"timestamp": t, "input_length": 600, "output_length": 3, "hash_ids": h})
             for t, h in ((1000, [0, 1]), (2000, [0, None, 2]), (3000, [0, 3]))]
    path = _write(tmp_path, "\n".join(lines) + "\n", "m.jsonl")
    with pytest.raises(TraceFormatError, match=r"m.jsonl, line 2: invalid prefix hashes"):
        load_trace(path)
    trace = load_trace(path, on_bad_row="drop")
    assert [r.arrival_s for r in trace.records] == [0.0, 2.0]


def test_a_header_two_formats_of_the_same_columns_could_read_is_refused(tmp_path, monkeypatch):
    """Two formats of the very same columns (here the gateway-log example's columns in
    ms and in s): detection cannot tell which is meant, and took the first registered,
    silently 1,000x off for the other; now it asks for --trace-format, and naming one
    reads the file."""
    from servelab.traces.formats import TRACE_FORMATS, TraceFormat, register_trace_format
    from servelab.traces.record import TraceFormatError

    monkeypatch.setattr(TRACE_FORMATS, "_entries", dict(TRACE_FORMATS._entries))
    cols = {"time": "ts", "prompt": "prompt_len", "output": "completion_len"}
    register_trace_format(TraceFormat("log-ms", cols, time_unit="ms"))
    register_trace_format(TraceFormat("log-s", cols, time_unit="s"))
    path = tmp_path / "log.csv"
    path.write_text("ts,prompt_len,completion_len\n0,10,5\n2,12,6\n")
    with pytest.raises(TraceFormatError, match="those of trace formats 'log-ms' and 'log-s'.*--trace-format"):
        detect_format(path)
    assert load_trace(path, format="log-s").records[1].arrival_s == 2.0
    assert load_trace(path, format="log-ms").records[1].arrival_s == 0.002
