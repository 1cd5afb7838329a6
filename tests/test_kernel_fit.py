"""Fitting kernel families: the held-out split, glitches, recovery of known parameters,
the profile `calibrate` writes, and one end-to-end fit on the real H100 tables.

Recovery tables are priced by the family's own `predict` with known parameters, so the
fit must find predictions that match to rounding; parameters the shapes cannot tell apart
are compared through their predictions, and only well-identified ones (a floor, a
large-problem efficiency) directly.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, replace

import numpy as np
import pytest
from _gpu_tables import real_measurements

from servelab.outputs import BatchShape
from servelab.simulator import kernels as K
from servelab.simulator.calibration import CalibrationProfile, bare_roofline, packaged, profile_for, resolve
from servelab.simulator.cost_model import CostModel
from servelab.simulator.gpus import get_gpu
from servelab.validation.kernel_fit import (
    ASSUMED_HOST_LINK, FAMILIES, GLITCH_RATIO, SPLIT_KEYS, calibrate, family_table,
    fit_family, glitches, holdout_mask, judge)
from servelab.validation.measurements import MeasurementSet, Table, load_measurements

H100 = get_gpu("h100-sxm")


def gemm_table(shapes, dtypes=("bf16",), latency=None) -> Table:
    rows = [(d, m, n, k) for (m, n, k) in shapes for d in dtypes]
    d, m, n, k = (np.array(c) for c in zip(*rows))
    lat = np.full(len(rows), 1e-5) if latency is None else np.asarray(latency, dtype=float)
    return Table("gemm", {"dtype": d.astype(object), "m": m, "n": n, "k": k, "latency_s": lat},
                 [f"synthetic: row {i + 1}" for i in range(len(rows))])


def decode_table(rows) -> Table:
    """rows: (batch, context, heads, kv_heads); head_dim 128, BF16 KV."""
    b, c, h, kv = (np.array(col) for col in zip(*rows))
    n = len(rows)
    return Table("attn_decode", {"batch": b, "context": c, "heads": h, "kv_heads": kv,
                                 "head_dim": np.full(n, 128), "kv_dtype": np.array(["bf16"] * n, object),
                                 "latency_s": np.zeros(n)},
                 [f"synthetic: row {i + 1}" for i in range(n)])


GRID = list(itertools.product(2 ** np.arange(15), (1024, 2048, 4096, 8192, 14336, 28672),
                              (1024, 2048, 4096, 5120, 8192, 14336)))      # 540 shapes


# --- the held-out split ----------------------------------------------------------------------


def held_shapes(table: Table, mask: np.ndarray) -> set:
    return {tuple(table[c][i] for c in ("dtype", "m", "n", "k")) for i in np.flatnonzero(mask)}


def test_holdout_is_deterministic_and_independent_of_row_order():
    table = gemm_table(GRID, dtypes=("bf16", "fp8"))
    mask = holdout_mask(table, 0.3, seed=7)
    assert np.array_equal(mask, holdout_mask(table, 0.3, seed=7))
    order = np.random.default_rng(0).permutation(len(table))
    shuffled = Table("gemm", {c: v[order] for c, v in table.columns.items()},
                     [table.origin[i] for i in order])
    assert held_shapes(shuffled, holdout_mask(shuffled, 0.3, seed=7)) == held_shapes(table, mask)
    assert not np.array_equal(mask, holdout_mask(table, 0.3, seed=8))


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5])
def test_holdout_holds_out_about_the_fraction_asked(fraction):
    table = gemm_table(GRID)
    share = holdout_mask(table, fraction, seed=0).mean()
    assert abs(share - fraction) < 0.05, share     # 540 shapes: 3 sigma is about 0.06 at 0.5


def test_holdout_is_keyed_by_shape_not_dtype():
    """A GEMM shape held out in BF16 is held out in FP8 too: an FP8 check is on unseen shapes."""
    assert SPLIT_KEYS["gemm"] == ("m", "n", "k")
    table = gemm_table(GRID, dtypes=("bf16", "fp8"))
    mask = holdout_mask(table, 0.3, seed=1)
    assert np.array_equal(mask[0::2], mask[1::2])      # rows alternate bf16, fp8 per shape
    assert 0 < mask.sum() < len(mask)


def test_holdout_extremes_and_bad_fractions():
    table = gemm_table(GRID)
    assert not holdout_mask(table, 0.0).any()
    assert holdout_mask(table, 0.999999).mean() > 0.99
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="holdout fraction must be in \\[0, 1\\)"):
            holdout_mask(table, bad)


# --- glitches ----------------------------------------------------------------------------------


def monotone(shapes):
    """A latency that grows with every dimension."""
    return [1e-6 * (1 + m * n * k / 1e9 + n * k / 1e7) for m, n, k in shapes]


def test_a_monotone_table_has_no_glitches():
    shapes = list(itertools.product((1, 16, 256, 4096), (1024, 4096), (1024, 8192)))
    table = gemm_table(shapes, latency=monotone(shapes))
    assert not glitches(table, ("m", "n", "k")).any()


def test_a_point_much_slower_than_a_strictly_larger_problem_is_a_glitch():
    shapes = list(itertools.product((1, 16, 256, 4096), (1024, 4096), (1024, 8192)))
    lat = np.array(monotone(shapes))
    i = shapes.index((16, 1024, 1024))
    j = shapes.index((256, 1024, 1024))       # larger in m only
    lat[i] = lat[j] * (GLITCH_RATIO + 0.1)
    table = gemm_table(shapes, latency=lat)
    assert np.flatnonzero(glitches(table, ("m", "n", "k"))).tolist() == [i]
    lat[i] = lat[j] * (GLITCH_RATIO - 0.1)    # slower than a larger problem, but within 1.3x
    assert not glitches(gemm_table(shapes, latency=lat), ("m", "n", "k")).any()


def test_glitches_compare_only_comparable_problems():
    """Larger in n but smaller in k is not a larger problem; another dtype is another kernel."""
    shapes = [(1, 8192, 1024), (1, 4096, 2048)]
    table = gemm_table(shapes, latency=[10e-6, 1e-6])
    assert not glitches(table, ("m", "n", "k")).any()
    two = gemm_table([(1, 4096, 4096)], dtypes=("bf16", "fp8"), latency=[10e-6, 1e-6])
    bigger_fp8 = gemm_table([(2, 4096, 4096)], dtypes=("fp8",), latency=[1e-6])
    table = Table.concat("gemm", [two, bigger_fp8])
    assert not glitches(table, ("m", "n", "k")).any()          # bf16 has nothing larger
    table.columns["latency_s"][1] = 5e-6                         # fp8 m=1 vs fp8 m=2 at 1 us
    assert np.flatnonzero(glitches(table, ("m", "n", "k"))).tolist() == [1]


# --- recovery of known parameters ------------------------------------------------------------

GEMM_TRUTH = K.GemmParams(floor_s=6e-6, compute_eff=0.62, memory_eff=0.9, overlap=1.8,
                          k_step_s=5e-10)


def test_gemm_fit_recovers_known_parameters():
    fam = FAMILIES["gemm"]
    table = gemm_table(GRID[::3])
    table.columns["latency_s"] = fam.predict(table, H100, GEMM_TRUTH)
    mask = holdout_mask(table, 0.3, seed=0)
    fit = fit_family(fam, table, H100, mask, K.GemmParams())
    assert fit.glitch_rows == 0 and fit.heldout_rows == mask.sum() > 20
    assert fit.stats["heldout"]["mape_pct"] < 0.01
    held = table.select(mask)
    assert fam.predict(held, H100, fit.params) == pytest.approx(held["latency_s"], rel=1e-4)
    assert fit.params.floor_s == pytest.approx(GEMM_TRUTH.floor_s, rel=0.01)
    assert fit.params.compute_eff == pytest.approx(GEMM_TRUTH.compute_eff, rel=0.01)


def test_gemm_fit_ignores_glitches_in_the_training_rows():
    """Training points made 3x slower than a larger problem are flagged and left out: the
    parameters come out as if they were not there."""
    fam = FAMILIES["gemm"]
    table = gemm_table(GRID[::3])
    table.columns["latency_s"] = fam.predict(table, H100, GEMM_TRUTH)
    mask = holdout_mask(table, 0.3, seed=0)
    small = np.flatnonzero(~mask & (table["m"] <= 64))[:6]
    table.columns["latency_s"][small] *= 3.0
    fit = fit_family(fam, table, H100, mask, K.GemmParams())
    assert fit.glitch_rows == len(small) == 6
    # the menu's minimum makes the loss ragged: the fit lands within a hair of the truth
    assert fit.stats["heldout"]["mape_pct"] < 1.0
    assert fit.params.floor_s == pytest.approx(GEMM_TRUTH.floor_s, rel=0.05)
    keep = np.ones(len(table), dtype=bool)
    keep[small] = False
    without = fit_family(fam, table.select(keep), H100, mask[keep], K.GemmParams())
    held = table.select(mask)
    assert fam.predict(held, H100, fit.params) == pytest.approx(
        fam.predict(held, H100, without.params), rel=0.02)


def _decode_grid():
    """Decode shapes: batches 1-256 x contexts 128-32k x four head layouts."""
    rows = itertools.product((1, 2, 4, 8, 16, 32, 64, 128, 256), (128, 512, 2048, 8192, 32768),
                             ((32, 8), (64, 8), (32, 32), (40, 8)))
    return decode_table([(b, c, h, kv) for b, c, (h, kv) in rows])


def test_decode_attention_fit_recovers_known_predictions():
    fam = FAMILIES["attn_decode"]
    truth = replace(K.DecodeAttentionParams(
        floor_s=1.4e-5, seq_head_s=8e-9, work_item_s=1.5e-8, q_head_s=2e-10, memory_eff=0.82,
        head_stream_gbps=600.0, batch_saturation=6.0, l2_gain=1.15), **fam.fixed(H100))
    table = _decode_grid()
    table.columns["latency_s"] = fam.predict(table, H100, truth)
    mask = holdout_mask(table, 0.3, seed=0)
    fit = fit_family(fam, table, H100, mask, K.DecodeAttentionParams())
    assert fit.stats["heldout"]["mape_pct"] < 0.01
    held = table.select(mask)
    assert fam.predict(held, H100, fit.params) == pytest.approx(held["latency_s"], rel=1e-4)
    assert fit.params.floor_s == pytest.approx(truth.floor_s, rel=0.01)
    assert fit.params.memory_eff == pytest.approx(truth.memory_eff, rel=0.01)
    # Hopper runs one split-KV path: what the GPU fixes is not fitted
    assert (fit.params.split_floor_s, fit.params.mha_block_gbps) == (0.0, 0.0)


def test_decode_fit_tells_flash_attention_2s_copies_from_its_merge():
    """On a FlashAttention 2 GPU the short-context floor has three parts: the launch, the
    split-KV merge (past one KV block while the items leave SMs idle) and the grouped-query
    copies (two sequences and two KV heads on). Rows that separate them (one sequence or
    one KV head, one block or several) give each back."""
    fam = FAMILIES["attn_decode"]
    a100 = get_gpu("a100-80gb")
    truth = replace(K.DecodeAttentionParams(
        floor_s=1.2e-5, split_floor_s=5e-6, gqa_copy_s=6e-6, seq_head_s=6e-9,
        work_item_s=2.8e-8, q_head_s=4e-10, memory_eff=0.74, head_stream_gbps=330.0,
        mha_block_gbps=22.0), **fam.fixed(a100))
    rows = itertools.product((1, 2, 4, 8, 16, 64, 128, 256), (1, 63, 255, 2048, 8192),
                             ((8, 1), (8, 2), (32, 8), (32, 32)))
    table = decode_table([(b, c, h, kv) for b, c, (h, kv) in rows])
    table.columns["latency_s"] = fam.predict(table, a100, truth)
    mask = holdout_mask(table, 0.3, seed=0)
    fit = fit_family(replace(fam, alternatives=lambda gpu: ()), table, a100, mask,
                     K.DecodeAttentionParams())
    assert fit.stats["heldout"]["mape_pct"] < 0.05
    for name in ("floor_s", "split_floor_s", "gqa_copy_s"):
        assert getattr(fit.params, name) == pytest.approx(getattr(truth, name), rel=0.02), name


def test_decode_fit_picks_the_kernel_path_the_measurements_show():
    """A Blackwell GPU may run FlashAttention 2's two decode paths (vLLM 0.14 on older
    GPUs) or one split-KV path for every head layout (TRT-LLM's decode in vLLM 0.24 on
    B200): data made by the one-path kernel is fitted by that alternative, exactly."""
    fam = FAMILIES["attn_decode"]
    b200 = get_gpu("b200")
    truth = K.DecodeAttentionParams(
        floor_s=9e-6, seq_head_s=2e-9, work_item_s=8e-9, q_head_s=2e-10, memory_eff=0.89,
        head_stream_gbps=1500.0, batch_saturation=3.0, l2_gain=1.4)
    table = _decode_grid()
    table.columns["latency_s"] = fam.predict(table, b200, truth)
    mask = holdout_mask(table, 0.3, seed=0)
    fit = fit_family(fam, table, b200, mask, K.DecodeAttentionParams())
    assert fit.stats["heldout"]["mape_pct"] < 0.05
    assert (fit.params.split_floor_s, fit.params.mha_block_gbps) == (0.0, 0.0)
    # and the choice matters: the two-path model alone cannot price it
    two_paths = fit_family(replace(fam, alternatives=lambda gpu: ()), table, b200, mask,
                           K.DecodeAttentionParams())
    assert two_paths.stats["heldout"]["mape_pct"] > 20 * fit.stats["heldout"]["mape_pct"]


# --- calibrate: the profile and its provenance ------------------------------------------------


def synthetic_set(dropped=None) -> MeasurementSet:
    fam = FAMILIES["gemm"]
    table = gemm_table(GRID[::3])
    table.columns["latency_s"] = fam.predict(table, H100, GEMM_TRUTH)
    return MeasurementSet("h100-sxm", {"gemm": table}, {"gemm": "synthetic: gemm_perf (test)"},
                          dict(dropped or {}))


def test_calibrate_records_provenance_split_and_fallback():
    fallback = packaged("a100-80gb")
    ms = synthetic_set(dropped={"repeated measurements merged": 3})
    result = calibrate(ms, seed=5, holdout=0.25, fallback=fallback, data_version="synthetic v1")
    p = result.profile
    assert p.device == "h100-sxm" and set(result.families) == {"gemm"}
    assert p.source["kernels.gemm"] == "synthetic: gemm_perf (test)"
    assert p.source["data"] == "synthetic v1" and p.source["gpu"] == "h100-sxm"
    assert p.source["kernels.gemm_fp8"] == "no FP8 GEMM measurements: the BF16 GEMM parameters"
    assert p.kernels.gemm_fp8 == p.kernels.gemm == result.families["gemm"].params
    for name in ("attn_prefill", "attn_decode", "collective", "elementwise"):
        assert getattr(p.kernels, name) == getattr(fallback.kernels, name)
        assert p.source[f"kernels.{name}"] == ("no measurements on h100-sxm: carried from the "
                                               "a100-80gb profile")
    assert p.kernels.host_link == ASSUMED_HOST_LINK and "assumption" in p.source["kernels.host_link"]
    stats = p.fit_stats
    assert (stats["holdout_seed"], stats["holdout_fraction"]) == (5, 0.25)
    assert stats["gemm.rows"] == len(ms.table("gemm"))
    assert stats["gemm.heldout_mape_pct"] < 1.0       # synthetic truth, ragged loss: near it
    assert stats["dropped.repeated measurements merged"] == 3
    # the recorded seed and fraction reproduce the split the fit used
    mask = holdout_mask(ms.table("gemm"), stats["holdout_fraction"], int(stats["holdout_seed"]))
    assert result.families["gemm"].heldout_rows == mask.sum()


def test_calibrate_without_a_fallback_says_bare_roofline():
    result = calibrate(synthetic_set(), seed=0)
    p = result.profile
    bare = K.KernelParams.roofline()
    for name in ("attn_prefill", "attn_decode", "collective", "elementwise"):
        assert getattr(p.kernels, name) == getattr(bare, name)
        assert p.source[f"kernels.{name}"] == "no measurements: bare roofline"
    assert "data" not in p.source
    assert not any(k.startswith("dropped.") for k in p.fit_stats)


def test_calibrate_takes_gemm_from_the_fallback_when_too_few_points():
    """Fewer than two points per fitted parameter: not fitted, carried over."""
    ms = synthetic_set()
    ms.tables["gemm"] = ms.table("gemm").select(np.arange(len(ms.table("gemm"))) < 9)
    fallback = packaged("a100-80gb")
    p = calibrate(ms, fallback=fallback).profile
    assert p.kernels.gemm == fallback.kernels.gemm
    assert p.kernels.gemm_fp8 == fallback.kernels.gemm_fp8
    assert "gemm.heldout_mape_pct" not in p.fit_stats


def test_a_gpu_file_outside_the_catalog_is_calibrated_and_priced_by_its_own_profile(tmp_path):
    """docs/extending.md: your own GPU is a JSON file anywhere; `calibrate --gpu FILE` fits
    it (it is not in the catalog, so the spec is passed along, not looked up by name), and
    the file's "calibration" may name the profile file beside it."""
    import json

    spec = dict(asdict(H100), name="my-h100", calibration=None, aliases=[])
    gpu_file = tmp_path / "my-h100.json"
    gpu_file.write_text(json.dumps(spec))
    ms = synthetic_set()
    ms.gpu = "my-h100"
    with pytest.raises(ValueError, match="unknown GPU 'my-h100'"):
        calibrate(ms)                                   # by name alone: not in the catalog
    profile = calibrate(ms, gpu=get_gpu(str(gpu_file))).profile
    assert profile.device == "my-h100"
    profile_file = profile.save(tmp_path / "my-h100.profile.json")
    spec["calibration"] = "my-h100.profile.json"        # relative to the GPU file's folder
    gpu_file.write_text(json.dumps(spec))
    model = CostModel("llama-3.1-8b", str(gpu_file))
    assert model.profile.device == "my-h100"
    assert model.profile.kernels.gemm == profile.kernels.gemm
    chosen, line = profile_for(str(gpu_file), "0.24.0")
    assert chosen.kernels.gemm == profile.kernels.gemm and str(profile_file) in line
    # a copy of the GPU file elsewhere, its profile not beside it: a profile given
    # explicitly still prices it (the file's own is never read), and leaving it out names
    # the missing file
    moved = tmp_path / "elsewhere" / "my-h100.json"
    moved.parent.mkdir()
    moved.write_text(gpu_file.read_text())
    assert CostModel("llama-3.1-8b", str(moved), calibration="none").profile.kernels.gemm \
        == bare_roofline("my-h100").kernels.gemm
    given = CostModel("llama-3.1-8b", str(moved), calibration=str(profile_file))
    assert given.profile.kernels.gemm == profile.kernels.gemm
    with pytest.raises(ValueError, match="cannot read calibration profile .*elsewhere/my-h100.profile.json"):
        CostModel("llama-3.1-8b", str(moved))


# --- the real H100 tables ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def h100_gemm_fit():
    """The real H100 GEMM table (every dtype, so FP8 is fitted too), fitted as calibrate
    does on a sample of 600 training points per family (the full fit takes minutes; the
    judgement still uses every held-out point)."""
    ms = load_measurements([real_measurements()], "h100-sxm", drop_bad_rows=True,
                           engine_version="0.14.0")
    gemm_only = MeasurementSet(ms.gpu, {"gemm": ms.table("gemm")},
                               {"gemm": ms.sources["gemm"]}, ms.dropped)
    return gemm_only, calibrate(gemm_only, seed=0, max_points=600)


def test_real_h100_gemm_fit_beats_the_bare_roofline_on_held_out_shapes(h100_gemm_fit):
    ms, result = h100_gemm_fit
    fam = FAMILIES["gemm"]
    table = family_table(ms, fam)
    assert len(table) > 5000
    mask = holdout_mask(table, 0.3, seed=0)
    fitted = result.families["gemm"]
    bare = judge(fam, table, H100, K.KernelParams.roofline().gemm, mask)
    fitted_mape, bare_mape = fitted.stats["heldout"]["mape_pct"], bare.stats["heldout"]["mape_pct"]
    assert fitted.heldout_rows == mask.sum()
    assert fitted_mape < 15.0 and fitted_mape < bare_mape / 3, (fitted_mape, bare_mape)
    # the roofline is never slower than a real kernel: its median error is negative
    assert bare.stats["heldout"]["median_pct"] < -10
    assert abs(fitted.stats["heldout"]["median_pct"]) < 3
    assert "gemm_perf.parquet" in result.profile.source["kernels.gemm"]
    assert 0.5 < fitted.params.compute_eff <= 1.0 and 1e-6 < fitted.params.floor_s < 2e-5


def test_real_h100_profile_round_trips_through_a_file(h100_gemm_fit, tmp_path):
    _, result = h100_gemm_fit
    path = result.profile.save(tmp_path / "h100-sxm.json")
    loaded = CalibrationProfile.load(path)
    assert loaded == result.profile
    assert resolve("h100-sxm", str(path)) == result.profile
    shape = BatchShape(num_prefill_seqs=1, num_prefill_tokens=512, prefill_q_sq_sum=512 * 512,
                       num_decode_seqs=16, decode_context_sum=16 * 1000)
    from_file = CostModel("llama-3.1-8b", "h100-sxm", calibration=str(path))
    in_memory = CostModel("llama-3.1-8b", "h100-sxm", calibration=result.profile)
    assert from_file.step_time(shape) == in_memory.step_time(shape)


def test_a_table_of_one_head_dim_does_not_fit_how_decode_grows_with_it():
    """`item_dim_share` changes nothing at head_dim 128: a table of that width alone sets
    it to 0 instead of fitting it (`Family.untold`); a table of two widths fits it."""
    fam = FAMILIES["attn_decode"]
    truth = K.DecodeAttentionParams(floor_s=6e-6, split_floor_s=4e-6, work_item_s=2e-8,
                                    q_head_s=3e-10, memory_eff=0.9, head_stream_gbps=400.0,
                                    batch_saturation=4.0, item_dim_share=0.5)
    rows = [(b, c, h, kv) for b in (1, 8, 64, 256) for c in (16, 256, 2048, 16384)
            for h, kv in ((32, 8), (64, 8))]
    one = decode_table(rows)
    one.columns["latency_s"] = fam.predict(one, H100, truth)
    fitted = fit_family(fam, one, H100, holdout_mask(one), truth).params
    assert fitted.item_dim_share == 0.0
    two = Table.concat("attn_decode", [one, replace_head_dim(decode_table(rows), 64)])
    two.columns["latency_s"] = fam.predict(two, H100, truth)
    assert fit_family(fam, two, H100, holdout_mask(two), truth).params.item_dim_share > 0.1


def replace_head_dim(table: Table, head_dim: int) -> Table:
    table.columns["head_dim"] = np.full(len(table), head_dim)
    return table
