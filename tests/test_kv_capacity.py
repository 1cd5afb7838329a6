"""One KV-capacity formula (`servelab.capacity`) for both executors: the simulator's catalog
GPUs and the real backend's measured CUDA memory, each with its engine's activation peak."""
from __future__ import annotations

import pytest

from servelab.capacity import (GIB, NON_TORCH_RESERVE_BYTES, SERVELAB_TORCH, VLLM_FUSED_BF16,
                               kv_capacity_blocks)
from servelab.models import load_model_spec
from servelab.simulator.footprint import activation_reserve_bytes
from servelab.simulator.footprint import kv_capacity_blocks as simulator_blocks


def test_the_formula_and_its_error():
    assert kv_capacity_blocks(memory_bytes=100, gpu_memory_utilization=0.5, in_use_bytes=10,
                              weight_bytes=20, reserve_bytes=5, block_bytes=4) == 3   # 15 // 4
    with pytest.raises(ValueError, match=r"no room for a KV block of m on g: 0\.00 GiB budget .* "
                                         r"in use .* leaves less than one 4-byte block; try x"):
        kv_capacity_blocks(memory_bytes=100, gpu_memory_utilization=0.5, in_use_bytes=40,
                           weight_bytes=20, reserve_bytes=5, block_bytes=4, where="m on g", hint="try x")


def test_the_simulator_prices_the_modelled_engine():
    """Llama-2-7B on an A100 80GB: (80 GiB x 0.9 - 2 x 6.74e9 weights - the vLLM-style
    activation peak) // 512 KiB blocks."""
    model = load_model_spec("llama-2-7b")
    reserve = activation_reserve_bytes(model)
    per_token = (2 * 4096 + 3 * 11008) * 2
    assert reserve == NON_TORCH_RESERVE_BYTES + 2048 * per_token + 128 * 32000 * 4
    assert reserve == VLLM_FUSED_BF16.bytes(hidden=4096, qkv=0, intermediate=11008, vocab=32000,
                                            max_num_batched_tokens=2048, max_num_seqs=128)
    blocks = simulator_blocks("llama-2-7b", "a100-80gb", block_size=16)
    assert blocks == int((80 * GIB * 0.9 - 2 * model.num_params - reserve) // (16 * 2 * 32 * 4096 * 2))


def test_the_real_backend_uses_the_same_formula_on_measured_memory(monkeypatch):
    import torch
    from servelab.backends.run import derive_num_gpu_blocks
    from servelab.config import SchedulerConfig

    spec = load_model_spec("llama-3.1-8b")
    sched = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64)
    total, free = 80 * GIB, 79 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    blocks = derive_num_gpu_blocks(spec, torch.device("cuda"), torch.bfloat16, 16, sched, 0.9)
    qkv = (32 + 2 * 8) * 128
    reserve = NON_TORCH_RESERVE_BYTES + 2048 * (4 * 4096 + 4 * qkv + 5 * 14336) * 4 + 64 * 128256 * 24
    assert reserve == SERVELAB_TORCH.bytes(hidden=4096, qkv=qkv, intermediate=14336, vocab=128256,
                                           max_num_batched_tokens=2048, max_num_seqs=64)
    block_bytes = spec.kv_bytes_per_token(2) * 16
    assert blocks == int((total * 0.9 - (total - free) - spec.num_params * 2 - reserve) // block_bytes)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, total))
    with pytest.raises(ValueError, match=r"no room for a KV block of llama-3.1-8b on cuda: .* "
                                         r"pass --kv-blocks or use a smaller model"):
        derive_num_gpu_blocks(spec, torch.device("cuda"), torch.bfloat16, 16, sched, 0.9)
