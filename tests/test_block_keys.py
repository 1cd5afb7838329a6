"""Block keys and their chain hashes: the region rule for trace prefix hashes.

A trace region of several blocks gives its first block a key and the others their
offset (`RegionOffset`); an offset's chain hash is the region's first hash plus the
offset. Every way of building one sequence's keys must give the same keys and hashes,
or equal prompts would miss each other in the prefix cache.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.simulator.speed import prefix_runs
from servelab.simulator.speed.block_keys import BlockKeys, RegionOffset, region_offsets
from servelab.request import Request


def trace_request(prompt_len: int, hashes: tuple[int, ...], region_tokens: int) -> Request:
    return Request(0, 0.0, prompt_len, 4, prefix_hashes=hashes, prefix_block_size=region_tokens)


@settings(max_examples=300, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 16]),
       region_blocks=st.integers(1, 8),
       odd_region=st.booleans(),
       hashes=st.lists(st.integers(0, 3), max_size=6),
       extra=st.integers(0, 40),
       steps=st.lists(st.integers(1, 50), min_size=1, max_size=12))
def test_every_way_of_building_a_sequences_keys_agrees(block_size, region_blocks, odd_region,
                                                       hashes, extra, steps):
    """In bulk (`BlockKeys.extend_to`), from the plain key list in pieces, or all at once:
    the same keys, of the same types, and the same hashes."""
    region_tokens = region_blocks * block_size + (1 if odd_region and block_size > 1 else 0)
    prompt_len = max(1, len(hashes) * region_tokens + extra - 20)
    req = trace_request(prompt_len, tuple(hashes), region_tokens)
    seq = req.seqs[0]
    bulk, pieces = BlockKeys(), BlockKeys()
    tokens = 0
    for step in steps:
        tokens += step
        seq.num_tokens = tokens
        bulk.extend_to(req, seq, block_size)
        pieces.extend(req.block_contents(seq, block_size, len(pieces)))
        assert len(bulk) == len(pieces) == len(req.block_contents(seq, block_size))
    whole = BlockKeys(req.block_contents(seq, block_size))
    assert bulk.keys == pieces.keys == whole.keys
    assert list(map(type, bulk.keys)) == list(map(type, whole.keys))
    assert bulk.hashes == pieces.hashes == whole.hashes


def test_an_offsets_hash_is_its_regions_first_hash_plus_the_offset():
    keys = BlockKeys()
    req = trace_request(3 * 64, (7, 8, 9), 64)   # 4 blocks of 16 tokens a region
    seq = req.seqs[0]
    keys.extend_to(req, seq, 16)
    h = keys.hashes
    assert len(h) == 12 and all(type(k) is RegionOffset for i, k in enumerate(keys.keys) if i % 4)
    for region in range(3):
        first = 4 * region
        parent = h[first - 1] if first else None
        assert h[first] == prefix_runs.chain_hash(parent, (7 + region, 64))
        assert h[first + 1:first + 4] == [h[first] + j for j in (1, 2, 3)]
    assert len(set(h)) == 12


def test_region_rule_follows_a_replaced_chain_hash(monkeypatch):
    """Tests force collisions by replacing `chain_hash`: region firsts use it, so two
    regions then share their offsets' hashes too (the cache's checks turn that into a
    miss, see test_memory_paged)."""
    monkeypatch.setattr(prefix_runs, "chain_hash", lambda parent, content: 5)
    keys = BlockKeys()
    req = trace_request(128, (1, 2), 64)
    keys.extend_to(req, req.seqs[0], 16)
    assert keys.hashes == [5, 6, 7, 8, 5, 6, 7, 8]


def test_a_region_offset_checks_its_range_and_survives_pickling():
    import pickle
    for offset, size in ((0, 4), (4, 4), (-1, 4)):
        with pytest.raises(ValueError, match="region offset"):
            RegionOffset(offset, size)
    o = pickle.loads(pickle.dumps(region_offsets(8)[2]))
    assert type(o) is RegionOffset and o == 3 and o.size == 8
    keys = [("r", 64), o, region_offsets(8)[3]]
    assert BlockKeys(keys).hashes == BlockKeys([("r", 64), *region_offsets(8)[2:4]]).hashes


offset_lists = st.lists(st.one_of(
    st.integers(1, 5).map(lambda j: region_offsets(6)[j - 1]),   # offsets, maybe out of layout
    st.integers(0, 6),                                           # plain ints: not offsets
    st.tuples(st.integers(0, 3), st.just(96))), max_size=30)


@settings(max_examples=300, deadline=None)
@given(keys=offset_lists, cuts=st.lists(st.integers(0, 30), max_size=5))
def test_keys_hash_the_same_however_they_are_split(keys, cuts):
    """The rule is per key (an offset j at position i >= j: hash i - j, plus j; any other
    key: chained), so an out-of-layout offset or a plain int equal to an offset hashes
    the same whichever `extend` call brings it."""
    whole = BlockKeys(keys)
    split = BlockKeys()
    bounds = sorted({0, len(keys), *(c for c in cuts if c <= len(keys))})
    for lo, hi in zip(bounds, bounds[1:]):
        split.extend(keys[lo:hi])
    assert split.hashes == whole.hashes
    for i, key in enumerate(keys):
        if type(key) is RegionOffset and 0 < key <= i:
            assert whole.hashes[i] == whole.hashes[i - key] + key
        else:
            assert whole.hashes[i] == prefix_runs.chain_hash(whole.hashes[i - 1] if i else None, key)
