"""KV write: Triton scatter vs PyTorch reference vs an explicit per-token loop.

A write is a copy, so all three must agree bit for bit (NaN-poisoned slots compared as
NaN == NaN): every dtype's tolerance here is exact."""
from __future__ import annotations

import pytest
import torch

from servelab.backends.kernels import write_kv, write_kv_reference

from _paged_cache import DEVICE

pytestmark = pytest.mark.kernels


def _caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
            torch.full(shape, float("nan"), dtype=dtype, device=DEVICE))


def _slots(num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct random slots, every third token marked as padding (-1)."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::3] = -1
    return slots.to(DEVICE)


def _loop_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Independent check: one token at a time, by block and offset."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = k[i]
            v_cache[slot // block_size, slot % block_size] = v[i]


CASES = [
    (torch.float32, 16, 2, 64, 37),
    (torch.float16, 1, 4, 128, 20),
    (torch.bfloat16, 32, 1, 64, 50),
    (torch.float16, 16, 8, 128, 3),
    (torch.float32, 16, 3, 80, 9),  # head_dim not a power of two: row is 240 elements
]


@pytest.mark.parametrize("dtype, block_size, num_kv_heads, head_dim, num_tokens", CASES,
                         ids=lambda x: str(x).removeprefix("torch."))
def test_triton_reference_and_loop_agree(dtype, block_size, num_kv_heads, head_dim,
                                         num_tokens) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks = num_tokens // block_size + 3
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = _slots(num_tokens, num_blocks * block_size, gen)
    results = []
    for writer in (lambda *a: write_kv(*a, use_triton=True), write_kv_reference, _loop_write):
        k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
        writer(k, v, k_cache, v_cache, slots)
        results.append((k_cache, v_cache))
    for k_cache, v_cache in results[:2]:
        torch.testing.assert_close(k_cache, results[2][0], atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(v_cache, results[2][1], atol=0, rtol=0, equal_nan=True)
    # Padding tokens wrote nothing: exactly the non-negative slots hold numbers.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    finite = torch.isfinite(results[0][0]).all(-1).all(-1).flatten()
    assert torch.equal(finite, written)


def test_rows_from_a_fused_qkv_projection() -> None:
    """k and v may be views into one [T, (H + 2 Hkv) * D] tensor (token stride != row)."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, heads, kv_heads, head_dim = 10, 4, 2, 64
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    k = k.view(num_tokens, kv_heads, head_dim)
    v = v.view(num_tokens, kv_heads, head_dim)
    slots = _slots(num_tokens, 4 * 16, gen)
    got = _caches(4, 16, kv_heads, head_dim, torch.float32)
    want = _caches(4, 16, kv_heads, head_dim, torch.float32)
    write_kv(k, v, *got, slots, use_triton=True)
    _loop_write(k, v, *want, slots)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True)


def test_empty_write_is_a_no_op() -> None:
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float16)
    empty = torch.empty(0, 2, 64, dtype=torch.float16, device=DEVICE)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE),
             use_triton=True)
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


def _valid_args() -> dict:
    k_cache, v_cache = _caches(4, 16, 2, 64, torch.float32)
    k = torch.randn(5, 2, 64, device=DEVICE)
    return {"k": k, "v": k.clone(), "k_cache": k_cache, "v_cache": v_cache,
            "slot_mapping": torch.tensor([0, 17, -1, 40, 63], device=DEVICE)}


BAD_INPUTS = [
    ("slot_mapping-int32", lambda a: {**a, "slot_mapping": a["slot_mapping"].int()},
     "slot_mapping must be torch.int64"),
    ("slot_mapping-length", lambda a: {**a, "slot_mapping": a["slot_mapping"][:3]},
     "slot_mapping has 3 entries, expected 5"),
    ("k-dtype", lambda a: {**a, "k": a["k"].half()}, "k/v dtypes"),
    ("k-heads", lambda a: {**a, "k": a["k"][:, :1], "v": a["v"][:, :1]},
     r"k rows are \(1, 64\)"),
    ("k-not-packed", lambda a: {**a, "k": a["k"].transpose(0, 1).contiguous().transpose(0, 1)},
     "k must be packed within a token"),
    ("cache-non-contiguous", lambda a: {**a, "k_cache": a["k_cache"].transpose(0, 1)
                                        .contiguous().transpose(0, 1)},
     "must be contiguous"),
]


@pytest.mark.parametrize("mutate, message", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(mutate, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_kv(**mutate(_valid_args()), use_triton=True)


def test_reference_rejects_out_of_range_slot() -> None:
    args = {**_valid_args(), "slot_mapping": torch.tensor([0, 1, 2, 3, 64], device=DEVICE)}
    with pytest.raises(ValueError, match="slot >= 64"):
        write_kv_reference(**args)
