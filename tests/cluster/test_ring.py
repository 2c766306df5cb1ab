"""The ring of in-flight trees (verifier/ring.py) and the drafter's assumption bookkeeping
(drafter/streams.py): bounded slots, staleness by epoch and claimed prefix, rollback."""
from __future__ import annotations

import pytest
import torch

from verifier.ring import Ring, RingEntry, StreamRing, claims_prefix
from drafter.streams import DraftStream, cut_tree, greedy_outcome
from speculation.wire import Signal, TreeHeader
from models.sampling import SamplingParams
from models.tree import TokenTree


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


def chain_tree(tokens, prefix_len):
    return TokenTree.chain(tokens, None, prefix_len)


def test_greedy_outcome_and_cut():
    tree = chain_tree([5, 6, 7], 10)         # drafted one level deeper than sent
    path, tokens, guess = greedy_outcome(tree, 2)
    assert path == [0, 1] and tokens == [5, 6] and guess == 7
    cut = cut_tree(tree, 2)
    assert cut.token_ids.tolist() == [5, 6] and cut.prefix_len == 10
    # a path that ends before the extra level: no guess, the drafter can't run ahead
    assert greedy_outcome(chain_tree([5], 10), 2)[2] is None


def test_draft_stream_assumption_held_then_broken():
    s = DraftStream("s", [1, 2], epoch=0, params=SamplingParams(temperature=0), seed=0)
    s.budget = (2, 1)
    assert s.ready(slots=2)
    t0 = s.record(2, [5, 6, 7], 2)           # tree 0 assumes 5, 6 accepted and bonus 7
    assert s.position() == [1, 2, 5, 6, 7]
    s.record(5, [8, 9, 10], 2)               # tree 1 drafted on that assumption
    assert not s.ready(slots=2)              # ring full: backpressure
    rolled, keep, wasted = s.on_step(Signal("step", "s", 0, t0.tree_id, 5, [5, 6, 7]))
    assert not rolled and s.epoch == 0 and len(s.inflight) == 1
    rolled, keep, wasted = s.on_step(Signal("step", "s", 0, 1, 7, [8, 3]))   # 9 rejected, 3 instead
    assert rolled and s.epoch == 1 and not s.inflight
    assert s.confirmed == [1, 2, 5, 6, 7, 8, 3]
    assert keep == 6                           # [1, 2, 5, 6, 7, 8] still true; root 3 is fed afresh


def test_draft_stream_plain_decoding_step_invalidates_assumptions():
    s = DraftStream("s", [1, 2], 0, SamplingParams(temperature=0), 0)
    s.record(2, [5, 6], 1)
    rolled, keep, _ = s.on_step(Signal("step", "s", 0, -1, 3, [4]))   # verifier decoded alone
    assert rolled and keep == 2 and s.position() == [1, 2, 4]
    rolled, keep, _ = s.on_step(Signal("step", "s", 1, -1, 4, [9]))   # nothing in flight: no rollback
    assert not rolled and keep is None


def test_tree_without_a_guess_rolls_the_draft_kv_back_without_a_new_epoch():
    """A tree whose greedy path ends early has no assumed outcome: nothing is drafted past it,
    but the draft KV holds its path and must be cut back to what was committed."""
    s = DraftStream("s", [1, 2], 0, SamplingParams(temperature=0), 0)
    s.budget = (3, 2)
    f = s.record(2, None, 5, cached=[7, 8])
    assert s.position() is None and not s.ready(slots=2)
    bumped, keep, _ = s.on_step(Signal("step", "s", 0, f.tree_id, 4, [7, 9]))
    assert not bumped and s.epoch == 0
    assert keep == 3                              # [1, 2, 7] still true; 9 is the next root
    assert s.ready(slots=2) and s.position() == [1, 2, 7, 9]


def test_contradicted_tree_makes_the_drafter_bridge_and_a_bridge_step_is_checked():
    s = DraftStream("s", [1, 2], 0, SamplingParams(temperature=0), 0)
    f = s.record(2, [5, 6], 1)
    bumped, keep, _ = s.on_step(Signal("step", "s", 0, f.tree_id, 4, [5, 4]))
    assert bumped and s.bridge
    s.record_bridge(9)                            # drafted after [1, 2, 5, 4] + guess 9
    s.record(5, [3, 3], 1)
    assert s.position() == [1, 2, 5, 4, 9, 3, 3]
    bumped, _, _ = s.on_step(Signal("step", "s", 1, -1, 5, [9]))   # the bridge step confirmed 9
    assert not bumped and not s.bridge and len(s.inflight) == 1
    bumped, _, _ = s.on_step(Signal("step", "s", 1, 1, 7, [3, 7]))  # next tree contradicted
    assert bumped and s.bridge


def test_a_contradicted_bridge_chain_is_followed_by_another_bridge():
    """A bridge chain (`bridge_depth` > 0) announces the draft's path; the drafter assumes its
    r tokens plus its own next one. Contradicted, the verifier bridges again, and so does the
    drafter; confirmed, the restart tree drafted after it is valid."""
    s = DraftStream("s", [1, 2], 0, SamplingParams(temperature=0), 0)
    f = s.record(2, [5, 6], 1)
    s.on_step(Signal("step", "s", 0, f.tree_id, 4, [5, 4]))
    assert s.bridge
    s.record_bridge([9, 8, 7])                    # the verifier's chain [9, 8], then guess 7
    s.record(7, [3, 3], 1)
    assert s.position() == [1, 2, 5, 4, 9, 8, 7, 3, 3]
    bumped, keep, wasted = s.on_step(Signal("step", "s", 1, -1, 6, [9, 6]))   # chain rejected at 8
    assert bumped and s.bridge and s.epoch == 2 and not s.inflight and wasted == 1
    assert keep == 5 and s.confirmed == [1, 2, 5, 4, 9, 6]   # 9 still true; 6 the next root
    s.record_bridge([3, 3, 3])
    s.record(9, [4, 4], 1)
    bumped, _, _ = s.on_step(Signal("step", "s", 2, -1, 9, [3, 3, 3]))        # as assumed
    assert not bumped and not s.bridge and len(s.inflight) == 1
    # a plain bridge (one guessed token) contradicted is not followed by another bridge
    s2 = DraftStream("t", [1], 0, SamplingParams(temperature=0), 0)
    s2.record_bridge(4)
    bumped, _, _ = s2.on_step(Signal("step", "t", 0, -1, 2, [5]))
    assert bumped and not s2.bridge


def test_bridge_chain_depth_is_decided_alike_from_settings_params_and_budget():
    from speculation.policy import bridge_chain_depth
    from speculation.settings import MAX_BRIDGE_DEPTH, EngineSettings

    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.8)
    on = EngineSettings(bridge_depth=2)
    assert bridge_chain_depth(on, greedy, 5) == 2
    assert bridge_chain_depth(on, greedy, 1) == 1           # within the budget the verifier sent
    assert bridge_chain_depth(on, greedy, 0) == 0           # speculation off: decode alone
    assert bridge_chain_depth(on, sampled, 5) == 0          # sampling: the drafter cannot know the chain
    assert bridge_chain_depth(on, greedy, 5, proposer="ngram") == 0   # prompt lookup drafts no chain
    assert bridge_chain_depth(EngineSettings(bridge_depth=0), greedy, 5) == 0
    assert bridge_chain_depth(EngineSettings.model_construct(bridge_depth=9), greedy, 16) == MAX_BRIDGE_DEPTH


def test_after_a_contradiction_both_sides_choose_a_restart_tree_or_a_bridge_alike():
    """`restart_depth` s: the drafter's next tree after a contradicted outcome is a restart
    chain of min(s, budget) with no bridge before it exactly where the verifier does not
    bridge (`restart_tree_depth`); a budget of 0 bridges; with s = 0 the drafter bridges
    (plainly, or after a bridge chain); without a contradiction nothing changes."""
    from speculation.policy import next_tree_shape, restart_tree_depth
    from speculation.settings import EngineSettings

    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.8)
    for settings in (EngineSettings(restart_depth=1), EngineSettings(restart_depth=3),
                     EngineSettings(), EngineSettings(bridge_depth=2)):
        for params in (greedy, sampled):
            for budget in ((0, 0), (1, 1), (2, 2), (6, 1)):
                verifier_bridges = restart_tree_depth(settings, budget[0]) == 0
                depth, width, bridge = next_tree_shape(settings, params, budget, True)
                assert (bridge > 0) == verifier_bridges, (settings, budget)
                if not verifier_bridges:
                    assert (depth, width) == (min(settings.restart_depth, budget[0]), 1)
                else:
                    assert (depth, width) == budget
                assert next_tree_shape(settings, params, budget, False) == (*budget, 0)
    assert next_tree_shape(EngineSettings(restart_depth=3), greedy, (6, 2), True) == (3, 1, 0)
    assert next_tree_shape(EngineSettings(bridge_depth=2), greedy, (6, 1), True) == (6, 1, 3)
    assert next_tree_shape(EngineSettings(bridge_depth=2), sampled, (6, 1), True) == (6, 1, 1)


def test_a_contradicted_restart_tree_is_followed_by_another_restart():
    """A restart tree is a tree like any other: its outcome assumed, the next tree drafted
    after it; contradicted, the drafter restarts again (its `bridge` flag: a contradiction)."""
    s = DraftStream("s", [1, 2], 0, SamplingParams(temperature=0), 0)
    f = s.record(2, [5, 6, 7], 2)
    assert s.on_step(Signal("step", "s", 0, f.tree_id, 4, [5, 4]))[0] and s.bridge
    s.bridge = False                              # the drafter drafted its restart tree:
    r = s.record(4, [8, 9], 1)                    # a chain [8] after [1, 2, 5, 4], guess 9
    s.record(6, [3, 3], 1)
    assert s.position() == [1, 2, 5, 4, 8, 9, 3, 3]
    bumped, keep, wasted = s.on_step(Signal("step", "s", 1, r.tree_id, 6, [8, 1]))
    assert bumped and s.bridge and wasted == 1 and keep == 5
