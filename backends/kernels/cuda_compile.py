"""Compile a planned kernel launch for a named CUDA GPU ahead of time, with no GPU present,
and read what the compiled kernel costs.

The Triton interpreter accepts programs the CUDA compiler rejects and says nothing about
shared memory or registers, so CI compiles the launches the wrappers plan over the
configurations of ``launch_space.py`` for each GPU generation the project targets. A ``KernelLaunch`` is
compiled exactly as Triton's JIT would compile it at launch: its arguments go through the
JIT's own binder (argument types, 16-byte alignment and divisibility specialisation), then
``triton.compile`` runs the whole pipeline down to ptxas for ``GPUTarget("cuda", cc, 32)``.

Resource figures come from the cubin (the wheel's ``cuobjdump -res-usage``): registers per
thread, static shared memory, and the per-thread stack frame and local memory, which is
where ptxas puts spilled registers (ptxas -v reports the same frame as "bytes stack
frame" beside its spill stores). Dynamic shared memory is Triton's own figure
(``metadata.shared``), the amount the launch requests.

The binder and ``JITFunction._pack_args`` are Triton internals (3.9): should they change,
this module fails loudly rather than compile something else.

Cost: one compile is 0.2 to 1 s of one core, most of it LLVM, then ptxas; the launch
space (504 compiles) is about 300 core-seconds. ``CudaCompiler`` caches results by Triton's
compile key, and Triton's on-disk cache (``~/.triton/cache``) makes a repeated run cheap. Needs the interpreter off (``TRITON_INTERPRET`` unset or 0 before triton is first
imported): under the interpreter triton.language's own ``@jit`` helpers (``tl.max``,
``tl.sum``) become interpreted functions the compiler cannot trace.
"""
from __future__ import annotations

import importlib
import itertools
import multiprocessing
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from servelab.simulator.gpus import get_gpu, gpu_names

from .launch import KernelLaunch

__all__ = ["CudaTarget", "CUDA_TARGETS", "target_for", "KernelResources", "KernelCompileError",
           "CudaCompiler", "cuda_backend_installed", "supported_targets"]

KIB = 1024
REGISTERS_PER_BLOCK = 64 * KIB  # 32-bit registers one block may use, on every target here


@dataclass(frozen=True)
class CudaTarget:
    """A GPU generation: its compute capability, the GPU catalog's name for its
    architecture, and the most shared memory (static + dynamic) one block may opt in to,
    from the CUDA C++ Programming Guide's table of technical specifications per compute
    capability."""

    name: str
    capability: int
    architecture: str
    max_shared_bytes: int

    @property
    def gpus(self) -> str:
        """The catalog GPUs (``simulator/data/gpus``) this target compiles for
        (`target_for`: by compute capability, not architecture name, since Blackwell
        spans sm_100 and sm_120)."""
        return ", ".join(n for n in gpu_names() if target_for(get_gpu(n).compute_capability) is self)


CUDA_TARGETS = (
    CudaTarget("sm_80", 80, "ampere", 163 * KIB),
    CudaTarget("sm_89", 89, "ada", 99 * KIB),
    CudaTarget("sm_90", 90, "hopper", 227 * KIB),
    CudaTarget("sm_100", 100, "blackwell", 227 * KIB),
    CudaTarget("sm_120", 120, "blackwell", 99 * KIB),
)
"""sm_120 is the workstation and consumer Blackwell (the RTX PRO 6000, compute capability
12.0): 99 KiB of shared memory per block, as Ada's, where the data-centre B200 (10.0) has
227 KiB (CUDA C++ Programming Guide, technical specifications per compute capability)."""


def target_for(compute_capability: str) -> CudaTarget | None:
    """The target a GPU of this compute capability ("12.0") runs: the one of that very
    capability, else its major version's first (10.3, the B300, runs sm_100 code and has
    its limits); None for none (a CPU, or a capability no target covers)."""
    if not compute_capability:
        return None
    major, minor = (int(x) for x in compute_capability.split("."))
    exact = [t for t in CUDA_TARGETS if t.capability == 10 * major + minor]
    family = [t for t in CUDA_TARGETS if t.capability // 10 == major and t.capability <= 10 * major + minor]
    return (exact or family or [None])[0]


def cuda_backend_installed() -> bool:
    """Whether the installed Triton ships its NVIDIA backend (compiler and ptxas)."""
    return "nvidia" in triton.backends.backends


def supported_targets(targets: tuple[CudaTarget, ...] = CUDA_TARGETS) -> list[CudaTarget]:
    """The targets the installed Triton can compile for: the ptxas that Triton picks for a
    capability must list the architecture among its ``--gpu-name`` values (an older wheel's
    ptxas lacks sm_100, say). Empty when there is no CUDA backend at all."""
    if not cuda_backend_installed():
        return []
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    supported = []
    for target in targets:
        ptxas = get_ptxas(target.capability).path
        usage = subprocess.run([ptxas, "--help"], capture_output=True, text=True).stdout
        if f"'{sm_arch_from_capability(target.capability)}'" in usage:
            supported.append(target)
    return supported


@dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel needs per block and per thread on one target."""

    registers: int  # per thread
    shared_bytes: int  # per block: Triton's dynamic allocation + static
    spill_bytes: int  # per thread: stack frame + local memory (spilled registers)
    num_warps: int

    def problems(self, target: CudaTarget) -> list[str]:
        """Why the kernel would fail to launch or run slowly on ``target``; empty if fine."""
        found = []
        if self.shared_bytes > target.max_shared_bytes:
            found.append(f"needs {self.shared_bytes} B of shared memory, {target.name} allows "
                         f"{target.max_shared_bytes} B per block")
        if self.spill_bytes:
            found.append(f"spills registers: {self.spill_bytes} B of local memory per thread "
                         f"({self.registers} registers)")
        threads = self.num_warps * 32
        if self.registers * threads > REGISTERS_PER_BLOCK:
            found.append(f"{self.registers} registers x {threads} threads exceed the "
                         f"{REGISTERS_PER_BLOCK} registers of a block")
        return found


_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


class KernelCompileError(RuntimeError):
    """Triton or ptxas rejected a program; the message is theirs."""


@dataclass(frozen=True)
class _CompileJob:
    """What ``triton.compile`` needs for one launch on one target, in a form that pickles
    (the kernel by module and name), so a worker process can compile it."""

    module: str
    kernel_name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    capability: int

    def run(self) -> KernelResources | KernelCompileError:
        kernel = getattr(importlib.import_module(self.module), self.kernel_name)
        source = ASTSource(kernel, self.signature, self.constexprs, self.attrs)
        try:
            with triton.knobs.compilation.scope():
                # Triton's cache keeps the cubin and metadata only (all this reads):
                # about 120 KB a compile instead of 350 KB.
                triton.knobs.compilation.store_binary_only = True
                compiled = triton.compile(source, target=GPUTarget("cuda", self.capability, 32),
                                          options=self.options)
        except Exception as exc:  # CompilationError, PTXASError, ...: report, don't crash
            return KernelCompileError(f"{type(exc).__name__}: {exc}")
        return _read_resources(compiled, self.options["num_warps"])


def _run_job(job: _CompileJob) -> KernelResources | KernelCompileError:
    return job.run()


class CudaCompiler:
    """Compiles launches for targets and remembers the results for its own lifetime, keyed
    by what Triton keys its compiles by (source, specialisation, options, target), so the
    many configurations that plan the same kernel compile it once. ``compile_all`` spreads
    the compiles over worker processes; ``resources`` then reads the results."""

    def __init__(self) -> None:
        self._results: dict[tuple[str, str, int], KernelResources | KernelCompileError] = {}

    def compile_all(self, launches: list[KernelLaunch], targets: list[CudaTarget],
                    workers: int) -> None:
        """Compiles every launch for every target not compiled yet, ``workers`` at a time."""
        jobs = {}
        for launch, target in itertools.product(launches, targets):
            key, job = _job(launch, target)
            if key not in self._results:
                jobs[key] = job
        if workers <= 1 or len(jobs) <= 1:
            results = map(_run_job, jobs.values())
            self._results.update(zip(jobs, results))
            return
        spawn = multiprocessing.get_context("spawn")  # no fork of a process holding torch
        with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
            self._results.update(zip(jobs, pool.map(_run_job, jobs.values())))

    def resources(self, launch: KernelLaunch, target: CudaTarget) -> KernelResources:
        """The compiled ``launch`` on ``target`` (compiling it now if ``compile_all`` did
        not); raises ``KernelCompileError`` when the program does not compile."""
        key, job = _job(launch, target)
        if key not in self._results:
            self._results[key] = job.run()
        result = self._results[key]
        if isinstance(result, KernelCompileError):
            raise result
        return result


def _job(launch: KernelLaunch, target: CudaTarget) -> tuple[tuple[str, str, int], _CompileJob]:
    """The compile Triton's JIT would run for this launch on ``target``: the same binder
    turns the arguments into a signature, constexprs and alignment hints. Returns it with
    its cache key."""
    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(
            f"{launch.name} is not a compiled Triton kernel ({type(kernel).__name__}): set "
            "TRITON_INTERPRET=0 before triton is imported to compile for CUDA")
    backend = make_backend(GPUTarget("cuda", target.capability, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    options = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    bound_args, specialization, _ = binder(*launch.args, **options)
    compile_options, signature, constexprs, attrs = kernel._pack_args(
        backend, options, bound_args, specialization, options)
    key = (ASTSource(kernel, signature, constexprs, attrs).hash(), compile_options.hash(),
           target.capability)
    job = _CompileJob(kernel.fn.__module__, kernel.fn.__name__, signature, constexprs, attrs,
                      dict(compile_options.__dict__), target.capability)
    return key, job


def _read_resources(compiled, num_warps: int) -> KernelResources:
    """Registers, stack and local memory, static shared memory from the cubin's own report;
    the dynamic shared memory the launch requests from Triton's metadata."""
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        report = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True,
                                text=True, check=True).stdout
    match = _RES_USAGE.search(report)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's report:\n{report}")
    registers, stack, static_shared, local = map(int, match.groups())
    return KernelResources(registers=registers,
                           shared_bytes=compiled.metadata.shared + static_shared,
                           spill_bytes=stack + local, num_warps=num_warps)
