"""The model runner on the Triton kernels (interpreter on CPU) against the reference path.

Two runners share seeded random weights; one attends through the Triton kernels, the other
through the PyTorch references. A few steps mix chunked prefill (with cached context) and
decodes over non-contiguous, poisoned block tables. Tolerance: fp32, 1e-4 on logits (the
interpreter's fp32 tl.dot is exact; the kernels' online softmax reorders sums).
"""
from __future__ import annotations

import pytest
import torch

from _backend_device import DEVICE
from servelab.backends.attention import SeqWork
from servelab.backends.model import ModelRunner
from servelab.models import ModelSpec

pytestmark = pytest.mark.kernels

SPEC = ModelSpec.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6})   # GQA group of 3


def test_triton_runner_matches_reference_runner():
    kwargs = dict(device=DEVICE, dtype="float32", num_gpu_blocks=16, block_size=4, seed=1,
                  poison_kv=True)
    triton_runner = ModelRunner(SPEC, use_triton=True, **kwargs)
    reference_runner = ModelRunner(SPEC, use_triton=False, **kwargs)
    a, b = list(range(10, 17)), list(range(40, 49))
    table_a, table_b = [9, 2, 14], [5, 11, 0]
    steps = [
        [SeqWork(a, 0, table_a, True), SeqWork(b[:5], 0, table_b, True)],
        [SeqWork([3], 7, table_a, False), SeqWork(b[5:], 5, table_b, True)],
        [SeqWork([4], 9, table_b, False), SeqWork([8], 8, table_a, False)],
    ]
    for step in steps:
        got, expected = triton_runner.run(step), reference_runner.run(step)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_warm_up_steps_are_valid_steps_that_reach_every_specialisation():
    """The CUDA warm-up (backends/run.py) runs before timing so that Triton compiles outside
    timed steps: its steps must be steps the runner accepts, and must reach table widths of
    1, a multiple of 16 and neither, one split and several, prefill chunks of 1, 16 and 17
    tokens, and decode batches of 1 and 2."""
    from servelab.backends.kernels.reference import DEFAULT_SPLIT_SIZE
    from servelab.backends.run import warm_up_steps

    runner = ModelRunner(SPEC, use_triton=True, device=DEVICE, dtype="float32",
                         num_gpu_blocks=1, block_size=16, seed=1)
    steps = warm_up_steps(max_model_len=2048, block_size=16)
    for seqs in steps:
        assert runner.run(seqs).shape == (len(seqs), SPEC.vocab_size)
    widths = {len(s.block_table) for seqs in steps for s in seqs}
    assert 1 in widths and any(w % 16 == 0 for w in widths) and any(w % 16 > 1 for w in widths)
    assert min(widths) * 16 <= DEFAULT_SPLIT_SIZE < max(widths) * 16
    chunks = {s.num_tokens for seqs in steps for s in seqs if s.is_prefill}
    assert chunks == {1, 16, 17}
    decode_batches = {len(seqs) for seqs in steps if not any(s.is_prefill for s in seqs)}
    assert decode_batches == {1, 2}
    assert any({s.is_prefill for s in seqs} == {True, False} for seqs in steps)
    assert max(s.seq_len for seqs in steps for s in seqs) == 65 * 16
    assert max(s.seq_len for seqs in warm_up_steps(256, 16) for s in seqs) <= 256


def test_warm_up_leaves_a_poisoned_cache_poisoned():
    """The warm-up's steps write block 0 and put it back: a NaN-poisoned cache must still
    show a read of a block nobody wrote (on the H200 a decode cache came out of the warm-up
    with block 0 holding the warm-up's keys)."""
    from servelab.backends.run import _warm_up

    runner = ModelRunner(SPEC, use_triton=True, device=DEVICE, dtype="float32",
                         num_gpu_blocks=3, block_size=16, seed=1, poison_kv=True)
    _warm_up(runner, max_model_len=32)
    assert runner.kv_cache.k.isnan().all() and runner.kv_cache.v.isnan().all()
