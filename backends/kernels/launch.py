"""One kernel launch as the host decided it: which kernel, its grid, its arguments and its
compile-time parameters.

Every launch wrapper builds its launches through a ``plan_*`` function that returns these
records, then runs them. Keeping the decision in a record is what lets the CUDA compile
check (``cuda_compile.py``) compile exactly what the wrapper would launch, for GPUs this
machine does not have, without a second copy of the tile-size logic that could drift.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["KernelLaunch"]


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """A ``@triton.jit`` kernel with everything one launch needs.

    ``args`` are the runtime arguments in the kernel's order (tensors, ints, floats);
    ``constexprs`` the compile-time ones by name. ``num_warps`` and ``num_stages`` are
    always explicit, so a Triton default never decides a launch silently."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: Mapping[str, int | bool | str]
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps,
                               num_stages=self.num_stages)
