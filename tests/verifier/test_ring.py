"""The ring of in-flight trees (verifier/ring.py): bounded slots, staleness by epoch and claimed
prefix."""
from __future__ import annotations

import pytest

from verifier.ring import Ring, RingEntry, StreamRing, claims_prefix
from speculation.wire import TreeHeader


def entry(prefix: list[int], anchor: int, epoch: int = 0, tree_id: int = 0, stream: str = "s") -> RingEntry:
    h = TreeHeader(stream, epoch, tree_id, len(prefix), anchor, prefix[anchor:], 2, 0)
    return RingEntry(h, payload=None)


def test_ring_is_bounded_per_stream():
    ring = StreamRing(2)
    assert ring.put(entry([1, 2], 2, tree_id=0))[0]
    assert ring.put(entry([1, 2, 3], 2, tree_id=1))[0]
    ok, dropped = ring.put(entry([1, 2, 3, 4], 2, tree_id=2))
    assert not ok and dropped == [] and len(ring) == 2 and ring.full


def test_newer_epoch_evicts_stale_entries_and_older_epoch_is_refused():
    ring = StreamRing(3)
    ring.put(entry([1, 2], 2, epoch=0))
    ring.put(entry([1, 2, 3], 2, epoch=0, tree_id=1))
    ok, dropped = ring.put(entry([1, 2, 9], 3, epoch=1, tree_id=2))
    assert ok and len(dropped) == 2 and len(ring) == 1
    ok, dropped = ring.put(entry([1, 2, 3, 4], 2, epoch=0, tree_id=3))
    assert not ok and len(dropped) == 1


def test_head_valid_checks_the_whole_claimed_prefix():
    ring = StreamRing(3)
    ring.put(entry([1, 2, 7], 2, tree_id=0))        # assumed token 7 after the confirmed [1, 2]
    ring.put(entry([1, 2, 8, 4], 2, tree_id=1))     # assumed [8, 4]
    head, dropped = ring.head_valid([1, 2, 8, 4])   # committed: 8 then 4, same length as tree 1
    assert head.header.tree_id == 1 and [d.header.tree_id for d in dropped] == [0]
    head, dropped = ring.head_valid([1, 2, 8, 5])   # same length, one token differs: stale
    assert head is None and len(dropped) == 1 and len(ring) == 0


def test_claims_prefix_compares_tokens_not_only_lengths():
    h = TreeHeader("s", 0, 0, 4, 2, [3, 4], 1, 0)
    assert claims_prefix(h, [1, 2, 3, 4])
    assert not claims_prefix(h, [1, 2, 3, 5])
    assert not claims_prefix(h, [1, 2, 3])


def test_ring_set_remove_frees_slots_and_unknown_streams_are_dropped():
    rings = Ring(2)
    rings.add_stream("a")
    rings.put(entry([1], 1, stream="a"))
    assert rings.total() == 1 and rings.capacity() == 2
    ok, dropped = rings.put(entry([1], 1, stream="gone"))
    assert not ok and len(dropped) == 1
    assert len(rings.remove_stream("a")) == 1 and rings.total() == 0
    with pytest.raises(ValueError):
        StreamRing(0)
