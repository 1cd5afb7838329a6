"""Named datasets and resolve_trace. No test touches the network: downloads go through a
fake `fetch` that copies the shared file, writes garbage, or fails like an unreachable host."""
from __future__ import annotations

import shutil
import urllib.error

import pytest

from servelab.traces.datasets import DATASETS, DatasetUnavailableError, dataset_path, resolve_trace
from servelab.traces.record import TraceError

ROWS = {"azure-code-2023": 8819, "azure-conv-2023": 19366, "splitwise-code": 8819, "splitwise-conv": 19366,
        "mooncake-conversation": 12031, "sharegpt-lengths": 30731, "arxiv-lengths": 28257, "bwb-lengths": 33768}


def _unreachable(url, dest, timeout):
    raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")


def test_every_named_dataset_resolves_in_the_shared_directory(traces_dir):
    assert set(DATASETS) == set(ROWS)
    for name, rows in ROWS.items():
        ds = DATASETS[name]
        assert (traces_dir / ds.filename).is_file()
        assert ds.url.startswith("https://raw.githubusercontent.com/") and len(ds.sha256) == 64
        trace = resolve_trace(name, trace_dir=traces_dir, rate=4.0 if ds.format == "lengths" else None,
                              fetch=_unreachable)
        assert trace.format == ds.format and trace.source_rows == rows and len(trace) == rows
        assert trace.notes[-1] == f"dataset {name}"


def test_missing_dataset_download_failure_names_url_file_and_directory(tmp_path):
    calls = []

    def fetch(url, dest, timeout):
        calls.append((url, dest.parent, timeout))
        dest.write_bytes(b"partial")
        _unreachable(url, dest, timeout)

    with pytest.raises(DatasetUnavailableError) as info:
        resolve_trace("azure-conv-2023", trace_dir=tmp_path / "cache", fetch=fetch)
    msg = str(info.value)
    ds = DATASETS["azure-conv-2023"]
    assert ds.url in msg and ds.filename in msg and str(tmp_path / "cache") in msg
    assert "URLError" in msg and "name resolution" in msg
    assert calls == [(ds.url, tmp_path / "cache", pytest.approx(15.0))]
    assert list((tmp_path / "cache").iterdir()) == []  # the partial download is removed
    assert isinstance(info.value, TraceError)


def test_no_download_mode_fails_without_fetching(tmp_path):
    def fetch(url, dest, timeout):
        raise AssertionError("must not fetch")

    with pytest.raises(DatasetUnavailableError, match=r"mooncake_conversation_trace.jsonl is not in .*"
                                                      r"Download https://raw.githubusercontent.com/kvcache-ai"):
        dataset_path("mooncake-conversation", tmp_path, download=False, fetch=fetch)


def test_download_is_verified_by_sha256(tmp_path, traces_dir):
    def good(url, dest, timeout):
        shutil.copyfile(traces_dir / "splitwise_code.csv", dest)

    def bad(url, dest, timeout):
        dest.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n")

    path = dataset_path("splitwise-code", tmp_path / "a", fetch=good)
    assert path == tmp_path / "a" / "splitwise_code.csv" and path.is_file()
    assert len(resolve_trace("splitwise-code", trace_dir=tmp_path / "a", fetch=_unreachable)) == 8819
    with pytest.raises(DatasetUnavailableError, match="has sha256 .* expected f266b907"):
        dataset_path("splitwise-code", tmp_path / "b", fetch=bad)
    assert not (tmp_path / "b" / "splitwise_code.csv").exists()


def test_resolve_trace_accepts_paths_and_default_and_rejects_the_rest(tmp_path, traces_dir):
    trace = resolve_trace(str(traces_dir / "splitwise_conv.csv"), rate=11.0, max_model_len=8192)
    assert trace.mean_rate == pytest.approx(11.0) and trace.num_clipped == 1   # prompt and output
    default = resolve_trace("default", seed=3)
    assert {r.tenant for r in default.records} == {"interactive", "batch"}
    assert resolve_trace("default", seed=3, rate=9.0).mean_rate == pytest.approx(9.0, rel=0.05)
    with pytest.raises(TraceError, match="not 'default', a dataset name .*azure-conv-2023.* or an existing file"):
        resolve_trace(str(tmp_path / "nope.csv"))
    with pytest.raises(TraceError, match="unknown dataset"):
        dataset_path("azure-2024", tmp_path)
    with pytest.raises(TraceError, match="length-only"):
        resolve_trace("bwb-lengths", trace_dir=traces_dir)
    with pytest.raises(TraceError, match="do not apply to the default workload"):
        resolve_trace("default", cv=2.0)
