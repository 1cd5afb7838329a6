"""Paged-attention kernels (Triton) and their plain-PyTorch references.

Public API (one layer's cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``):

- ``write_kv(k, v, k_cache, v_cache, slot_mapping, *, use_triton)``
- ``paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, *,
  use_triton, split_size=512)``
- ``paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
  scale, *, use_triton)``
- the ``*_reference`` functions: same signatures without ``use_triton``, torch only.

The references are imported eagerly; the Triton-backed functions are imported on first
use, so ``import servelab.backends.kernels`` works without triton installed and triton is
not imported before callers (tests) have set ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import importlib
from typing import Any

from .reference import (
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    write_kv_reference,
)

_TRITON_BACKED = {
    "write_kv": ".kv_write",
    "paged_decode_attention": ".decode_attention",
    "paged_prefill_attention": ".prefill_attention",
}

__all__ = [
    "write_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv_reference",
    "paged_decode_attention_reference",
    "paged_prefill_attention_reference",
]


def __getattr__(name: str) -> Any:
    if name in _TRITON_BACKED:
        module = importlib.import_module(_TRITON_BACKED[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
