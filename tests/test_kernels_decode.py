"""Paged decode attention: Triton kernel vs PyTorch reference vs a dense computation.

Every cache is filled with NaN before the sequences' K/V are scattered into shuffled
physical blocks, and unused block-table entries point at an all-NaN spare block, so any
read past a sequence's length (or of an unused block) turns the output NaN and fails.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from servelab.backends.kernels import paged_decode_attention, paged_decode_attention_reference

from _paged_cache import DEVICE, TOLERANCE, PagedKV, make_paged_kv

pytestmark = pytest.mark.kernels


def dense_decode(q: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    """Independent check: SDPA per sequence on the dense (never paged) K/V, in fp32."""
    out = torch.zeros_like(q)
    for b, (k, v) in enumerate(zip(kv.keys, kv.values)):
        if k.shape[0] == 0:
            continue
        o = F.scaled_dot_product_attention(
            q[b].float()[None, :, None, :], k.float().transpose(0, 1)[None],
            v.float().transpose(0, 1)[None], scale=scale, enable_gqa=True)
        out[b] = o[0, :, 0, :].to(q.dtype)
    return out


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    block_size: int
    group: int
    head_dim: int
    seq_lens: tuple[int, ...]
    split_size: int
    num_kv_heads: int = 2

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"{dt}-bs{self.block_size}-g{self.group}-d{self.head_dim}"
                f"-split{self.split_size}-lens{'_'.join(map(str, self.seq_lens))}")


# Each axis value appears at least once: block sizes 1/16/32, GQA groups 1/3/4/8, head dims
# 64/128, fp32/fp16/bf16, lengths 0 and 1, and contexts several splits long.
CASES = [
    Case(torch.float32, 16, 4, 64, (0, 1, 17, 100), split_size=32),
    Case(torch.float16, 1, 3, 128, (1, 0, 40), split_size=16),
    Case(torch.bfloat16, 32, 8, 64, (5, 70, 0, 33), split_size=512),
    Case(torch.float32, 32, 1, 128, (64, 1, 3), split_size=16),
    Case(torch.float16, 16, 8, 128, (90, 2), split_size=32),
    Case(torch.float32, 1, 3, 64, (0, 1, 23), split_size=512),
    Case(torch.bfloat16, 16, 1, 128, (48, 7), split_size=16),
    Case(torch.float16, 32, 4, 64, (1, 96), split_size=512, num_kv_heads=1),
]


def _inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, PagedKV, torch.Tensor, float]:
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(list(case.seq_lens), case.block_size, case.num_kv_heads,
                       case.head_dim, case.dtype, gen)
    num_heads = case.num_kv_heads * case.group
    q = torch.randn(len(case.seq_lens), num_heads, case.head_dim, generator=gen).to(case.dtype)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    return q.to(DEVICE), kv, seq_lens.to(DEVICE), case.head_dim ** -0.5


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_dense_attention(case: Case) -> None:
    q, kv, seq_lens, scale = _inputs(case)
    got = paged_decode_attention_reference(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                           seq_lens, scale)
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got, dense_decode(q, kv, scale), atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_reference(case: Case) -> None:
    q, kv, seq_lens, scale = _inputs(case)
    got = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, scale,
                                 use_triton=True, split_size=case.split_size)
    want = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, scale,
                                  use_triton=False)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.isfinite(got).all(), "NaN from a poisoned slot reached the output"
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    empty = seq_lens == 0
    assert (got[empty] == 0).all()


def test_result_does_not_depend_on_batch_mates() -> None:
    """Fixed split size: a sequence gets bit-identical output alone or in a batch whose
    wider block table adds splits (and the merge kernel)."""
    case = Case(torch.float32, 16, 4, 64, (40, 100, 0), split_size=16)
    q, kv, seq_lens, scale = _inputs(case)
    batched = paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq_lens,
                                     scale, use_triton=True, split_size=64)
    alone = paged_decode_attention(q[:1], kv.k_cache, kv.v_cache, kv.block_tables[:1, :3],
                                   seq_lens[:1], scale, use_triton=True, split_size=64)
    assert torch.equal(batched[:1], alone)


def test_split_size_changes_only_rounding() -> None:
    case = Case(torch.float32, 16, 3, 64, (100, 1, 33), split_size=16)
    q, kv, seq_lens, scale = _inputs(case, seed=1)
    outs = [paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, scale,
                                   use_triton=True, split_size=split) for split in (16, 48, 512)]
    atol, rtol = TOLERANCE[torch.float32]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=atol, rtol=rtol)


def _valid_args() -> dict:
    gen = torch.Generator().manual_seed(0)
    kv = make_paged_kv([5, 9], 4, 2, 64, torch.float32, gen)
    return {"q": torch.randn(2, 4, 64, generator=gen).to(DEVICE), "k_cache": kv.k_cache,
            "v_cache": kv.v_cache, "block_tables": kv.block_tables,
            "seq_lens": torch.tensor([5, 9], dtype=torch.int32, device=DEVICE), "scale": 0.125,
            "split_size": 16}


def _non_contiguous(cache: torch.Tensor) -> torch.Tensor:
    return cache.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, strided


BAD_INPUTS = [
    ("block_tables-int64", lambda a: {**a, "block_tables": a["block_tables"].long()},
     "block_tables must be torch.int32"),
    ("block_tables-rows", lambda a: {**a, "block_tables": a["block_tables"][:1]},
     r"block_tables must be \[2, max_blocks\]"),
    ("seq_lens-int64", lambda a: {**a, "seq_lens": a["seq_lens"].long()},
     "seq_lens must be torch.int32"),
    ("heads-not-multiple", lambda a: {**a, "q": a["q"][:, :3]},
     "num_heads 3 is not a multiple of num_kv_heads 2"),
    ("head_dim-mismatch", lambda a: {**a, "q": a["q"][..., :32]},
     "q head_dim 32 != cache head_dim 64"),
    ("cache-dtype", lambda a: {**a, "k_cache": a["k_cache"].half(), "v_cache": a["v_cache"].half()},
     "cache dtype torch.float16 != q dtype torch.float32"),
    ("cache-non-contiguous", lambda a: {**a, "k_cache": _non_contiguous(a["k_cache"])},
     "must be contiguous"),
    ("split_size-zero", lambda a: {**a, "split_size": 0}, "split_size must be a positive int"),
]


@pytest.mark.parametrize("mutate, message", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(mutate, message: str) -> None:
    args = mutate(_valid_args())
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args, use_triton=True)
