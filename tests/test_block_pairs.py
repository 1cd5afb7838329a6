"""`BlockPairs`: block copies kept as two columns (servelab/outputs.py), what the CPU tier
hands the executor. It must read as the list of pairs it stands for, everywhere a list
of pairs was read: equality, length, truth, iteration, indexing, its repr."""
from __future__ import annotations

import pytest

from servelab.outputs import BatchShape, BlockPairs, SchedulerOutput


def test_block_pairs_read_as_the_list_of_pairs():
    pairs = BlockPairs([4, 1, 7], [0, 2, 5])
    assert pairs == [(4, 0), (1, 2), (7, 5)] and [(4, 0), (1, 2), (7, 5)] == pairs
    assert pairs != [(4, 0), (1, 2)] and pairs != [(4, 0), (1, 2), (7, 6)]
    assert len(pairs) == 3 and bool(pairs) and not BlockPairs([], [])
    assert list(pairs) == [(4, 0), (1, 2), (7, 5)]
    assert pairs[1] == (1, 2) and pairs[-1] == (7, 5) and pairs[:2] == [(4, 0), (1, 2)]
    assert repr(pairs) == "[(4, 0), (1, 2), (7, 5)]"
    assert (BlockPairs([], []), BlockPairs([3], [9])) == ([], [(3, 9)])


def test_columns_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="2 sources for 1 destinations"):
        BlockPairs([1, 2], [3])


def test_a_step_prices_and_tells_its_copies_by_count():
    out = SchedulerOutput(now=0.0, offload=BlockPairs([1, 2], [5, 6]),
                          load=BlockPairs([7], [3]))
    assert not out.is_empty
    shape = BatchShape.from_output(out)
    assert (shape.num_offload_blocks, shape.num_load_blocks) == (2, 1)
    assert SchedulerOutput(now=0.0, offload=BlockPairs([], []), load=BlockPairs([], [])).is_empty
