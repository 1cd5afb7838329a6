"""The all-reduce follows vLLM's own dispatch: custom kernel (one- or two-stage by size),
then PyTorch symmetric memory where the engine has it on and the GPU is listed, then NCCL;
and a fit reads from a table whether the engine had symmetric memory on."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from servelab.simulator import kernels as K
from servelab.simulator.gpus import get_gpu
from servelab.simulator.kernels.movement import ONE_STAGE, RING, SYMM_MEM, TWO_STAGE
from servelab.validation.kernel_fit import FAMILIES, fit_family, holdout_mask
from servelab.validation.measurements import Table

KIB, MIB = 1024, 1024 * 1024
H100, B200, A100, L40S = (get_gpu(g) for g in ("h100-sxm", "b200", "a100-80gb", "l40s"))
P = K.CollectiveParams(custom_latency_s=4e-6, two_shot_s=2e-6, two_shot_hop_s=5e-7,
                       custom_link_eff=0.6, ring_latency_s=3e-5, ring_link_eff=0.8, hop_s=1e-7,
                       symm_latency_s=9e-6, symm_link_eff=0.45)
ON, OFF = replace(P, symm_mem=1.0), P


def route(nbytes, gpus, gpu, p) -> list[int]:
    return K.allreduce_route(np.asarray(nbytes, float), gpus, gpu, p).tolist()


@pytest.mark.parametrize("gpus, sizes, with_symm, without", [
    # 8 H100s: custom below 256 KiB with symmetric memory on, 8 MiB without
    (8, (128 * KIB, 256 * KIB, 8 * MIB - 16, 64 * MIB, 64 * MIB + 16),
     (ONE_STAGE, SYMM_MEM, SYMM_MEM, SYMM_MEM, RING), (ONE_STAGE, TWO_STAGE, TWO_STAGE, RING, RING)),
    # 4: the one-stage kernel up to 512 KiB; symmetric memory from the custom buffer to 32 MiB
    (4, (256 * KIB, 512 * KIB, 8 * MIB, 32 * MIB, 32 * MIB + 16),
     (ONE_STAGE, TWO_STAGE, SYMM_MEM, SYMM_MEM, RING), (ONE_STAGE, TWO_STAGE, RING, RING, RING)),
    # 2: always one-stage; symmetric memory from 8 MiB to 64 MiB
    (2, (1 * KIB, 4 * MIB, 8 * MIB, 64 * MIB, 128 * MIB),
     (ONE_STAGE, ONE_STAGE, SYMM_MEM, SYMM_MEM, RING), (ONE_STAGE, ONE_STAGE, RING, RING, RING)),
    # 3: not a group size the custom kernel or symmetric memory takes
    (3, (1 * KIB, 1 * MIB), (RING, RING), (RING, RING)),
])
def test_h100_paths_follow_vllms_thresholds(gpus, sizes, with_symm, without):
    assert route(sizes, gpus, H100, ON) == list(with_symm)
    assert route(sizes, gpus, H100, OFF) == list(without)


def test_b200_takes_its_own_rows_of_the_tables():
    """SM 10.0: custom below 1 MiB at 8 GPUs (two-stage from 256 KiB), symmetric memory to
    128 MiB; at 2 GPUs custom below 2 MiB, symmetric memory to 8 MiB."""
    sizes = (128 * KIB, 256 * KIB, 1 * MIB, 128 * MIB, 256 * MIB)
    assert route(sizes, 8, B200, ON) == [ONE_STAGE, TWO_STAGE, SYMM_MEM, SYMM_MEM, RING]
    assert route((1 * MIB, 2 * MIB, 8 * MIB, 16 * MIB), 2, B200, ON) == \
        [ONE_STAGE, SYMM_MEM, SYMM_MEM, RING]


def test_unlisted_or_pcie_gpus_never_take_symmetric_memory():
    sizes = (1 * KIB, 1 * MIB, 16 * MIB)
    assert SYMM_MEM not in route(sizes, 8, A100, ON)          # SM 8.0 is not in vLLM's table
    assert route(sizes, 2, L40S, ON) == [ONE_STAGE, ONE_STAGE, RING]
    assert route(sizes, 4, L40S, ON) == [RING, RING, RING]    # custom only for a PCIe pair
    blank = replace(H100, compute_capability="")
    assert SYMM_MEM not in route(sizes, 8, blank, ON)


def test_each_path_is_priced_by_its_own_line():
    link = H100.nvlink_gbps * 1e9
    one = P.custom_latency_s + 7 * P.hop_s + 128 * KIB * 7 / (link * P.custom_link_eff)
    two = (P.custom_latency_s + 7 * P.hop_s + P.two_shot_s + 7 * P.two_shot_hop_s
           + 1 * MIB * 1.75 / (link * P.custom_link_eff))
    symm = P.symm_latency_s + 7 * P.hop_s + 1 * MIB / (link * P.symm_link_eff)
    ring = P.ring_latency_s + 7 * P.hop_s + 128 * MIB * 1.75 / (link * P.ring_link_eff)
    assert K.allreduce_time(128 * KIB, 8, H100, ON) == pytest.approx(one, rel=1e-12)
    assert K.allreduce_time(1 * MIB, 8, H100, OFF) == pytest.approx(two, rel=1e-12)
    assert K.allreduce_time(1 * MIB, 8, H100, ON) == pytest.approx(symm, rel=1e-12)
    assert K.allreduce_time(128 * MIB, 8, H100, ON) == pytest.approx(ring, rel=1e-12)
    assert K.allreduce_time(1 * MIB, 1, H100, ON) == 0.0


def test_symm_mem_is_an_engine_switch_not_a_number():
    with pytest.raises(ValueError, match="symm_mem must be 0 or 1"):
        replace(P, symm_mem=0.5)


@pytest.mark.parametrize("truth", [0.0, 1.0])
def test_the_fit_reads_from_the_table_whether_the_engine_had_symmetric_memory_on(truth):
    sizes = 2.0 ** np.arange(8, 31)
    nbytes = np.tile(sizes, 3)
    gpus = np.repeat([2.0, 4.0, 8.0], len(sizes))
    true = replace(ON, symm_mem=truth)
    n = len(nbytes)
    table = Table("allreduce", {"nbytes": nbytes, "num_gpus": gpus,
                                "dtype": np.array(["bfloat16"] * n, object),
                                "backend": np.array(["vllm_graph"] * n, object),
                                "latency_s": K.allreduce_time(nbytes, gpus, B200, true)},
                  [f"synthetic: row {i + 1}" for i in range(n)])
    fit = fit_family(FAMILIES["collective"], table, B200, holdout_mask(table), K.CollectiveParams())
    assert fit.params.symm_mem == truth
    assert fit.stats["heldout"]["mape_pct"] < 1.0
