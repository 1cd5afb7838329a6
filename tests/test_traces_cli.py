"""`servelab trace stats|convert|datasets` through the real command-line entry point."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.cli import CLIError, main
from servelab.traces.cli import add_trace_arguments, trace_dir_from, trace_from_args
from servelab.traces.loaders import load_trace


def test_stats_prints_counts_span_rate_percentiles_and_histogram(traces_dir, capsys):
    assert main(["trace", "stats", "azure-code-2023", "--trace-dir", str(traces_dir), "--bins", "5"]) == 0
    out = capsys.readouterr().out
    assert "requests: 8819 of 8819 data rows" in out
    assert "span: 3435.948 s (57.3 min)   mean rate: 2.567 req/s" in out
    assert "prompt         min 3  mean 2047.8  p50 1469  p90 5187.6  p99 7436  max 7437" in out
    assert "output         min 6  mean 27.9  p50 13  p90 55  p99 251.5  max 1899" in out
    histogram = [line for line in out.splitlines() if " | " in line]
    assert len(histogram) == 5 and sum(int(line.split()[-1]) for line in histogram) == 8818
    assert "dropped rows: 0" in out and "time origin 2023-11-16 18:17:03.9799600" in out


def test_stats_reports_dropped_rows_and_errors_exit_2(tmp_path, traces_dir, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n1,x,5\n2,0,5\n3,7,7\n")
    assert main(["trace", "stats", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("servelab trace: error: ") and f"{bad}, line 3: non-numeric value" in err
    assert main(["trace", "stats", str(bad), "--on-bad-row", "drop"]) == 0
    out = capsys.readouterr().out
    assert "requests: 2 of 4 data rows" in out and "dropped rows: 2" in out
    assert "1 x non-numeric value (first: line 3: num_prefill_tokens is 'x', not a number)" in out
    assert "1 x non-positive length (first: line 4:" in out
    assert main(["trace", "stats", "sharegpt-lengths", "--trace-dir", str(tmp_path), "--no-download"]) == 2
    assert "is not in" in capsys.readouterr().err
    assert main(["trace", "stats", "no-such-trace"]) == 2
    assert "not 'default', a dataset name" in capsys.readouterr().err


def test_stats_of_a_length_only_table_without_rate_prints_the_lengths(traces_dir, capsys):
    assert main(["trace", "stats", "sharegpt-lengths", "--trace-dir", str(traces_dir)]) == 0
    out = capsys.readouterr().out
    assert "requests: 30731 of 30731 data rows" in out
    assert "arrivals: none (a length-only table); they are drawn only when you pass --rate" in out
    assert "prompt         min 1  mean 2340.0  p50 1730" in out
    assert "span:" not in out and "inter-arrival" not in out and "arrivals drawn" not in out


def test_stats_of_lengths_with_rate_and_default(traces_dir, capsys):
    assert main(["trace", "stats", "bwb-lengths", "--trace-dir", str(traces_dir), "--rate", "3", "--cv", "2",
                 "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "requests: 33768" in out and "arrivals drawn: gamma cv=2 rate=3/s seed=5" in out
    assert main(["trace", "stats", "default"]) == 0
    out = capsys.readouterr().out
    assert "interactive:" in out and "priority 1" in out and "prefix hashes:" in out


def test_convert_writes_canonical_csv_that_loads_back_identically(traces_dir, tmp_path, capsys):
    out = tmp_path / "moon.csv"
    assert main(["trace", "convert", "mooncake-conversation", str(out), "--trace-dir", str(traces_dir),
                 "--max-model-len", "32768"]) == 0
    assert "wrote 12031 requests" in capsys.readouterr().out
    assert out.read_text().splitlines()[0] == "arrival_s,prompt_tokens,output_tokens,prefix_block_size,prefix_hashes"
    back = load_trace(out)
    original = load_trace(traces_dir / "mooncake_conversation_trace.jsonl", max_model_len=32768)
    assert back.format == "servelab" and back.records == original.records
    azure = tmp_path / "azure.csv"
    assert main(["trace", "convert", str(traces_dir / "AzureLLMInferenceTrace_conv.csv"), str(azure)]) == 0
    assert load_trace(azure).records == load_trace(traces_dir / "AzureLLMInferenceTrace_conv.csv").records
    # a missing folder is made, as `simulate --out` makes its own (the README writes runs/...)
    assert main(["trace", "convert", "default", str(tmp_path / "new" / "dir.csv")]) == 0
    assert load_trace(tmp_path / "new" / "dir.csv").records
    (tmp_path / "file").write_text("x")
    assert main(["trace", "convert", "default", str(tmp_path / "file" / "t.csv")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_stats_lru_hit_ratio_needs_prefix_hashes_and_its_own_block_size_flag(traces_dir, capsys):
    """The LRU line reads as a figure where the trace has hashes, as a plain sentence where
    it has none, and --lru-block-size without a cache to size is refused, not ignored."""
    assert main(["trace", "stats", "mooncake-conversation", "--trace-dir", str(traces_dir),
                 "--lru-cache-tokens", "1000000"]) == 0
    assert re.search(r"an LRU prefix cache of 1000000 tokens \(the trace's hashed blocks\) "
                     r"would hit \d+\.\d% of their prompt tokens", capsys.readouterr().out)
    assert main(["trace", "stats", "azure-conv-2023", "--trace-dir", str(traces_dir),
                 "--lru-cache-tokens", "1000"]) == 0
    assert ("an LRU prefix cache of 1000 tokens: no hit ratio, the trace's requests carry no "
            "prefix hashes") in capsys.readouterr().out
    assert main(["trace", "stats", "mooncake-conversation", "--trace-dir", str(traces_dir),
                 "--lru-block-size", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give --lru-cache-tokens N too" in err


def test_convert_keeps_an_existing_file_unless_forced(tmp_path, capsys):
    """A run's requests.csv (or yesterday's conversion) is not overwritten by a typo."""
    out = tmp_path / "requests.csv"
    out.write_text("request_id,arrival_s\n0,0.0\n")
    assert main(["trace", "convert", "default", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out} exists: use another name, or --force" in err
    assert out.read_text() == "request_id,arrival_s\n0,0.0\n"
    assert main(["trace", "convert", "default", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["trace", "convert", "default", str(out), "--force"]) == 0
    assert load_trace(out).records


def test_datasets_lists_names_and_presence(traces_dir, tmp_path, capsys):
    assert main(["trace", "datasets", "--trace-dir", str(traces_dir)]) == 0
    out = capsys.readouterr().out
    assert f"trace directory: {traces_dir}" in out and out.count("present") == 8
    assert main(["trace", "datasets", "--trace-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("missing") == 8


def test_trace_dir_comes_from_flag_then_environment_then_cache():
    assert trace_dir_from("/x", {"SERVELAB_TRACE_DIR": "/y"}) == Path("/x")
    assert trace_dir_from(None, {"SERVELAB_TRACE_DIR": "/y"}) == Path("/y")
    assert trace_dir_from(None, {}) == Path("~/.cache/servelab/traces").expanduser()


def test_other_commands_share_the_trace_options(traces_dir):
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    add_trace_arguments(parser)
    args = parser.parse_args(["--trace", "splitwise-conv", "--rate", "7.5"])
    trace = trace_from_args(args, seed=args.seed, environ={"SERVELAB_TRACE_DIR": str(traces_dir)})
    assert len(trace) == 19366 and trace.mean_rate == pytest.approx(7.5)
    assert trace_from_args(parser.parse_args([]), environ={}).format == "synthetic"
    with pytest.raises(CLIError, match="length-only"):
        trace_from_args(parser.parse_args(["--trace", "arxiv-lengths"]), environ={"SERVELAB_TRACE_DIR": str(traces_dir)})


def test_importing_the_cli_module_does_not_import_numpy():
    code = "import sys, servelab.traces.cli; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_trace_commands_spell_loading_flags_as_simulate_does(traces_dir, capsys):
    """--trace-format and --arrival-cv as in simulate (the old --format/--cv still work),
    and an error names the flag, not the keyword."""
    assert main(["trace", "stats", "bwb-lengths", "--trace-dir", str(traces_dir), "--rate", "3",
                 "--arrival-cv", "2", "--trace-format", "lengths"]) == 0
    capsys.readouterr()
    assert main(["trace", "stats", "default", "--arrival-cv", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("servelab trace: error: --arrival-cv does not apply to the default workload")


def test_a_histogram_of_equal_gaps_says_so(tmp_path, capsys):
    trace = tmp_path / "even.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n"
                     + "".join(f"{3 * i},10,5\n" for i in range(5)))
    assert main(["trace", "stats", str(trace)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " | " in line]
    assert len(rows) == 1 and rows[0].strip().startswith("3 s (every gap) |")


def test_a_bin_never_shows_the_same_number_at_both_ends():
    from servelab.traces.stats import gap_histogram, render_histogram

    gaps = [2.997, 2.9976, 2.999, 3.0, 3.0, 3.003]           # Mooncake's millisecond-jittered 3 s
    for line in render_histogram(gap_histogram(gaps)):
        lo, hi = line.split(" | ")[0].strip().split(" - ")
        assert lo != hi, line


def test_output_cut_short_by_its_reader_ends_quietly(traces_dir):
    """`servelab trace stats T | head`: the reader closes the pipe; no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "servelab", "trace", "stats", "azure-conv-2023",
                             "--trace-dir", str(traces_dir), "--bins", "5000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("trace: ")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err


def test_convert_refuses_an_output_it_would_not_write_in_that_format(tmp_path, capsys):
    """It writes CSV: CSV text in a file named .parquet was a trap."""
    out = tmp_path / "x.parquet"
    assert main(["trace", "convert", "default", str(out)]) == 2
    assert capsys.readouterr().err == ("servelab trace: error: trace convert writes servelab's "
                                       "canonical CSV, not parquet: name the output .csv\n")
    assert not out.exists()


def test_a_servelab_trace_column_it_does_not_read_is_named(tmp_path, capsys):
    """A misspelt optional column (`priorty`, `slo_ttft`) would leave every request at
    priority 0 and without its SLO: the trace's notes name it, `trace stats` and
    `simulate` print them; a trace with only known columns has no such note."""
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,slo_ttft,priorty\n"
                    "0.0,512,128,1,1\n0.1,2048,256,1,0\n")
    assert any(n.startswith("columns not read: slo_ttft, priorty (") for n in load_trace(path).notes)
    assert main(["trace", "stats", str(path)]) == 0
    assert "columns not read: slo_ttft, priorty" in capsys.readouterr().out
    assert main(["simulate", "--trace", str(path), "--out", str(tmp_path / "run")]) == 0
    assert "note: columns not read: slo_ttft, priorty" in capsys.readouterr().err
    good = tmp_path / "g.csv"
    good.write_text("arrival_s,prompt_tokens,output_tokens,priority\n0.0,512,128,1\n")
    assert not any(n.startswith("columns not read") for n in load_trace(good).notes)
