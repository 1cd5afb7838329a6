"""Calibration profiles per engine version: which packaged profile prices a GPU under a
vLLM version (`profile_for`), `resolve` with an engine version, and the version a profile
names (written, read back, checked).

The rules under test (`calibration.profile_for`): the GPU's own profile at that version,
else its own at the nearest version (a tie goes to the newer), else the profile of the GPU
its catalog entry borrows from at that version or the nearest, else the bare roofline.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from servelab.simulator import kernels as K
from servelab.simulator.calibration import (
    ENGINE_VERSIONS, CalibrationProfile, packaged, packaged_choice, packaged_names, profile_for,
    resolve, version_key)
from servelab.simulator.gpus import get_gpu

# (GPU, engine version) -> (packaged profile, words its explanation must hold)
CHOICES = {
    ("h100-sxm", "0.14.0"): ("h100-sxm", "h100-sxm kernels measured inside vLLM 0.14.0"),
    ("h100-sxm", "0.24.0"): ("h100-sxm.vllm-0.24", "h100-sxm kernels measured inside vLLM 0.24.0"),
    ("h100-sxm", "0.24"): ("h100-sxm.vllm-0.24", "measured inside vLLM 0.24.0"),
    # 0.14 and 0.24 are both five minor versions away: the tie goes to the newer
    ("h100-sxm", "0.19.0"): ("h100-sxm.vllm-0.24", "nearest engine version measured on this GPU"),
    ("b200", "0.24.0"): ("b200.vllm-0.24", "b200 kernels measured inside vLLM 0.24.0"),
    ("b200", "0.14.0"): ("b200.vllm-0.24", "carried over: no b200 tables for vLLM 0.14.0; "
                                           "b200's vLLM 0.24.0 profile"),
    ("rtx-pro-6000", "0.19.0"): ("rtx-pro-6000.vllm-0.19", "measured inside vLLM 0.19.0"),
    ("rtx-pro-6000", "0.24.0"): ("rtx-pro-6000.vllm-0.19", "nearest engine version"),
    ("h200", "0.24.0"): ("h100-sxm.vllm-0.24", "carried over: no h200 tables; h100-sxm's vLLM 0.24.0"),
    ("b300", "0.24.0"): ("b200.vllm-0.24", "carried over: no b300 tables; b200's vLLM 0.24.0"),
    ("gb200", "0.19.0"): ("b200.vllm-0.24", "no gb200 tables, no b200 tables for vLLM 0.19.0"),
    ("h200", "0.14.0"): ("h100-sxm", "h100-sxm's vLLM 0.14.0"),
    ("h200", "0.20.0"): ("h100-sxm.vllm-0.24", "h100-sxm's vLLM 0.24.0"),
    ("rtx-4090", "0.19.0"): ("l40s", "no l40s tables for vLLM 0.19.0; l40s's vLLM 0.14.0"),
    ("a100-80gb", "0.24.0"): ("a100-80gb", "nearest engine version measured on this GPU"),
    ("cpu", "0.24.0"): ("none", "bare roofline"),
}


@pytest.mark.parametrize("gpu, version", sorted(CHOICES))
def test_profile_for_follows_the_rules(gpu, version):
    name, words = CHOICES[(gpu, version)]
    chosen, line = packaged_choice(gpu, version)
    assert chosen == name and words in line, line
    profile, why = profile_for(get_gpu(gpu), version)
    assert why == line and "\n" not in why
    if name == "none":
        assert profile.kernels == K.KernelParams.roofline()
    else:
        assert profile is packaged(name)
        assert resolve(gpu, engine_version=version) is profile


def test_engine_versions_are_the_packaged_ones_newest_last():
    versions = {packaged(n).engine_version for n in packaged_names()}
    assert set(ENGINE_VERSIONS) == versions
    assert list(ENGINE_VERSIONS) == sorted(ENGINE_VERSIONS, key=version_key)


def test_without_an_engine_version_resolve_is_the_catalog_default():
    for gpu in ("h100-sxm", "h200", "a100-80gb", "l40s", "b200", "b300", "gb200", "rtx-pro-6000",
                "rtx-4090"):
        spec = get_gpu(gpu)
        assert resolve(gpu) is packaged(spec.calibration)
    assert resolve("h100-sxm").engine_version == "0.14.0"   # `--calibration h100-sxm` as before


def test_a_chosen_profile_of_another_engine_version_is_one_clear_line():
    with pytest.raises(ValueError) as info:
        resolve("h100-sxm", "h100-sxm", engine_version="0.24.0")
    message = str(info.value)
    assert "\n" not in message
    assert "vLLM 0.14.0, not the chosen engine's 0.24.0" in message
    assert "h100-sxm.vllm-0.24" in message          # what to use instead
    # the same version, written either way, is accepted; so is an unknown one on either side
    assert resolve("h100-sxm", "h100-sxm.vllm-0.24", engine_version="0.24").engine_version == "0.24.0"
    unknown = CalibrationProfile(device="h100-sxm", kernels=packaged("h100-sxm").kernels)
    assert resolve("h100-sxm", unknown, engine_version="0.24.0") is unknown
    assert resolve("h100-sxm", "h100-sxm") is packaged("h100-sxm")
    assert resolve("h100-sxm", "none", engine_version="0.24.0").engine_version is None


def test_a_borrowed_profile_of_any_version_is_accepted_and_anothers_is_not():
    assert resolve("h200", "h100-sxm.vllm-0.24").device == "h100-sxm"
    with pytest.raises(ValueError, match="profile is for device 'b200', not 'h200'.*fit one for h200"):
        resolve("h200", "b200.vllm-0.24")
    # B200 has measured kernels of its own now: Hopper's are no longer its to borrow
    with pytest.raises(ValueError, match="not 'b200' \\(which has its own, e.g. b200.vllm-0.24\\)"):
        resolve("b200", "h100-sxm")


@pytest.mark.parametrize("bad", ["latest", "0.x", "", "1.2.3.4", "v0.24"])
def test_bad_engine_versions_name_the_known_ones(bad):
    with pytest.raises(ValueError, match="must be a version such as 0.24.0.*0.14.0, 0.19.0, 0.24.0"):
        resolve("h100-sxm", engine_version=bad)


def test_engine_version_round_trips_and_old_files_read_as_unknown(tmp_path):
    profile = packaged("b200.vllm-0.24")
    assert profile.engine_version == "0.24.0"
    path = profile.save(tmp_path / "b200.json")
    assert json.loads(path.read_text())["engine_version"] == "0.24.0"
    assert CalibrationProfile.load(path) == profile
    data = profile.to_dict()
    del data["engine_version"]          # a file written before profiles named their engine
    assert CalibrationProfile.from_dict(data).engine_version is None
    data["engine_version"] = "nightly"
    with pytest.raises(ValueError, match="field 'engine_version' must be a version"):
        CalibrationProfile.from_dict(data)


def test_packaged_profiles_name_the_tables_of_their_engine_version():
    for name in packaged_names():
        profile = packaged(name)
        version = profile.engine_version
        assert f"vllm {version}" in profile.source["kernels.gemm"].lower(), name
        assert f"aiconfigurator-vllm-{version}" in profile.source["kernels.attn_decode"], name
        # several versions of one GPU coexist: <gpu>.json is vLLM 0.14.0, the others say theirs
        expected = profile.device if version == "0.14.0" else \
            f"{profile.device}.vllm-{'.'.join(version.split('.')[:2])}"
        assert name == expected


def test_softmax_time_per_pair_is_independent_of_head_dim_and_off_by_default():
    """`pair_head_s` (what Blackwell's attention kernels spend on the softmax) adds the
    same seconds per (query, key) pair and query head at any head dimension; 0, the
    default and what a profile written before it reads as, changes nothing."""
    gpu = get_gpu("b200")
    base = K.PrefillAttentionParams(floor_s=1e-5, compute_eff=0.6, memory_eff=0.5)
    soft = K.PrefillAttentionParams(floor_s=1e-5, compute_eff=0.6, memory_eff=0.5,
                                    pair_head_s=2e-13)
    seqs, q = 4, 1000
    pairs = seqs * 0.5 * (q * q + q)
    for head_dim in (64, 128):
        args = (seqs, seqs * q, 0.0, seqs * q * q, 0.0, 32, 8, head_dim, gpu)
        extra = K.prefill_attention_time(*args, soft) - K.prefill_attention_time(*args, base)
        assert extra == pytest.approx(pairs * 32 * 2e-13, rel=1e-9)
    written = base.to_dict()
    del written["pair_head_s"]
    assert K.PrefillAttentionParams.from_dict(written, "old profile") == base
    with pytest.raises(ValueError, match="missing field.*compute_eff"):
        K.PrefillAttentionParams.from_dict({k: v for k, v in written.items()
                                            if k != "compute_eff"}, "old profile")


def test_a_padded_tile_pair_pays_the_softmax_as_a_real_pair_does():
    """The pairs a partly filled query tile wastes (`padded_tile_pairs` per sequence and
    thread-block head) go through the softmax too: `pair_head_s` is added for them as for
    the real pairs, per query head without head packing and per KV head with it."""
    gpu = get_gpu("b200")
    seqs, q, heads, kv_heads, padded = 6, 40, 32, 8, 5000.0
    pairs = seqs * 0.5 * (q * q + q)
    for packs, block_heads in ((0.0, heads), (1.0, kv_heads)):
        base = K.PrefillAttentionParams(floor_s=1e-5, compute_eff=0.6, memory_eff=0.5,
                                        padded_tile_pairs=padded, packs_gqa=packs)
        soft = dataclasses.replace(base, pair_head_s=2e-13)
        args = (seqs, seqs * q, 0.0, seqs * q * q, 0.0, heads, kv_heads, 128, gpu)
        extra = K.prefill_attention_time(*args, soft) - K.prefill_attention_time(*args, base)
        assert extra == pytest.approx((pairs * heads + seqs * block_heads * padded) * 2e-13,
                                      rel=1e-9)


def test_a_benchmark_without_the_cache_write_drops_exactly_its_bytes():
    """`cache_write=False` (a timed attention kernel that no longer writes the cache) takes
    the write's read and store of every new token's K and V off the memory term, per row
    when given an array; serving (the default) keeps it."""
    gpu = get_gpu("h100-sxm")
    p = K.PrefillAttentionParams(floor_s=1e-5, compute_eff=0.6, memory_eff=0.5)
    seqs, q, kv_heads, head_dim = 2, 512, 8, 128
    args = (seqs, seqs * q, 0.0, seqs * q * q, 0.0, 32, kv_heads, head_dim, gpu, p)
    serving = K.prefill_attention_time(*args)
    bench = K.prefill_attention_time(*args, cache_write=False)
    write = seqs * q * 2 * (2 * kv_heads * head_dim * 2.0) / (gpu.hbm_bandwidth_gbps * 1e9 * 0.5)
    assert serving - bench == pytest.approx(write, rel=1e-9)
    rows = K.prefill_attention_time(*args, cache_write=np.array([True, False]))
    assert rows.tolist() == pytest.approx([float(serving), float(bench)])
