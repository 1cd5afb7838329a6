"""KV-cache capacity: how many blocks fit in the GPU memory an engine may use.

Both executors size their cache as vLLM does at start-up, with this one formula:

    blocks = (memory × gpu_memory_utilization − memory already in use − weights
              − peak activations of a full-budget step − a fixed reserve) // bytes per block

The simulator applies it to a catalog GPU and the engine it models
(`simulator/footprint.py::kv_capacity_blocks`, per GPU under tensor parallelism); the real
backend to the memory CUDA reports and its own model runner
(`backends/run.py::derive_num_gpu_blocks`). What differs is what each engine holds at the
peak of a step, so the activation term is a parameter with one value per engine, both
below: change how capacity is derived here, and both executors follow.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
NON_TORCH_RESERVE_BYTES = GIB
"""Memory an engine holds outside weights, activations and KV: CUDA-graph pools, NCCL,
cuBLAS and Triton workspaces, allocator slack. 1 GiB is an assumption (vLLM measures it
at start-up)."""


@dataclass(frozen=True)
class ActivationPeak:
    """What one engine holds at the peak of a forward pass, besides weights and KV: per
    batched token, `hidden_values` × hidden size + `qkv_values` × the q+k+v width +
    `intermediate_values` × the MLP's intermediate size values of `bytes_per_value` bytes;
    per sampled row, `bytes_per_logit` bytes for each vocabulary entry."""

    hidden_values: int
    qkv_values: int
    intermediate_values: int
    bytes_per_value: int
    bytes_per_logit: int

    def bytes(self, *, hidden: int, qkv: int, intermediate: int, vocab: int,
              max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Peak activation bytes of a step of `max_num_batched_tokens` tokens and
        `max_num_seqs` sampled rows, plus NON_TORCH_RESERVE_BYTES."""
        per_token = (self.hidden_values * hidden + self.qkv_values * qkv
                     + self.intermediate_values * intermediate) * self.bytes_per_value
        return (NON_TORCH_RESERVE_BYTES + max_num_batched_tokens * per_token
                + max_num_seqs * vocab * self.bytes_per_logit)


VLLM_FUSED_BF16 = ActivationPeak(hidden_values=2, qkv_values=0, intermediate_values=3,
                                 bytes_per_value=2, bytes_per_logit=4)
"""A vLLM-style engine (what the simulator models): fused BF16 kernels, so the peak is in
the MLP — the residual, its input, the gate/up output and the activation — and sampling
holds FP32 logits."""

SERVELAB_TORCH = ActivationPeak(hidden_values=4, qkv_values=4, intermediate_values=5,
                                bytes_per_value=4, bytes_per_logit=24)
"""servelab's own model runner (`backends/`): residual, normed input, q/k/v (RoPE in
FP32), gate|up and the SwiGLU product live at once, counted at 4 bytes to cover the FP32
temporaries; sampling holds FP32 logits, their sort, an FP64 softmax and its CDF."""


def kv_capacity_blocks(*, memory_bytes: float, gpu_memory_utilization: float, weight_bytes: float,
                       reserve_bytes: float, block_bytes: int, in_use_bytes: float = 0,
                       where: str = "the GPU", hint: str = "") -> int:
    """KV blocks that fit: (memory × utilization − in use − weights − reserve) // block.

    `reserve_bytes` is the activation peak plus the fixed reserve (`ActivationPeak.bytes`,
    or a measured figure). Raises ValueError, naming `where` and every term (then `hint`),
    when not one block fits."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    budget = memory_bytes * gpu_memory_utilization
    blocks = int((budget - in_use_bytes - weight_bytes - reserve_bytes) // block_bytes)
    if blocks < 1:
        in_use = f" − {in_use_bytes / GIB:.2f} GiB in use" if in_use_bytes else ""
        raise ValueError(
            f"no room for a KV block of {where}: {budget / GIB:.2f} GiB budget (at "
            f"gpu_memory_utilization={gpu_memory_utilization}){in_use} − {weight_bytes / GIB:.2f} "
            f"GiB weights − {reserve_bytes / GIB:.2f} GiB activation reserve leaves less than "
            f"one {block_bytes}-byte block" + (f"; {hint}" if hint else ""))
    return blocks
