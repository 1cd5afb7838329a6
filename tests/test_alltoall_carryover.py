"""The EP exchange of a GPU measured without all-to-all tables (issue 34).

Such a GPU's exchange is priced from its own fitted NCCL ring all-reduce
(`kernels.movement.alltoall_from_ring`), not from another GPU's all-to-all fit; a GPU with
all-to-all tables of its own keeps its fit, and the profile says which it is.
"""
from __future__ import annotations

import numpy as np
import pytest
from _gpu_tables import real_measurements

from servelab.simulator import kernels as K
from servelab.simulator.calibration import packaged
from servelab.simulator.gpus import get_gpu
from servelab.simulator.kernels.movement import alltoall_from_ring
from servelab.validation.kernel_fit import calibrate, extend_profile
from servelab.validation.measurements import MeasurementSet, load_measurements

RTX = get_gpu("rtx-pro-6000")


def test_the_exchange_from_a_ring_moves_half_a_ring_all_reduces_bus_bytes():
    """Over 2 GPUs an all-gather of B bytes costs what the ring all-reduce of B/2 does:
    the same latency, hop and bus bandwidth, (n-1)/n of the buffer against 2(n-1)/n."""
    ring = packaged("rtx-pro-6000.vllm-0.19").kernels.collective
    ring_only = K.CollectiveParams(**{**ring.to_dict(), "custom_max_bytes": 0})
    sizes = np.array([64 << 10, 1 << 20, 16 << 20, 256 << 20], dtype=float)
    exchange = K.alltoall_time(sizes, 2, RTX, alltoall_from_ring(ring))
    assert exchange == pytest.approx(K.allreduce_time(sizes / 2, 2, RTX, ring_only), rel=1e-12)
    # 16 MiB gathered at this GPU's fitted ring: ~15 GB/s of bus bandwidth, not L40S's ~43
    bus_gbps = 8 * 2**20 / (exchange[2] - ring.ring_latency_s - ring.hop_s) / 1e9
    assert 12 < bus_gbps < 18
    assert float(K.alltoall_time(1 << 20, 1, RTX, alltoall_from_ring(ring))) == 0.0


def test_a_profile_without_alltoall_tables_prices_the_exchange_from_its_own_ring():
    """Packaged: the RTX PRO 6000 (PCIe) measured an all-reduce but no all-to-all. The B200
    (NVLink, where the ring derivation prices measured exchanges too fast) borrows the
    H100's measured NVLink exchange instead."""
    b200 = packaged("b200.vllm-0.24")
    assert b200.kernels.alltoall == packaged("h100-sxm.vllm-0.24").kernels.alltoall
    assert b200.source["kernels.alltoall"].startswith("no measurements on b200: carried from")
    for name in ("rtx-pro-6000.vllm-0.19",):
        profile = packaged(name)
        assert profile.kernels.alltoall == alltoall_from_ring(profile.kernels.collective), name
        line = profile.source["kernels.alltoall"]
        assert line.startswith(f"no all-to-all measurements on {profile.device}: derived from "
                               f"its own NCCL ring all-reduce fit"), name
        assert profile.source["kernels.collective"] in line, name


def test_a_profile_with_its_own_alltoall_tables_keeps_its_fit():
    for name, folder in (("a100-80gb", "a100_sxm"), ("h100-sxm", "h100_sxm"), ("l40s", "l40s")):
        profile = packaged(name)
        assert profile.source["kernels.alltoall"].endswith(f"{folder}/nccl_perf.parquet"), name
        assert profile.kernels.alltoall.simple_link_eff > 0, name      # three protocol lines
        assert profile.kernels.alltoall != alltoall_from_ring(profile.kernels.collective), name
    # H100 at vLLM 0.24 measured no all-to-all, but H100 did at 0.14: the GPU's own fit stays
    h100 = packaged("h100-sxm.vllm-0.24")
    assert h100.kernels.alltoall == packaged("h100-sxm").kernels.alltoall
    assert h100.source["kernels.alltoall"] == ("no measurements on h100-sxm: carried from the "
                                               "h100-sxm profile")


def test_calibrate_prefers_the_gpus_own_ring_to_another_gpus_alltoall():
    """Without an nccl table: another GPU's fallback loses to this GPU's own ring; a
    fallback measured on this GPU (another engine version) wins; with no own ring and
    only another GPU's fallback, the fallback's is carried, as before."""
    empty = MeasurementSet("rtx-pro-6000", {}, {}, engine_version="0.19.0")
    ring = packaged("rtx-pro-6000.vllm-0.19").kernels.collective
    l40s = packaged("l40s")
    own = calibrate(empty, fallback=l40s, families=("alltoall",), ring=(ring, "a table"))
    assert own.profile.kernels.alltoall == alltoall_from_ring(ring)
    assert "derived from its own NCCL ring all-reduce fit (kernels.collective, a table)" \
        in own.profile.source["kernels.alltoall"]
    carried = calibrate(empty, fallback=l40s, families=("alltoall",))
    assert carried.profile.kernels.alltoall == l40s.kernels.alltoall
    assert carried.profile.source["kernels.alltoall"] == ("no measurements on rtx-pro-6000: "
                                                          "carried from the l40s profile")
    h100 = MeasurementSet("h100-sxm", {}, {}, engine_version="0.24.0")
    same_gpu = calibrate(h100, fallback=packaged("h100-sxm"), families=("alltoall",),
                         ring=(packaged("h100-sxm.vllm-0.24").kernels.collective, "a table"))
    assert same_gpu.profile.kernels.alltoall == packaged("h100-sxm").kernels.alltoall


def _rtx_tables() -> MeasurementSet:
    folder = real_measurements() / "aiconfigurator-vllm-0.19.0"
    return load_measurements([folder], RTX, drop_bad_rows=True, engine_version="0.19.0")


def test_refitting_reproduces_the_packaged_exchange_from_the_ring_fitted_in_the_same_run():
    """The RTX PRO 6000's real tables: its all-reduce fitted in the same call prices the
    exchange; extending the packaged profile changes nothing (it is what the package holds)."""
    ms = _rtx_tables()
    fitted = calibrate(ms, fallback=packaged("l40s"), families=("collective", "alltoall"))
    assert fitted.profile.kernels.alltoall == alltoall_from_ring(fitted.profile.kernels.collective)
    base = packaged("rtx-pro-6000.vllm-0.19")
    again = extend_profile(base, ms, ("alltoall",), data_version=base.source["data"],
                           fallback=packaged("l40s")).profile
    assert again.to_dict() == base.to_dict()


def test_the_ring_line_prices_measured_pcie_all_gathers_better_than_the_alltoall_fit():
    """Where both were measured (L40S over PCIe, 2 GPUs, aiconfigurator's vLLM 0.14
    `nccl_perf`, messages >= 8 MiB), the line from L40S's own all-reduce fit prices the
    all-gathers and reduce-scatters vLLM's exchange runs within 5% at the median, closer
    than L40S's own all-to-all fit does."""
    folder = real_measurements() / "aiconfigurator-vllm-0.14.0"
    l40s = get_gpu("l40s")
    table = load_measurements([folder], l40s, drop_bad_rows=True,
                              engine_version="0.14.0").table("nccl")
    profile = packaged("l40s")
    ring = alltoall_from_ring(profile.kernels.collective)
    for op in ("all_gather", "reduce_scatter"):
        rows = (table["op"] == op) & (table["num_gpus"] == 2) & (table["nbytes"] >= 8 << 20)
        assert rows.sum() >= 10, op
        nbytes, measured = table["nbytes"][rows], table["latency_s"][rows]
        from_ring = np.median(K.alltoall_time(nbytes, 2, l40s, ring) / measured - 1)
        from_fit = np.median(K.alltoall_time(nbytes, 2, l40s, profile.kernels.alltoall)
                             / measured - 1)
        assert abs(from_ring) < 0.05 and abs(from_ring) < abs(from_fit), op
