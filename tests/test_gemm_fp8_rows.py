"""The FP8 GEMM's per-row quantisation cost (`GemmParams.quant_row_s`): what it adds, that
profiles written before it read as before, and that the vLLM 0.24 profiles price the
measured rows it was added for (aiconfigurator's H100 tables, ../shared/gpu-measurements)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from _gpu_tables import real_measurements

from servelab.simulator import kernels as K
from servelab.simulator.calibration import packaged
from servelab.simulator.gpus import get_gpu
from servelab.validation.kernel_fit import FAMILIES, family_table
from servelab.validation.measurements import load_measurements

H100 = get_gpu("h100-sxm")


def test_the_row_cost_adds_its_seconds_per_activation_row():
    p = packaged("h100-sxm.vllm-0.24").kernels.gemm_fp8
    without = replace(p, quant_row_s=0.0)
    m = np.array([1, 256, 4096, 16384])
    extra = K.gemm_time(m, 4096, 4096, H100, p, "fp8", 1.0, 1.0, 2.0) \
        - K.gemm_time(m, 4096, 4096, H100, without, "fp8", 1.0, 1.0, 2.0)
    assert extra == pytest.approx(p.quant_row_s * m, rel=1e-9)
    assert p.quant_row_s > 1e-9                           # fitted: a few ns per row


def test_profiles_without_the_row_cost_read_as_before():
    data = packaged("h100-sxm").kernels.gemm_fp8.to_dict()
    data.pop("quant_row_s")
    assert K.GemmParams.from_dict(data, "test").quant_row_s == 0.0
    assert packaged("h100-sxm.vllm-0.24").kernels.gemm.quant_row_s == 0.0     # BF16: none


@pytest.fixture(scope="module")
def fp8_rows():
    ms = load_measurements([real_measurements() / "aiconfigurator-vllm-0.24.0" / "h100_sxm"],
                           "h100-sxm", drop_bad_rows=True)
    return family_table(ms, FAMILIES["gemm_fp8"])


@pytest.mark.parametrize("m, n, k", [(16384, 64, 32), (16384, 4096, 256), (4096, 65536, 64)])
def test_vllm_024_fp8_gemms_with_little_work_per_row_are_priced_from_their_rows(fp8_rows, m, n, k):
    """Measured inside vLLM 0.24 on H100: 16,384 rows of a GEMM with k = 32 and n = 64
    take 122 us in FP8 against 4 us in BF16. Without the row cost the fit was 82-93% fast
    there and, to make up, 2x slow on output-bound shapes (n = 65,536, k = 64)."""
    t = fp8_rows
    row = (t["m"] == m) & (t["n"] == n) & (t["k"] == k)
    assert row.sum() == 1
    measured = float(t["latency_s"][row][0])
    p = packaged("h100-sxm.vllm-0.24").kernels.gemm_fp8
    priced = float(K.gemm_time(m, n, k, H100, p, "fp8", 1.0, 1.0, 2.0, warm_l2=True))
    assert priced == pytest.approx(measured, rel=0.3)
