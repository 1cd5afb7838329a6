"""Shared by the block-manager state machines: `append_slots_many` checked against
`append_slots` called for each sequence in turn."""
from __future__ import annotations

import copy

from servelab.memory import BlockManagerError


def append_many_as_one_by_one(m, group, state):
    """Call m.append_slots_many(group) and check it against append_slots for each entry
    in turn on a copy: both fail, or both succeed with the same copies and the same
    `state(manager)`. Returns (the copies or None on failure, a copy of m from before the
    call) so that the caller can check what a failure left."""
    one_by_one = copy.deepcopy(m)
    try:
        expected = [c for s, k in group for c in one_by_one.append_slots(s, k)]
    except BlockManagerError:
        expected = None
    before = copy.deepcopy(m)
    try:
        copies = m.append_slots_many(group)
    except BlockManagerError:
        assert expected is None, "append_slots_many failed where one by one fits"
        return None, before
    assert expected is not None, "append_slots_many grew what one by one cannot"
    assert copies == expected
    assert state(m) == state(one_by_one)
    return copies, before
