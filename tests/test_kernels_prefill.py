"""Paged (chunked) prefill attention: Triton kernel vs PyTorch reference vs dense causal
attention, with NaN-poisoned unused slots/blocks and shuffled, strided block tables."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from servelab.backends.kernels import (
    paged_decode_attention,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

from _paged_cache import DEVICE, TOLERANCE, PagedKV, make_paged_kv

pytestmark = pytest.mark.kernels


def dense_prefill(q: torch.Tensor, query_start_loc: list[int], kv: PagedKV,
                  scale: float) -> torch.Tensor:
    """Independent check: SDPA per sequence on dense K/V with a hand-built causal mask that
    places query i of a q_len chunk at absolute position seq_len - q_len + i."""
    out = torch.zeros_like(q)
    for s, (k, v) in enumerate(zip(kv.keys, kv.values)):
        lo, hi = query_start_loc[s], query_start_loc[s + 1]
        if hi == lo:
            continue
        n, q_len = k.shape[0], hi - lo
        mask = (torch.arange(n, device=q.device)[None, :]
                <= torch.arange(n - q_len, n, device=q.device)[:, None])
        o = F.scaled_dot_product_attention(
            q[lo:hi].float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
            v.float().transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1).to(q.dtype)
    return out


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    block_size: int
    group: int
    head_dim: int
    chunks: tuple[tuple[int, int], ...]  # per sequence: (q_len, seq_len incl. the chunk)
    num_kv_heads: int = 2

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        chunks = "_".join(f"{q}of{n}" for q, n in self.chunks)
        return f"{dt}-bs{self.block_size}-g{self.group}-d{self.head_dim}-{chunks}"


# Each axis value appears at least once: block sizes 1/16/32, GQA groups 1/3/4/8, head dims
# 64/128, fp32/fp16/bf16; chunks with q_len 1, with no cached prefix (q_len == seq_len),
# with q_len 0, chunks spanning several query tiles and contexts of several KV tiles.
CASES = [
    Case(torch.float32, 16, 4, 64, ((1, 1), (5, 70), (40, 40), (0, 3))),
    Case(torch.float16, 1, 3, 128, ((20, 20), (1, 9))),
    Case(torch.bfloat16, 32, 8, 64, ((40, 40), (3, 50))),
    Case(torch.float32, 32, 1, 128, ((1, 33), (64, 64))),
    Case(torch.float16, 16, 8, 128, ((33, 80),)),
    Case(torch.float32, 1, 4, 64, ((16, 30), (1, 1))),
    Case(torch.float32, 16, 8, 64, ((20, 200), (2, 2)), num_kv_heads=1),
]


def _inputs(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in case.chunks]
    kv = make_paged_kv([n for _, n in case.chunks], case.block_size, case.num_kv_heads,
                       case.head_dim, case.dtype, gen)
    q = torch.randn(sum(q_lens), case.num_kv_heads * case.group, case.head_dim,
                    generator=gen).to(case.dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    seq_lens = torch.tensor([n for _, n in case.chunks], dtype=torch.int32)
    return (q.to(DEVICE), kv, query_start_loc.to(DEVICE), seq_lens.to(DEVICE),
            case.head_dim ** -0.5)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_dense_causal_attention(case: Case) -> None:
    q, kv, qsl, seq_lens, scale = _inputs(case)
    got = paged_prefill_attention_reference(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                            seq_lens, scale)
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got, dense_prefill(q, qsl.tolist(), kv, scale),
                               atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_reference(case: Case) -> None:
    q, kv, qsl, seq_lens, scale = _inputs(case)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, seq_lens, scale)
    got = paged_prefill_attention(*args, use_triton=True)
    want = paged_prefill_attention(*args, use_triton=False)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.isfinite(got).all(), "NaN from a poisoned slot reached the output"
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_chunked_prefill_equals_whole_prefill() -> None:
    """Prefilling 50 tokens in chunks of 18 + 32 (the second over an 18-token cached
    prefix) gives what one 50-token chunk gives."""
    case = Case(torch.float32, 16, 4, 64, ((50, 50),))
    q, kv, _, _, scale = _inputs(case)
    caches = (kv.k_cache, kv.v_cache, kv.block_tables)

    def run(lo: int, hi: int) -> torch.Tensor:
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
        return paged_prefill_attention(q[lo:hi], *caches, qsl, lens, scale, use_triton=True)

    chunked = torch.cat([run(0, 18), run(18, 50)])
    torch.testing.assert_close(chunked, run(0, 50), atol=1e-5, rtol=1e-4)


def test_one_token_chunks_equal_decode() -> None:
    case = Case(torch.float32, 16, 3, 64, ((1, 37), (1, 1), (1, 80)))
    q, kv, qsl, seq_lens, scale = _inputs(case)
    caches = (kv.k_cache, kv.v_cache, kv.block_tables)
    prefill = paged_prefill_attention(q, *caches, qsl, seq_lens, scale, use_triton=True)
    decode = paged_decode_attention(q, *caches, seq_lens, scale, use_triton=True,
                                    split_size=32)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-4)


def _valid_args() -> dict:
    q, kv, qsl, seq_lens, scale = _inputs(Case(torch.float32, 4, 2, 64, ((3, 5), (2, 9))))
    return {"q": q, "k_cache": kv.k_cache, "v_cache": kv.v_cache,
            "block_tables": kv.block_tables, "query_start_loc": qsl, "seq_lens": seq_lens,
            "scale": scale}


BAD_INPUTS = [
    ("query_start_loc-int64", lambda a: {**a, "query_start_loc": a["query_start_loc"].long()},
     "query_start_loc must be torch.int32"),
    ("query_start_loc-length", lambda a: {**a, "query_start_loc": a["query_start_loc"][:2]},
     "query_start_loc has 2 entries, expected 3"),
    ("block_tables-int64", lambda a: {**a, "block_tables": a["block_tables"].long()},
     "block_tables must be torch.int32"),
    ("q-2d", lambda a: {**a, "q": a["q"][:, 0]}, r"q must be \[num_tokens, num_heads"),
    ("heads-not-multiple", lambda a: {**a, "q": a["q"][:, :3]},
     "num_heads 3 is not a multiple of num_kv_heads 2"),
    ("v_cache-shape", lambda a: {**a, "v_cache": a["v_cache"][:-1]}, "v_cache shape"),
    ("cache-non-contiguous",
     lambda a: {**a, "v_cache": a["v_cache"].transpose(1, 2).contiguous().transpose(1, 2)},
     "must be contiguous"),
]


@pytest.mark.parametrize("mutate, message", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(mutate, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**mutate(_valid_args()), use_triton=True)


BAD_VALUES = [
    ("chunk-longer-than-sequence",
     lambda a: {**a, "seq_lens": torch.tensor([2, 9], dtype=torch.int32, device=DEVICE)},
     r"q_len 3 must be in \[0, seq_lens\[0\]=2\]"),
    ("query_start_loc-end", lambda a: {**a, "q": a["q"][:4]},
     "query_start_loc must run from 0 to num_tokens=4"),
    ("seq_len-past-table", lambda a: {**a, "seq_lens": torch.tensor([5, 99], dtype=torch.int32, device=DEVICE)},
     r"seq_lens\[1\] = 99 outside"),
]


@pytest.mark.parametrize("mutate, message", [c[1:] for c in BAD_VALUES],
                         ids=[c[0] for c in BAD_VALUES])
def test_reference_rejects_bad_values(mutate, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention_reference(**mutate(_valid_args()))
