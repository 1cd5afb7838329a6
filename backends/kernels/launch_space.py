"""Every launch configuration the CUDA backend can plan, as ``KernelLaunch`` records built by
the wrappers' own ``plan_*`` functions, for the CUDA compile check and the resource table.

The axes: dtype (fp16, bf16, fp32) x GQA group (1, 4, 8 and Qwen2.5-7B's 7, a group that
pads its query tile) x head dim (64, 128) x block size (16, 32) x context (one split-KV
partition, or the catalog's longest context, which takes the multi-split path and the merge
kernel). Every catalog model's own (group, head dim) is added at block size 16, so a model
added to the catalog is compiled too. The KV write sees none of these but the dtype and the
row it copies (kv heads x head dim): it runs over 1, 8 and 40 kv heads and the catalog's.

Each configuration is planned on CPU stand-in tensors (``torch.empty``, no data) with the
shapes above, 3 sequences and 2 kv heads; ``plan_*(..., for_cuda=True)`` then picks what it
would pick for GPU tensors of those shapes. Launches that plan the same kernel with the
same parameters compile once (``CudaCompiler`` caches by Triton's key).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from servelab.models import catalog_names, load_model_spec

from .decode_attention import plan_paged_decode
from .kv_write import plan_write_kv
from .launch import KernelLaunch
from .prefill_attention import plan_paged_prefill
from .reference import DEFAULT_SPLIT_SIZE

__all__ = ["AttentionShape", "PlannedLaunch", "DTYPES", "GQA_GROUPS", "HEAD_DIMS",
           "BLOCK_SIZES", "attention_shapes", "planned_launches"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GQA_GROUPS = (1, 4, 7, 8)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32)
KV_WRITE_HEADS = (1, 8, 40)
NUM_SEQS = 3
NUM_KV_HEADS = 2


@dataclass(frozen=True)
class AttentionShape:
    """One attention configuration; ``context`` is the block table's width in tokens."""

    dtype: torch.dtype
    group: int
    head_dim: int
    block_size: int
    context: int

    def label(self) -> str:
        return (f"{_dtype_name(self.dtype)}-g{self.group}-d{self.head_dim}"
                f"-bs{self.block_size}-ctx{self.context}")


@dataclass(frozen=True)
class PlannedLaunch:
    """A launch the backend would make, and the configuration that made it."""

    config: str
    launch: KernelLaunch

    @property
    def kernel(self) -> str:
        return self.launch.name


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def attention_shapes() -> list[AttentionShape]:
    """The cross product of the axes, then the catalog models' own shapes, without repeats."""
    models = [load_model_spec(name) for name in catalog_names()]
    contexts = (DEFAULT_SPLIT_SIZE, max(m.max_position_embeddings for m in models))
    shapes = [AttentionShape(*point) for point in
              itertools.product(DTYPES, GQA_GROUPS, HEAD_DIMS, BLOCK_SIZES, contexts)]
    for model, dtype, context in itertools.product(models, DTYPES, contexts):
        shapes.append(AttentionShape(dtype, model.num_heads // model.num_kv_heads,
                                     model.head_dim, BLOCK_SIZES[0], context))
    return list(dict.fromkeys(shapes))


def _decode_launches(shape: AttentionShape) -> list[KernelLaunch]:
    q = torch.empty(NUM_SEQS, NUM_KV_HEADS * shape.group, shape.head_dim, dtype=shape.dtype)
    cache = torch.empty(2, shape.block_size, NUM_KV_HEADS, shape.head_dim, dtype=shape.dtype)
    block_tables = torch.zeros(NUM_SEQS, shape.context // shape.block_size, dtype=torch.int32)
    seq_lens = torch.zeros(NUM_SEQS, dtype=torch.int32)
    _, launches = plan_paged_decode(q, cache, cache, block_tables, seq_lens, shape.head_dim ** -0.5,
                                    DEFAULT_SPLIT_SIZE, for_cuda=True)
    return launches


def _prefill_launches(shape: AttentionShape) -> list[KernelLaunch]:
    num_tokens = 37  # chunks of 30, 6 and 1 tokens
    q = torch.empty(num_tokens, NUM_KV_HEADS * shape.group, shape.head_dim, dtype=shape.dtype)
    cache = torch.empty(2, shape.block_size, NUM_KV_HEADS, shape.head_dim, dtype=shape.dtype)
    block_tables = torch.zeros(NUM_SEQS, shape.context // shape.block_size, dtype=torch.int32)
    query_start_loc = torch.tensor([0, 30, 36, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([30, 40, 50], dtype=torch.int32)
    _, launches = plan_paged_prefill(q, cache, cache, block_tables, query_start_loc, seq_lens,
                                     shape.head_dim ** -0.5, for_cuda=True)
    return launches


def _kv_write_launches(dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> list[KernelLaunch]:
    rows = torch.empty(NUM_SEQS, num_kv_heads, head_dim, dtype=dtype)
    cache = torch.empty(2, 16, num_kv_heads, head_dim, dtype=dtype)
    slots = torch.arange(NUM_SEQS, dtype=torch.int64)
    return plan_write_kv(rows, rows, cache, cache, slots)


def planned_launches() -> list[PlannedLaunch]:
    """Every launch of every configuration: decode (split, and merge on multi-split
    contexts), prefill (whose launch the context does not change, so at the short one
    only) and KV write."""
    planned = []
    shapes = attention_shapes()
    for shape in shapes:
        planned += [PlannedLaunch(shape.label(), launch) for launch in _decode_launches(shape)]
    for shape in shapes:
        if shape.context == DEFAULT_SPLIT_SIZE:
            planned += [PlannedLaunch(shape.label(), launch)
                        for launch in _prefill_launches(shape)]
    row_shapes = {(heads, head_dim) for heads, head_dim in
                  itertools.product(KV_WRITE_HEADS, HEAD_DIMS)}
    row_shapes |= {(m.num_kv_heads, m.head_dim) for m in map(load_model_spec, catalog_names())}
    for dtype, (heads, head_dim) in itertools.product(DTYPES, sorted(row_shapes)):
        label = f"{_dtype_name(dtype)}-kv{heads}-d{head_dim}"
        planned += [PlannedLaunch(label, launch)
                    for launch in _kv_write_launches(dtype, heads, head_dim)]
    return planned
