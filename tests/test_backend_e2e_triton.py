"""The real engine on the Triton kernels (interpreter on the CPU) against the PyTorch
reference path: same scheduler, same seeded random weights, same greedy tokens.

Small on purpose: the interpreter costs milliseconds per kernel loop step. The run still
mixes chunked prefill with decodes and preempts by swap, so the kernels read KV written by
earlier chunks, by other steps and by swap-ins.
"""
from __future__ import annotations

import pytest
import torch

from _backend_device import DEVICE
from servelab.backends.run import RealRunConfig, run_real
from servelab.config import SchedulerConfig
from servelab.request import Request

pytestmark = pytest.mark.kernels


def serve(use_triton: bool):
    requests = [Request(0, 0.0, 9, 6, prompt_token_ids=tuple(range(30, 39))),
                Request(1, 0.0, 6, 6, prompt_token_ids=tuple(range(90, 96))),
                Request(2, 0.0, 5, 5, prompt_token_ids=tuple(range(7, 12)))]
    config = RealRunConfig(
        model="tiny-llama", device=DEVICE, dtype="float32", use_triton=use_triton,
        scheduler=SchedulerConfig(chunked_prefill=4, max_num_batched_tokens=8, max_model_len=64,
                                  preemption="swap"),
        cache=dict(block_size=4, num_gpu_blocks=7, num_cpu_blocks=8), seed=1, progress=False)
    return run_real(config, None, requests=requests)


def test_triton_interpreter_engine_matches_reference_engine():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        triton_run, reference_run = serve(use_triton=True), serve(use_triton=False)
    finally:
        torch.set_num_threads(before)
    assert triton_run.config["derived"]["triton_interpret"] == (DEVICE == "cpu")
    assert triton_run.outputs == reference_run.outputs
    assert [len(s[0]) for s in triton_run.outputs.values()] == [6, 6, 5]
    assert triton_run.num_swap_preemptions > 0
    assert any(s.num_prefill_seqs and s.num_decode_tokens for s in triton_run.steps)
