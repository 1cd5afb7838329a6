"""Loading measured kernel times: the real layouts, bad input, duplicates, GPU matching.

Every table here is synthetic but written in the real schema (`_gpu_tables`), so each
expectation can be worked out by hand: which rows survive, in which units, and what the
message names. Bad input is an error naming "FILE: row N" (N counts data rows from 1), or
with `drop_bad_rows` the row is gone and counted under its reason.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from _gpu_tables import A100, H100, write_aic, write_vidur_allreduce, write_vidur_ops

from servelab.validation.measurements import MeasurementError, load_measurements

GEMMS = [{"m": 1, "n": 4096, "k": 4096, "latency": 0.010},
         {"m": 16, "n": 4096, "k": 4096, "latency": 0.011},
         {"m": 256, "n": 4096, "k": 4096, "latency": 0.020}]


def gemm_file(root, rows=GEMMS, folder="h100_sxm", **kw):
    return write_aic(root / folder / "gemm_perf.parquet", rows, **kw)


def decode_row(**kw):
    return {"batch_size": 8, "step": 1024, "num_heads": 32, "num_key_value_heads": 8,
            "latency": 0.02, **kw}


def prefill_row(**kw):
    return {"batch_size": 1, "isl": 512, "num_heads": 32, "num_key_value_heads": 8,
            "latency": 0.05, **kw}


# --- the canonical form ---------------------------------------------------------------------


def test_aiconfigurator_tables_become_canonical_columns_in_seconds(tmp_path):
    gemm_file(tmp_path, [{"m": 1, "n": 4096, "k": 4096, "latency": 0.010},
                         {"m": 1, "n": 4096, "k": 4096, "gemm_dtype": "fp8", "latency": 0.006}])
    write_aic(tmp_path / "h100_sxm" / "generation_attention_perf.parquet",
              [decode_row(), decode_row(kv_cache_dtype="fp8", latency=0.012)])
    write_aic(tmp_path / "h100_sxm" / "context_attention_perf.parquet", [prefill_row()])
    write_aic(tmp_path / "h100_sxm" / "custom_allreduce_perf.parquet",
              [{"num_gpus": 2, "message_size": 1024, "latency": 0.004}])
    ms = load_measurements([tmp_path], "h100-sxm")
    assert ms.gpu == "h100-sxm" and ms.dropped == {}
    gemm = ms.table("gemm")
    assert gemm["dtype"].tolist() == ["bf16", "fp8"]
    assert gemm["latency_s"].tolist() == pytest.approx([10e-6, 6e-6])
    assert gemm.origin == [f"{tmp_path / 'h100_sxm' / 'gemm_perf.parquet'}: row {i}" for i in (1, 2)]
    dec = ms.table("attn_decode")
    assert dec["context"].tolist() == [1024, 1024] and dec["kv_dtype"].tolist() == ["bf16", "fp8"]
    assert (dec["heads"].tolist(), dec["kv_heads"].tolist()) == ([32, 32], [8, 8])
    pre = ms.table("attn_prefill")
    assert pre["tokens"].tolist() == [512] and pre["latency_s"].tolist() == pytest.approx([5e-5])
    ar = ms.table("allreduce")
    # message_size counts bf16 elements: 1024 of them are 2048 bytes
    assert ar["nbytes"].tolist() == [2048.0] and ar["backend"].tolist() == ["vllm_graph"]
    assert "aiconfigurator (VLLM 0.14.0, NVIDIA H100 80GB HBM3)" in ms.sources["gemm"]
    assert "h100_sxm/gemm_perf.parquet" in ms.sources["gemm"]


def test_vidur_files_are_matched_by_folder_and_file_prefix(tmp_path):
    vidur = tmp_path / "vidur"
    write_vidur_ops(vidur / "compute" / "h100" / "Llama-2-7b-hf.mlp.csv",
                    [{"num_tokens": 1, "num_tensor_parallel_workers": 1, "mlp_up_proj": 0.05},
                     {"num_tokens": 512, "num_tensor_parallel_workers": 2, "mlp_up_proj": 0.2}])
    write_vidur_ops(vidur / "compute" / "a100" / "Llama-2-7b-hf.mlp.csv",
                    [{"num_tokens": 7, "num_tensor_parallel_workers": 1}])
    write_vidur_allreduce(vidur / "network" / "h100_dgx.all_reduce.csv",
                          [{"num_workers": 2, "size": 2048, "median": 0.02},
                           {"num_workers": 4, "size": 2048, "median": 0.03},
                           {"num_workers": 16, "size": 2048, "median": 0.09}])   # two nodes
    write_vidur_allreduce(vidur / "network" / "a100_dgx.all_reduce.csv",
                          [{"num_workers": 8, "size": 4096, "median": 0.05}])
    h100 = load_measurements([tmp_path], "h100-sxm")
    ops = h100.table("vidur_ops")
    assert ops["num_tokens"].tolist() == [1, 512]
    assert ops["num_tensor_parallel_workers"].tolist() == [1, 2]
    assert ops["mlp_up_proj"].tolist() == pytest.approx([5e-5, 2e-4])
    assert ops["model"].tolist() == ["Llama-2-7b-hf"] * 2
    ar = h100.table("vidur_allreduce")
    assert ar["num_gpus"].tolist() == [2, 4]            # the 16-GPU (two-node) row is left out
    assert ar["nbytes"].tolist() == [2048.0, 2048.0]
    assert ar["latency_s"].tolist() == pytest.approx([2e-5, 3e-5])
    assert "compute/h100/Llama-2-7b-hf.mlp.csv" in h100.sources["vidur_ops"]
    a100 = load_measurements([tmp_path], "a100-80gb")
    assert a100.table("vidur_ops")["num_tokens"].tolist() == [7]
    assert a100.table("vidur_allreduce")["num_gpus"].tolist() == [8]


def test_tables_of_another_gpu_are_ignored(tmp_path):
    gemm_file(tmp_path, folder="h100_sxm")
    gemm_file(tmp_path, [{"m": 2, "n": 8192, "k": 8192, "latency": 0.05}], folder="a100_sxm",
              device=A100)
    # another GPU's rows are not checked either: this one would be bad on the H100
    write_aic(tmp_path / "a100_sxm" / "generation_attention_perf.parquet",
              [decode_row(latency=-1.0)], device=A100)
    h100 = load_measurements([tmp_path], "h100-sxm")
    assert h100.table("gemm")["m"].tolist() == [1, 16, 256]
    assert len(h100.table("attn_decode")) == 0
    assert "a100_sxm" not in h100.sources["gemm"]
    a100 = load_measurements([tmp_path], "a100-80gb", drop_bad_rows=True)
    assert a100.table("gemm")["m"].tolist() == [2]
    assert a100.dropped == {"non-positive or missing latency": 1}


def test_a_file_mixing_devices_gives_each_gpu_only_its_own_rows(tmp_path):
    """The device is a per-row column: rows measured on another GPU must not be priced as
    this GPU's, even when some rows of the file are this GPU's."""
    path = tmp_path / "mixed" / "gemm_perf.parquet"
    write_aic(path, [{"m": 1, "n": 4096, "k": 4096, "latency": 0.010, "device": H100},
                     {"m": 1, "n": 4096, "k": 4096, "latency": 0.030, "device": A100},
                     {"m": 8, "n": 4096, "k": 4096, "latency": 0.031, "device": A100}])
    merged = load_measurements([tmp_path], "h100-sxm", drop_bad_rows=True)
    assert merged.table("gemm")["latency_s"].tolist() == pytest.approx([10e-6])
    assert merged.dropped == {}
    strict = load_measurements([tmp_path], "h100-sxm")
    assert strict.table("gemm")["latency_s"].tolist() == pytest.approx([10e-6])


def test_only_other_gpus_tables_is_a_clear_error(tmp_path):
    gemm_file(tmp_path, folder="a100_sxm", device=A100)
    with pytest.raises(MeasurementError, match=r"no measurements for h100-sxm under .*other GPUs"):
        load_measurements([tmp_path], "h100-sxm")


def test_empty_unknown_or_missing_folders_are_clear_errors(tmp_path):
    with pytest.raises(MeasurementError, match="no measurement tables found under"):
        load_measurements([tmp_path], "h100-sxm")
    (tmp_path / "README.md").write_text("# notes\n")
    write_aic(tmp_path / "p2p" / "gemm_perf.parquet", GEMMS)
    (tmp_path / "p2p" / "gemm_perf.parquet").rename(tmp_path / "p2p" / "p2p_perf.parquet")
    with pytest.raises(MeasurementError, match=r"aiconfigurator \*_perf.parquet or Vidur"):
        load_measurements([tmp_path], "h100-sxm")
    missing = tmp_path / "nowhere"
    with pytest.raises(MeasurementError, match=re.escape(f"{missing}: not a folder of measurements")):
        load_measurements([missing], "h100-sxm")


def test_a_damaged_parquet_file_is_named(tmp_path):
    path = tmp_path / "h100_sxm" / "gemm_perf.parquet"
    path.parent.mkdir()
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(MeasurementError, match=re.escape(f"{path}: cannot read as Parquet")):
        load_measurements([tmp_path], "h100-sxm")


# --- bad rows: an error naming file and row, or dropped and counted -------------------------

BAD_ROWS = {
    # case: (file stem, rows, bad 1-based row, message, drop reason)
    "zero latency": ("gemm_perf", [*GEMMS[:1], {**GEMMS[1], "latency": 0.0}, GEMMS[2]], 2,
                     "latency must be a positive number", "non-positive or missing latency"),
    "negative latency": ("gemm_perf", [*GEMMS[:2], {**GEMMS[2], "latency": -0.5}], 3,
                         "latency must be a positive number", "non-positive or missing latency"),
    "NaN latency": ("gemm_perf", [{**GEMMS[0], "latency": float("nan")}, *GEMMS[1:]], 1,
                    "latency must be a positive number", "non-positive or missing latency"),
    "missing latency": ("gemm_perf", [*GEMMS[:1], {**GEMMS[1], "latency": None}, GEMMS[2]], 2,
                        "latency must be a positive number", "non-positive or missing latency"),
    "infinite latency": ("gemm_perf", [*GEMMS[:2], {**GEMMS[2], "latency": float("inf")}], 3,
                         "latency must be a positive number", "non-positive or missing latency"),
    "unknown gemm dtype": ("gemm_perf", [*GEMMS[:2], {**GEMMS[2], "gemm_dtype": "int4"}], 3,
                           "unknown gemm_dtype 'int4'", "unknown gemm_dtype"),
    "zero size": ("gemm_perf", [{**GEMMS[0], "m": 0}, *GEMMS[1:]], 1,
                  "m must be a positive integer, got 0", "bad m"),
    "unknown kv dtype": ("generation_attention_perf",
                         [decode_row(), decode_row(step=2048, kv_cache_dtype="fp4")], 2,
                         "unknown kv_cache_dtype 'fp4'", "unknown kv_cache_dtype"),
    "heads not a multiple of kv heads": (
        "context_attention_perf", [prefill_row(), prefill_row(isl=1024),
                                   prefill_row(isl=2048, num_heads=30)], 3,
        "num_heads is not a multiple of num_key_value_heads",
        "num_heads is not a multiple of num_key_value_heads"),
    "zero kv heads": ("generation_attention_perf",
                      [decode_row(num_key_value_heads=0), decode_row(step=2048)], 1,
                      "num_key_value_heads must be a positive integer, got 0",
                      "bad num_key_value_heads"),
    "unknown allreduce dtype": ("custom_allreduce_perf",
                                [{"num_gpus": 2, "message_size": 1024, "latency": 0.004},
                                 {"num_gpus": 2, "message_size": 2048, "latency": 0.004,
                                  "allreduce_dtype": "int8"}], 2,
                                "unknown allreduce_dtype 'int8'", "unknown allreduce_dtype"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_row_is_an_error_naming_file_and_row(tmp_path, case):
    stem, rows, bad, message, _ = BAD_ROWS[case]
    path = write_aic(tmp_path / "h100_sxm" / f"{stem}.parquet", rows)
    with pytest.raises(MeasurementError) as exc:
        load_measurements([tmp_path], "h100-sxm")
    text = str(exc.value)
    assert text.startswith(f"{path}: row {bad}: "), text
    assert message in text and "--drop-bad-rows" in text and "\n" not in text


@pytest.mark.parametrize("case", BAD_ROWS)
def test_with_drop_bad_rows_the_bad_row_is_gone_and_counted(tmp_path, case):
    stem, rows, bad, _, reason = BAD_ROWS[case]
    path = write_aic(tmp_path / "h100_sxm" / f"{stem}.parquet", rows)
    ms = load_measurements([tmp_path], "h100-sxm", drop_bad_rows=True)
    (table,) = [t for t in ms.tables.values() if len(t)]
    kept = [i for i in range(1, len(rows) + 1) if i != bad]
    assert table.origin == [f"{path}: row {i}" for i in kept]
    assert ms.dropped == {reason: 1}
    assert np.isfinite(table["latency_s"]).all() and (table["latency_s"] > 0).all()


def test_a_row_bad_twice_is_dropped_once_and_every_row_is_accounted_for(tmp_path):
    rows = [{**GEMMS[0], "latency": 0.0, "gemm_dtype": "int4"},   # bad twice: counted once
            {**GEMMS[1], "latency": -1.0}, GEMMS[2],
            {"m": 1024, "n": 4096, "k": 4096, "gemm_dtype": "fp16", "latency": 0.06},
            {"m": 1024, "n": 4096, "k": 4096, "gemm_dtype": "float16", "latency": 0.08}]
    gemm_file(tmp_path, rows)
    ms = load_measurements([tmp_path], "h100-sxm", drop_bad_rows=True)
    assert ms.dropped == {"non-positive or missing latency": 2, "repeated measurements merged": 1}
    assert len(ms.table("gemm")) + sum(ms.dropped.values()) == len(rows)
    # fp16 and float16 are one dtype: their two rows are one point at the median
    assert ms.table("gemm")["latency_s"].tolist() == pytest.approx([20e-6, 70e-6])


def test_a_missing_column_is_an_error_even_when_dropping_rows(tmp_path):
    path = gemm_file(tmp_path, drop=("k",))
    for drop in (False, True):
        with pytest.raises(MeasurementError, match=f"^{re.escape(str(path))}: missing column\\(s\\) k$"):
            load_measurements([tmp_path], "h100-sxm", drop_bad_rows=drop)
    path.unlink()
    path = write_aic(tmp_path / "h100_sxm" / "gemm_perf.parquet", GEMMS, drop=("device",))
    with pytest.raises(MeasurementError, match="missing column\\(s\\) device"):
        load_measurements([tmp_path], "h100-sxm")


# --- duplicates ----------------------------------------------------------------------------


def test_a_repeated_point_is_an_error_naming_both_rows(tmp_path):
    path = gemm_file(tmp_path, [*GEMMS, {**GEMMS[1], "latency": 0.013}])
    with pytest.raises(MeasurementError) as exc:
        load_measurements([tmp_path], "h100-sxm")
    text = str(exc.value)
    assert text.startswith(f"{path}: row 4: the same point as {path}: row 2 ")
    assert "dtype=bf16, m=16, n=4096, k=4096" in text and "--drop-bad-rows" in text


def test_repeated_points_are_merged_into_their_median(tmp_path):
    rows = [{**GEMMS[0], "latency": 0.010}, GEMMS[1], {**GEMMS[0], "latency": 0.050},
            {**GEMMS[0], "latency": 0.012}, GEMMS[2],
            {**GEMMS[0], "gemm_dtype": "fp8", "latency": 0.007}]   # another dtype: another point
    path = gemm_file(tmp_path, rows)
    ms = load_measurements([tmp_path], "h100-sxm", drop_bad_rows=True)
    gemm = ms.table("gemm")
    assert ms.dropped == {"repeated measurements merged": 2}
    assert gemm.origin == [f"{path}: row {i}" for i in (1, 2, 5, 6)]
    assert gemm["latency_s"].tolist() == pytest.approx([12e-6, 11e-6, 20e-6, 7e-6])


def test_the_same_point_in_two_folders_is_merged_across_files(tmp_path):
    first = gemm_file(tmp_path / "run1", [{**GEMMS[0], "latency": 0.010}])
    gemm_file(tmp_path / "run2", [{**GEMMS[0], "latency": 0.020}, GEMMS[2]])
    with pytest.raises(MeasurementError, match=re.escape(f"row 1: the same point as {first}: row 1")):
        load_measurements([tmp_path / "run1", tmp_path / "run2"], "h100-sxm")
    ms = load_measurements([tmp_path / "run1", tmp_path / "run2"], "h100-sxm", drop_bad_rows=True)
    assert ms.table("gemm")["latency_s"].tolist() == pytest.approx([15e-6, 20e-6])
    assert ms.dropped == {"repeated measurements merged": 1}


def test_repeated_decode_attention_points_merge_per_kv_dtype(tmp_path):
    rows = [decode_row(latency=0.02), decode_row(latency=0.04), decode_row(latency=0.03),
            decode_row(kv_cache_dtype="fp8", latency=0.01)]
    write_aic(tmp_path / "h100_sxm" / "generation_attention_perf.parquet", rows)
    ms = load_measurements([tmp_path], "h100-sxm", drop_bad_rows=True)
    dec = ms.table("attn_decode")
    assert dec["kv_dtype"].tolist() == ["bf16", "fp8"]
    assert dec["latency_s"].tolist() == pytest.approx([3e-5, 1e-5])


def test_repeated_vidur_points_merge_every_operator(tmp_path):
    path = write_vidur_ops(tmp_path / "compute" / "h100" / "M.mlp.csv",
                           [{"num_tokens": 64, "num_tensor_parallel_workers": 1,
                             "mlp_up_proj": 0.1, "add": 0.01},
                            {"num_tokens": 64, "num_tensor_parallel_workers": 1,
                             "mlp_up_proj": 0.3, "add": 0.03}])
    same = f"{path}: row 2: the same point as {path}: row 1"
    with pytest.raises(MeasurementError, match=re.escape(same)):
        load_measurements([tmp_path], "h100-sxm")
    ops = load_measurements([tmp_path], "h100-sxm", drop_bad_rows=True).table("vidur_ops")
    assert ops["mlp_up_proj"].tolist() == pytest.approx([2e-4])
    assert ops["add"].tolist() == pytest.approx([2e-5])


# --- Vidur CSV cells -------------------------------------------------------------------------


@pytest.mark.parametrize("cell, column, message, reason", [
    ({"mlp_up_proj": "abc"}, "time_stats.mlp_up_proj.median", "must be a positive number",
     "non-positive or missing latency"),
    ({"add": ""}, "time_stats.add.median", "must be a positive number",
     "non-positive or missing latency"),
    ({"emb": "-0.1"}, "time_stats.emb.median", "must be a positive number",
     "non-positive or missing latency"),
    ({"num_tokens": "1.5"}, "num_tokens", "must be a positive integer", "bad num_tokens"),
])
def test_vidur_bad_cells_name_file_row_and_column(tmp_path, cell, column, message, reason):
    good = {"num_tokens": 1, "num_tensor_parallel_workers": 1}
    rows = [good, {"num_tokens": 2, "num_tensor_parallel_workers": 1, **cell},
            {"num_tokens": 4, "num_tensor_parallel_workers": 1}]
    path = write_vidur_ops(tmp_path / "compute" / "h100" / "M.mlp.csv", rows)
    with pytest.raises(MeasurementError) as exc:
        load_measurements([tmp_path], "h100-sxm")
    text = str(exc.value)
    assert text.startswith(f"{path}: row 2: {column} {message}"), text
    ms = load_measurements([tmp_path], "h100-sxm", drop_bad_rows=True)
    assert ms.table("vidur_ops")["num_tokens"].tolist() == [1, 4]
    assert ms.dropped == {reason: 1}


def test_vidur_missing_column_and_empty_file(tmp_path):
    path = write_vidur_ops(tmp_path / "compute" / "h100" / "M.mlp.csv",
                           [{"num_tokens": 1, "num_tensor_parallel_workers": 1}],
                           drop=("time_stats.attn_rope.median",))
    missing = f"{path}: missing column(s) time_stats.attn_rope.median"
    with pytest.raises(MeasurementError, match=re.escape(missing)):
        load_measurements([tmp_path], "h100-sxm", drop_bad_rows=True)
    path.write_text("")
    with pytest.raises(MeasurementError, match=re.escape(f"{path}: empty file")):
        load_measurements([tmp_path], "h100-sxm")


def test_a_ragged_vidur_row_is_named_and_dropped_when_dropping(tmp_path):
    """A truncated line is an unusable row like any other: an error naming it, or with
    drop_bad_rows dropped and counted (calibrate's --drop-bad-rows promises to "drop
    unusable rows")."""
    path = write_vidur_allreduce(tmp_path / "network" / "h100_dgx.all_reduce.csv",
                                 [{"num_workers": 2, "size": 2048, "median": 0.02},
                                  {"num_workers": 4, "size": 2048, "median": 0.03}])
    lines = path.read_text().splitlines()
    lines[2] = ",".join(lines[2].split(",")[:5])          # data row 2 cut short
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(MeasurementError, match=re.escape(f"{path}: row 2: 5 cells, the header has 12")):
        load_measurements([tmp_path], "h100-sxm")
    ms = load_measurements([tmp_path], "h100-sxm", drop_bad_rows=True)
    assert ms.table("vidur_allreduce")["num_gpus"].tolist() == [2]
    assert sum(ms.dropped.values()) == 1


# --- engine versions ------------------------------------------------------------------------


def test_tables_of_several_engine_versions_are_never_pooled(tmp_path):
    """The same GPU measured inside vLLM 0.14 and 0.24: an error naming both versions and
    the flag, unless one version is chosen; then only its rows are read."""
    gemm_file(tmp_path / "vllm-0.14", GEMMS)
    newer = [{**row, "latency": row["latency"] / 2, "version": "0.24.0"} for row in GEMMS]
    gemm_file(tmp_path / "vllm-0.24", newer)
    with pytest.raises(MeasurementError, match=r"h100-sxm: tables measured inside several engine "
                                               r"versions \(0\.14\.0 \(.*vllm-0\.14.*\); 0\.24\.0 "
                                               r"\(.*vllm-0\.24.*\)\).*--engine-version"):
        load_measurements([tmp_path], "h100-sxm")
    for version, rows in (("0.14.0", GEMMS), ("0.24.0", newer)):
        ms = load_measurements([tmp_path], "h100-sxm", engine_version=version)
        assert ms.table("gemm")["latency_s"].tolist() == pytest.approx(
            [r["latency"] * 1e-3 for r in rows])
    with pytest.raises(MeasurementError, match=r"no tables measured inside engine version '0\.14' "
                                               r".*the versions there: 0\.14\.0, 0\.24\.0"):
        load_measurements([tmp_path], "h100-sxm", engine_version="0.14")


def test_a_table_without_a_version_is_not_pooled_with_versioned_ones(tmp_path):
    """A user's table with its version column left out, beside vLLM 0.19 tables: it was
    pooled with them (the profile said 0.19.0, its source "VLLM ?"); an error naming it.
    Tables that all lack the column are still read, as one engine's."""
    gemm_file(tmp_path / "versioned", GEMMS)
    gemm_file(tmp_path / "bare", GEMMS, drop=("version",))
    with pytest.raises(MeasurementError, match=r"bare/h100_sxm/gemm_perf\.parquet: no version "
                                               r"column, beside tables measured inside vLLM "
                                               r"0\.14\.0: .*never pooled"):
        load_measurements([tmp_path], "h100-sxm")
    alone = load_measurements([tmp_path / "bare"], "h100-sxm")
    assert len(alone.table("gemm")) == len(GEMMS) and alone.engine_version is None


def test_a_real_gpu_folder_copied_elsewhere_still_loads(tmp_path):
    """NCCL's table takes its engine version from its aiconfigurator-vllm-X folder: copied
    out of it, it is no unversioned table to refuse beside the versioned ones."""
    import shutil

    from _gpu_tables import real_measurements

    release = real_measurements() / "aiconfigurator-vllm-0.14.0"
    shutil.copytree(release / "a100_sxm", tmp_path / "mine" / "a100_sxm")
    copied = load_measurements([tmp_path / "mine"], "a100-80gb", drop_bad_rows=True)
    in_place = load_measurements([release], "a100-80gb", drop_bad_rows=True)
    assert {f: len(t) for f, t in copied.tables.items()} == \
        {f: len(t) for f, t in in_place.tables.items()}


def test_a_table_in_seconds_is_refused_not_fitted_a_thousandfold_off(tmp_path):
    """aiconfigurator's latency column is in milliseconds: a table written in seconds was
    fitted (held-out MAPE 66,149%) and written as a profile, exit 0."""
    gemm_file(tmp_path, [{**row, "latency": row["latency"] / 1000} for row in GEMMS])
    with pytest.raises(MeasurementError, match=r"gemm_perf\.parquet: its median kernel time "
                                               r"reads .* ms, below any kernel launch .*in "
                                               r"milliseconds \(a table in seconds\?\)"):
        load_measurements([tmp_path], "h100-sxm")


def test_tables_no_family_reads_are_named_beside_the_ones_read(tmp_path):
    """A folder's MLA module tables (the whole attention module) are not read: calibrate
    said "no measurements" for MLA. They are named; another GPU's folder is not looked at."""
    gemm_file(tmp_path, GEMMS)
    (tmp_path / "h100_sxm" / "mla_context_module_perf.parquet").write_bytes(b"x")
    (tmp_path / "b200_sxm").mkdir()
    (tmp_path / "b200_sxm" / "mla_bmm_perf.parquet").write_bytes(b"x")
    assert load_measurements([tmp_path], "h100-sxm").unread == ("mla_context_module_perf.parquet",)


def test_a_table_of_several_engine_versions_is_an_error(tmp_path):
    gemm_file(tmp_path, [GEMMS[0], {**GEMMS[1], "version": "0.24.0"}])
    with pytest.raises(MeasurementError, match=r"gemm_perf\.parquet: rows measured inside several "
                                               r"engine versions \(0\.14\.0, 0\.24\.0\)"):
        load_measurements([tmp_path], "h100-sxm", engine_version="0.14.0")


def test_sliding_window_rows_are_left_out_and_the_engine_version_is_recorded(tmp_path):
    """vLLM 0.24 tables measure sliding-window attention at the same shapes as full
    attention (a `window_size` column): merged as repeats, a 128-token window's time would
    halve a long context's. Only window 0 (full attention) is read, and counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = write_aic(tmp_path / "h100_sxm" / "generation_attention_perf.parquet",
                     [decode_row(latency=0.30, version="0.24.0"),
                      decode_row(latency=0.01, version="0.24.0")])
    table = pq.read_table(path)
    pq.write_table(table.append_column("window_size", pa.array([0, 128], pa.int64())), path)
    ms = load_measurements([tmp_path], "h100-sxm")
    assert ms.table("attn_decode")["latency_s"].tolist() == pytest.approx([3e-4])
    assert ms.dropped == {"sliding-window attention rows (window_size > 0; not modelled)": 1}
    assert ms.engine_version == "0.24.0"
    gemm_file(tmp_path / "vidur-like", folder="h100_sxm", drop=("version",))
    assert load_measurements([tmp_path / "vidur-like"], "h100-sxm").engine_version is None


def test_prefill_rows_record_whether_the_timed_call_wrote_the_cache(tmp_path):
    """vLLM moved the KV-cache write out of the timed `impl.forward`: FlashAttention from
    0.16, FlashInfer and Triton by 0.19; so the 0.14 rows include it, 0.19 and 0.24 not."""
    from servelab.validation.measurements import forward_writes_cache

    assert forward_writes_cache("0.14.0", "vllm_flash_attn")
    assert not forward_writes_cache("0.16.0", "vllm_flash_attn")
    assert not forward_writes_cache("0.24.0", "vllm_flash_attn_fa3")
    assert forward_writes_cache("0.14.0", "vllm_flashinfer")
    assert forward_writes_cache("0.17.1", "vllm_flashinfer")
    assert not forward_writes_cache("0.19.0", "vllm_flashinfer")
    assert not forward_writes_cache("0.24.0", "vllm_flashinfer_trtllmprefill")
    assert forward_writes_cache("?", "vllm_flash_attn") and forward_writes_cache("0.24.0", "")
    write_aic(tmp_path / "h100_sxm" / "context_attention_perf.parquet",
              [prefill_row(version="0.19.0"),
               prefill_row(isl=1024, version="0.19.0", kernel_source="custom_kernel")])
    t = load_measurements([tmp_path], "h100-sxm").table("attn_prefill")
    assert dict(zip(t["tokens"].tolist(), t["writes_cache"].tolist())) == {512: False, 1024: True}
