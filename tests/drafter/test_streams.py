"""The drafter's assumption bookkeeping (drafter/streams.py): the outcome each tree in flight
assumes, held or broken by the verifier's signals, rollback, bridges and restarts."""
from __future__ import annotations

from drafter.streams import DraftStream, cut_tree, greedy_outcome
from speculation.wire import Signal
from models.sampling import SamplingParams
from models.tree import TokenTree


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


def test_a_contradicted_restart_tree_is_followed_by_another_restart():
    """A restart tree is a tree like any other: its outcome assumed, the next tree drafted
    after it; contradicted, the drafter restarts again (its `bridge` flag: a contradiction)."""
    s = DraftStream("s", [1, 2], 0, SamplingParams(temperature=0), 0)
    f = s.record(2, [5, 6, 7], 2)
    assert s.on_step(Signal("step", "s", 0, f.tree_id, 4, [5, 4], restart=1))[0] and s.bridge
    assert s.restart == 1                         # the verifier's word: a chain of 1 after [1, 2, 5, 4]
    s.bridge = False                              # the drafter drafted its restart tree:
    r = s.record(4, [8, 9], 1)                    # a chain [8] after [1, 2, 5, 4], guess 9
    s.record(6, [3, 3], 1)
    assert s.position() == [1, 2, 5, 4, 8, 9, 3, 3]
    bumped, keep, wasted = s.on_step(Signal("step", "s", 1, r.tree_id, 6, [8, 1]))
    assert bumped and s.bridge and wasted == 1 and keep == 5 and s.restart == 0   # told to bridge now
    s.on_step(Signal("step", "s", 2, -1, 7, [2], restart=3))
    s.resync([1, 2, 5, 4, 8, 1, 2], 3)
    assert s.restart == 0 and not s.bridge
