"""KV cache tensors: layout, poisoning, swap out/in and copy-on-write on every layer."""
from __future__ import annotations

import pytest
import torch

from servelab.backends.kv_cache import KVCache

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 3, 8, 4, 2, 5


def make_cache(**overrides) -> KVCache:
    kwargs = dict(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=HEADS,
                  head_dim=DIM, dtype=torch.float32, device="cpu", num_cpu_blocks=4)
    return KVCache(**{**kwargs, **overrides})


def filled_cache() -> KVCache:
    cache = make_cache()
    generator = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    return cache


def test_layers_are_views_of_one_pool_per_k_and_v():
    cache = make_cache()
    k0, v1 = cache.layer(0)[0], cache.layer(1)[1]
    assert k0.shape == (BLOCKS, BLOCK_SIZE, HEADS, DIM) and k0.is_contiguous()
    k0[2, 1] = 7.0
    v1[5] = 3.0
    assert (cache.k[0, 2, 1] == 7.0).all() and (cache.v[1, 5] == 3.0).all()
    assert (cache.k[1:] == 0).all() and cache.cpu_k.shape == (LAYERS, 4, BLOCK_SIZE, HEADS, DIM)
    assert cache.bytes_per_block == 2 * LAYERS * BLOCK_SIZE * HEADS * DIM * 4


def test_poison_fills_every_slot_with_nan():
    cache = make_cache(poison=True, dtype=torch.bfloat16)
    for t in (cache.k, cache.v, cache.cpu_k, cache.cpu_v):
        assert torch.isnan(t).all()


def test_swap_out_overwrite_swap_in_restores_exactly():
    cache = filled_cache()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.swap_out([(6, 2), (1, 0), (3, 3)])
    cache.k[:, [1, 3, 6]] = float("nan")      # the blocks are reused by someone else
    cache.v[:, [1, 3, 6]] = -1.0
    cache.swap_in([(0, 5), (2, 1), (3, 7)])   # and come back into other GPU blocks
    for gpu_dst, gpu_src in ((5, 1), (1, 6), (7, 3)):
        assert torch.equal(cache.k[:, gpu_dst], before_k[:, gpu_src])
        assert torch.equal(cache.v[:, gpu_dst], before_v[:, gpu_src])
    for untouched in (0, 2, 4):
        assert torch.equal(cache.k[:, untouched], before_k[:, untouched])
        assert torch.equal(cache.v[:, untouched], before_v[:, untouched])


def test_moves_go_a_chunk_at_a_time_with_the_same_result(monkeypatch):
    """With room for one block per chunk, every move takes several chunks; the blocks
    land exactly where one gather and one scatter put them."""
    from servelab.backends import kv_cache

    pairs_out, pairs_in = [(6, 2), (1, 0), (3, 3)], [(0, 5), (2, 1), (3, 7)]
    whole = filled_cache()
    whole.swap_out(pairs_out)
    whole.swap_in(pairs_in)
    sizes = []
    original = KVCache._host_buffer
    monkeypatch.setattr(KVCache, "_host_buffer",
                        lambda self, shape: sizes.append(shape[1]) or original(self, shape))
    monkeypatch.setattr(kv_cache, "TRANSFER_BYTES", LAYERS * BLOCK_SIZE * HEADS * DIM * 4)
    chunked = filled_cache()
    chunked.swap_out(pairs_out)
    chunked.swap_in(pairs_in)
    assert sizes == [1] * 12                  # 3 blocks x K and V x out and in
    for name in ("k", "v", "cpu_k", "cpu_v"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name))


def test_copy_blocks_reads_all_sources_before_writing():
    cache = filled_cache()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.copy_blocks([(1, 2), (2, 3), (5, 0)])
    for dst, src in ((2, 1), (3, 2), (0, 5)):
        assert torch.equal(cache.k[:, dst], before_k[:, src])
        assert torch.equal(cache.v[:, dst], before_v[:, src])
    for untouched in (1, 4, 5, 6, 7):
        assert torch.equal(cache.k[:, untouched], before_k[:, untouched])


def test_empty_move_lists_are_no_ops():
    cache = filled_cache()
    before = cache.k.clone()
    cache.swap_out([])
    cache.swap_in([])
    cache.copy_blocks([])
    assert torch.equal(cache.k, before)


@pytest.mark.parametrize("call, pairs, message", [
    ("swap_out", [(8, 0)], r"swap_out: source block\(s\) \[8\] outside \[0, 8\)"),
    ("swap_out", [(0, 4)], r"destination block\(s\) \[4\] outside \[0, 4\)"),
    ("swap_in", [(0, 1), (1, 1)], "destination block appears twice"),
    ("copy_blocks", [(0, -1)], r"destination block\(s\) \[-1\]"),
])
def test_bad_block_pairs_are_refused(call, pairs, message):
    with pytest.raises(ValueError, match=message):
        getattr(make_cache(), call)(pairs)


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1"):
        make_cache(num_blocks=0)
    with pytest.raises(ValueError, match="floating point"):
        make_cache(dtype=torch.int32)
