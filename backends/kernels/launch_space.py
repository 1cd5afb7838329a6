"""The launch configurations the CUDA backend can plan, as ``KernelLaunch`` records built
by the wrappers' own ``plan_*`` functions, for the CUDA compile check and the resource table.

Axes: dtype (fp16, bf16, fp32), GQA group (1, 4, 8 and Qwen2.5-7B's 7), head dim (64, 128),
block size (16, 32) and, for decode, context (one split-KV partition, or the catalog's
longest context: the multi-split path and the merge kernel). Every catalog model's own
(group, head dim) is added at block size 16 with every dtype and context, so a model added
to the catalog is compiled as it runs. The KV write sees only the dtype and the row it
copies (kv heads x head dim): 1, 8 and 40 kv heads and the catalog's, at both head dims.

Covering subset, because the full product took 720 compiles, 500 core-seconds, and the
whole CI suite past 10 minutes on 2 cores: prefill is the full product (its group sets
the query tile and the row -> (token, head) division, a shift for 4 and 8 but not for 7);
decode is the full product of dtype x head dim x block size x context, with the group
rotated through it, ``(i_dtype + i_head_dim + i_block_size + i_context) % 4``, so every
group meets every value of every other axis (``decode_shapes_cover_all_pairs`` checks it).
Decode pads every group up to 16 to a 16-row tl.dot tile, so there the group only changes
two integer constants, never a tile shape; every pair of the other axes, which do change
tiles, address arithmetic and epilogues, is compiled. 504 compiles in all.

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
           "BLOCK_SIZES", "decode_shapes", "prefill_shapes", "decode_shapes_cover_all_pairs",
           "planned_launches"]

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


def _backend_models() -> list:
    """The catalog models the real backend runs (MLA stays simulation-only)."""
    return [m for m in map(load_model_spec, catalog_names()) if m.mla is None]


def _catalog_shapes(contexts: tuple[int, ...]) -> list[AttentionShape]:
    models = _backend_models()
    return [AttentionShape(dtype, m.num_heads // m.num_kv_heads, m.head_dim, BLOCK_SIZES[0],
                           context)
            for m, dtype, context in itertools.product(models, DTYPES, contexts)]


def decode_contexts() -> tuple[int, int]:
    """One split-KV partition, and the longest context of any catalog model."""
    longest = max(m.max_position_embeddings for m in _backend_models())
    return DEFAULT_SPLIT_SIZE, longest


def decode_shapes() -> list[AttentionShape]:
    """dtype x head dim x block size x context, the group rotated through them (see the
    module docstring), then the catalog models' shapes, without repeats."""
    contexts = decode_contexts()
    shapes = []
    for (i, dtype), (j, head_dim), (k, block_size), (m, context) in itertools.product(
            enumerate(DTYPES), enumerate(HEAD_DIMS), enumerate(BLOCK_SIZES), enumerate(contexts)):
        group = GQA_GROUPS[(i + j + k + m) % len(GQA_GROUPS)]
        shapes.append(AttentionShape(dtype, group, head_dim, block_size, context))
    return list(dict.fromkeys(shapes + _catalog_shapes(contexts)))


def prefill_shapes() -> list[AttentionShape]:
    """The full product at a one-partition block table (the context does not change the
    prefill launch), then the catalog models' shapes, without repeats."""
    context = DEFAULT_SPLIT_SIZE
    shapes = [AttentionShape(*point, context) for point in
              itertools.product(DTYPES, GQA_GROUPS, HEAD_DIMS, BLOCK_SIZES)]
    return list(dict.fromkeys(shapes + _catalog_shapes((context,))))


def decode_shapes_cover_all_pairs(shapes: list[AttentionShape]) -> bool:
    """Whether every GQA group meets every value of every other decode axis."""
    axes = {"dtype": DTYPES, "head_dim": HEAD_DIMS, "block_size": BLOCK_SIZES,
            "context": decode_contexts()}
    met = {(s.group, axis, getattr(s, axis)) for s in shapes for axis in axes}
    return all((group, axis, value) in met
               for group in GQA_GROUPS for axis, values in axes.items() for value in values)


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
    contexts), prefill and KV write."""
    planned = []
    for shape in decode_shapes():
        planned += [PlannedLaunch(shape.label(), launch) for launch in _decode_launches(shape)]
    for shape in prefill_shapes():
        planned += [PlannedLaunch(shape.label(), launch) for launch in _prefill_launches(shape)]
    row_shapes = {(heads, head_dim) for heads, head_dim in
                  itertools.product(KV_WRITE_HEADS, HEAD_DIMS)}
    row_shapes |= {(m.num_kv_heads, m.head_dim) for m in _backend_models()}
    for dtype, (heads, head_dim) in itertools.product(DTYPES, sorted(row_shapes)):
        label = f"{_dtype_name(dtype)}-kv{heads}-d{head_dim}"
        planned += [PlannedLaunch(label, launch)
                    for launch in _kv_write_launches(dtype, heads, head_dim)]
    return planned
