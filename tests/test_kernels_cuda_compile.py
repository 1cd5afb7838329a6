"""The launches the CUDA backend plans compile for every GPU generation the project targets,
fit in the target's shared memory and spill no registers: checked without a GPU by
compiling ahead of time (``backends/kernels/cuda_compile.py``) the configurations of
``backends/kernels/launch_space.py`` (every axis value, every pair of values).

Runs in its own pytest process with the Triton interpreter off (``scripts/test.sh``): under
the interpreter Triton's compiler cannot trace ``tl.max``/``tl.sum``. The compiles run on
every core first (a module fixture); each test then reads one result, so a failure names
the kernel, the configuration and the target.
"""
from __future__ import annotations

import os

import pytest

from servelab.backends.kernels.cuda_compile import (
    CUDA_TARGETS,
    target_for,
    CudaCompiler,
    KernelCompileError,
    KernelResources,
    cuda_backend_installed,
    supported_targets,
)
from servelab.backends.kernels.launch_space import (
    decode_shapes,
    decode_shapes_cover_all_pairs,
    planned_launches,
)
from servelab.simulator.gpus import get_gpu, gpu_names

pytestmark = pytest.mark.cuda_compile

if not cuda_backend_installed():
    pytest.skip("the installed Triton has no CUDA backend", allow_module_level=True)

TARGETS = supported_targets()
PLANNED = planned_launches()


@pytest.fixture(scope="module")
def compiler() -> CudaCompiler:
    compiler = CudaCompiler()
    compiler.compile_all([p.launch for p in PLANNED], TARGETS,
                         workers=len(os.sched_getaffinity(0)))
    return compiler


def test_every_catalog_gpu_has_a_target() -> None:
    """A GPU added to the catalog (simulator/data/gpus) gets its kernels compile-checked,
    against the limits of its own compute capability: the RTX PRO 6000 (12.0) has 99 KiB
    of shared memory per block where the B200 (10.0) has 227 KiB (it was listed under
    sm_100, by its architecture's name)."""
    missing = {name: get_gpu(name).compute_capability for name in gpu_names()
               if get_gpu(name).architecture != "cpu" and target_for(get_gpu(name).compute_capability) is None}
    assert not missing, f"no CUDA_TARGETS entry for the compute capability of {missing}"
    assert target_for("12.0").name == "sm_120" and target_for("12.0").max_shared_bytes == 99 * 1024
    assert target_for("10.3").name == "sm_100" and "rtx-pro-6000" not in target_for("10.0").gpus


def test_decode_configurations_meet_every_group_with_every_other_axis_value() -> None:
    """The covering subset's promise (launch_space.py), and that the check can fail:
    without the group-4 shapes at head dim 64 that pair is missing."""
    shapes = decode_shapes()
    assert decode_shapes_cover_all_pairs(shapes)
    assert not decode_shapes_cover_all_pairs(
        [s for s in shapes if not (s.group == 4 and s.head_dim == 64)])


def test_the_installed_triton_compiles_for_some_target() -> None:
    """Otherwise every test below would vanish from the parametrisation unnoticed."""
    assert TARGETS, f"ptxas of the installed Triton knows none of {[t.name for t in CUDA_TARGETS]}"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("planned", PLANNED, ids=lambda p: f"{p.kernel}-{p.config}")
def test_launch_compiles_within_the_target_limits(planned, target, compiler) -> None:
    where = f"{planned.kernel} [{planned.config}] on {target.name} ({target.gpus})"
    try:
        resources = compiler.resources(planned.launch, target)
    except KernelCompileError as exc:
        pytest.fail(f"{where} does not compile: {exc}")
    problems = resources.problems(target)
    assert not problems, f"{where}: " + "; ".join(problems)


LIMITS = CUDA_TARGETS[1]  # sm_89: 99 KiB of shared memory per block


@pytest.mark.parametrize("resources, complaint", [
    (KernelResources(registers=128, shared_bytes=99 * 1024 + 1, spill_bytes=0, num_warps=4),
     "shared memory"),
    (KernelResources(registers=255, shared_bytes=0, spill_bytes=8, num_warps=4), "spills"),
    (KernelResources(registers=255, shared_bytes=0, spill_bytes=0, num_warps=16), "registers x"),
], ids=["shared", "spills", "register-file"])
def test_each_limit_is_reported(resources: KernelResources, complaint: str) -> None:
    assert any(complaint in p for p in resources.problems(LIMITS))


def test_a_kernel_at_the_limits_passes() -> None:
    edge = KernelResources(registers=128, shared_bytes=99 * 1024, spill_bytes=0, num_warps=16)
    assert edge.problems(LIMITS) == []
