"""Named public datasets, found in a trace directory or downloaded into it, and `resolve_trace`.

Each dataset is pinned to an upstream commit and a sha256, so a download is exactly the
file the statistics in the shared traces README describe; a mismatch is an error, never a
silently different workload. The trace directory is always an argument here: reading
`--trace-dir` / `SERVELAB_TRACE_DIR` is the command line's job (`traces.cli`).
"""
from __future__ import annotations

import hashlib
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable

from servelab.atomic import atomic_path
from servelab.traces.record import Trace, TraceError

DEFAULT_TRACE_DIR = Path("~/.cache/servelab/traces")
DOWNLOAD_TIMEOUT_S = 15.0

_AZURE = "https://raw.githubusercontent.com/Azure/AzurePublicDataset/b469a113cedca53ddc3bdea71a143dc4b7d8700c/data/"
_VIDUR = "https://raw.githubusercontent.com/microsoft/vidur/7d47513363ec447a741ac5e47241580b47724fbf/data/processed_traces/"
_ETALON = "https://raw.githubusercontent.com/project-etalon/etalon/10102d06d17e7763a9779b0483b41abd7fabeb3b/data/processed_traces/"
_MOONCAKE = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/3b5a594133958449a1feaf1c9e0fc1b553e34a28/FAST25-release/traces/"


class DatasetUnavailableError(TraceError):
    """A named dataset is neither in the trace directory nor downloadable right now."""


@dataclass(frozen=True)
class Dataset:
    name: str
    filename: str
    """File name in the trace directory."""
    url: str
    sha256: str
    format: str
    description: str
    license: str


def _ds(name, filename, url, sha256, fmt, description, license) -> Dataset:
    return Dataset(name, filename, url, sha256, fmt, description, license)


DATASETS: MappingProxyType[str, Dataset] = MappingProxyType({d.name: d for d in (
    _ds("azure-code-2023", "AzureLLMInferenceTrace_code.csv", _AZURE + "AzureLLMInferenceTrace_code.csv",
        "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6", "azure",
        "Azure LLM inference 2023, code service: 8,819 requests over 57 min", "CC-BY-4.0 (cite Splitwise, ISCA'24)"),
    _ds("azure-conv-2023", "AzureLLMInferenceTrace_conv.csv", _AZURE + "AzureLLMInferenceTrace_conv.csv",
        "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8", "azure",
        "Azure LLM inference 2023, conversation service: 19,366 requests over 58 min",
        "CC-BY-4.0 (cite Splitwise, ISCA'24)"),
    _ds("splitwise-code", "splitwise_code.csv", _VIDUR + "splitwise_code.csv",
        "f266b907d109d471c61283ab69771c17ad79a18b33ff6e96aa546346f52767a6", "splitwise",
        "azure-code-2023 in relative seconds (vidur)", "MIT repo; data CC-BY-4.0"),
    _ds("splitwise-conv", "splitwise_conv.csv", _VIDUR + "splitwise_conv.csv",
        "439e4138b7e384f316de614c071f7162be05b8af0cef866f82faacd1b0472249", "splitwise",
        "azure-conv-2023 in relative seconds (vidur)", "MIT repo; data CC-BY-4.0"),
    _ds("mooncake-conversation", "mooncake_conversation_trace.jsonl", _MOONCAKE + "conversation_trace.jsonl",
        "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df", "mooncake",
        "Mooncake FAST'25 conversation: 12,031 requests, prefix hash ids over 512-token blocks",
        "Apache-2.0 (cite Mooncake, FAST'25)"),
    _ds("sharegpt-lengths", "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
        _ETALON + "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
        "6d6c296302a853e2669a674a96f269283e60c57e60363bd450588a1066919f9f", "lengths",
        "ShareGPT lengths (Llama-2 tokenizer, <= 8K): 30,731 rows, no timestamps", "Apache-2.0 repo"),
    _ds("arxiv-lengths", "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
        _VIDUR + "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
        "9d3580538d915ca75e4aaaa54590b42dbb17abc6d74c8913310cf07c232adcdc", "lengths",
        "arXiv summarization lengths (<= 4K): 28,257 rows, no timestamps", "MIT repo"),
    _ds("bwb-lengths", "bwb_stats_llama2_tokenizer_filtered_v2.csv",
        _ETALON + "bwb_stats_llama2_tokenizer_filtered_v2.csv",
        "389419d2f2e55149b5d6ccfedb881572798d39650436ab86fd61f3c40337a990", "lengths",
        "Bilingual-Web-Book translation lengths (<= 4K): 33,768 rows, no timestamps", "Apache-2.0 repo"),
)})

Fetch = Callable[[str, Path, float], None]


def urllib_fetch(url: str, dest: Path, timeout: float) -> None:
    """Download `url` to `dest` with urllib (no retries; the caller verifies the bytes)."""
    with urllib.request.urlopen(url, timeout=timeout) as response, open(dest, "wb") as out:
        while chunk := response.read(1 << 20):
            out.write(chunk)


def dataset_path(name: str, trace_dir: str | os.PathLike, *, download: bool = True,
                 fetch: Fetch = urllib_fetch, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """The local file of dataset `name` in `trace_dir`, downloading it there if missing."""
    ds = DATASETS.get(name)
    if ds is None:
        raise TraceError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    directory = Path(trace_dir).expanduser()
    path = directory / ds.filename
    if path.is_file():
        return path
    hint = (f"Download {ds.url} by hand into {directory} (keeping the name {ds.filename}), or point "
            f"--trace-dir / SERVELAB_TRACE_DIR at a directory that holds it.")
    if not download:
        raise DatasetUnavailableError(f"dataset {name}: {ds.filename} is not in {directory}. {hint}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatasetUnavailableError(f"dataset {name}: cannot create {directory} ({exc}). {hint}") from exc
    with atomic_path(path) as part:  # removed unless the download is complete and verified
        try:
            fetch(ds.url, part, timeout)
            digest = hashlib.sha256(part.read_bytes()).hexdigest()
        except Exception as exc:  # network, HTTP, file-system: all mean "not available now"
            raise DatasetUnavailableError(f"dataset {name}: {ds.filename} is not in {directory} and downloading "
                                          f"it from {ds.url} failed ({type(exc).__name__}: {exc}). {hint}") from exc
        if digest != ds.sha256:
            raise DatasetUnavailableError(f"dataset {name}: the file downloaded from {ds.url} has sha256 {digest}, "
                                          f"expected {ds.sha256}; not using it. {hint}")
    return path


def resolve_trace(spec: str, *, trace_dir: str | os.PathLike | None = None, rate: float | None = None,
                  cv: float = 1.0, seed: int = 0, on_bad_row: str = "error", format: str = "auto",
                  max_model_len: int | None = None, download: bool = True,
                  fetch: Fetch = urllib_fetch, num_requests: int | None = None) -> Trace:
    """A trace from `spec`: 'default' (the embedded workload), a dataset name, or a file path.

    rate: target mean request rate; required for length-only datasets (arrivals drawn with
    `cv` and `seed`), a rescaling for timed traces, a total-rate override for 'default'.
    trace_dir: where datasets live (None: ~/.cache/servelab/traces).
    num_requests: only the first this many requests; a timed trace is cut before it is
    rescaled to `rate`, so that the requests kept arrive at that mean rate.
    """
    if spec == "default":
        if cv != 1.0 or format != "auto":
            raise TraceError("cv and format do not apply to the default workload")
        from servelab.traces.synthetic import default_workload
        trace = default_workload(seed, rate=rate)
        if num_requests is not None:
            from servelab.traces.transforms import first_n
            trace = first_n(trace, num_requests)
        if max_model_len is not None:
            from servelab.traces.transforms import clip_lengths
            trace = clip_lengths(trace, max_model_len)
        return trace
    from servelab.traces.loaders import load_trace
    ds = DATASETS.get(spec)
    if ds is not None:
        path = dataset_path(spec, DEFAULT_TRACE_DIR if trace_dir is None else trace_dir,
                            download=download, fetch=fetch)
        fmt = ds.format if format == "auto" else format
    elif os.path.exists(spec):
        path, fmt = Path(spec), format
    else:
        raise TraceError(f"trace {spec!r} is not 'default', a dataset name ({', '.join(DATASETS)}) "
                         "or an existing file")
    trace = load_trace(path, fmt, on_bad_row=on_bad_row, rate=rate, cv=cv, seed=seed,
                       max_model_len=max_model_len, num_requests=num_requests)
    if ds is not None:
        trace = trace.with_records(trace.records, note=f"dataset {ds.name}")
    return trace
