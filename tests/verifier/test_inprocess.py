"""The in-process pump's choice of threads for a lockstep turn (verifier/inprocess.py): its
own, or with an idle drafter's cores borrowed, whichever runs a turn (the draft passes and
the forward that verifies them) faster here."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from drafter.runtime import DraftPass
from verifier.choice import MeasuredChoice
from verifier.inprocess import InProcessDrafters


def test_each_candidate_is_tried_in_turn_then_the_cheapest_runs():
    choice = MeasuredChoice(trials=3, recheck=5)
    cost = {1: 1.0, 2: 3.0}           # seconds per level: one thread is cheaper here
    seen = []
    for _ in range(6):
        n = choice.pick((2, 1))
        seen.append(n)
        choice.observe(n, cost[n] * 4, 4)
    assert sorted(seen) == [1, 1, 1, 2, 2, 2] and seen[:2] in ([1, 2], [2, 1])     # alternated
    assert choice.cost(1) == pytest.approx(1.0) and choice.cost(2) == pytest.approx(3.0)
    picks = [choice.pick((1, 2)) for _ in range(10)]
    assert picks.count(2) == 2 and picks[4] == 2 and picks[9] == 2     # every 5th use rechecks the other
    assert all(p == 1 for i, p in enumerate(picks) if i not in (4, 9))


def test_a_drift_moves_the_choice():
    choice = MeasuredChoice(trials=2, recheck=3)
    for n, s in ((1, 1.0), (2, 2.0), (1, 1.0), (2, 2.0)):
        choice.observe(n, s, 1)
    assert choice.pick((1, 2)) == 1
    picks = []
    for _ in range(9):                 # the one-thread passes get slow: two takes over
        n = choice.pick((1, 2))
        picks.append(n)
        choice.observe(n, 5.0 if n == 1 else 2.0, 1)
    # one slow pass and its median (1, 5) is above two's; every 3rd use (the 3rd, 6th, 9th) rechecks one
    assert picks == [1, 1, 2, 2, 1, 2, 2, 1, 2]


def test_one_candidate_and_empty_passes():
    choice = MeasuredChoice(trials=2)
    assert [choice.pick((2, 2)) for _ in range(3)] == [2, 2, 2]
    choice.observe(2, 1.0, 0)          # a pass that drafted no level says nothing of its cost
    assert choice.cost(2) == float("inf")


class _Drafter:
    """Drafts one level a pass, slower on two threads than on one."""

    index, incarnation, node = 7, "inc", "n"

    def __init__(self) -> None:
        self.streams = {"s": object()}
        self.threads = []

    def apply(self, signals) -> None:
        pass

    def draft(self) -> DraftPass:
        import torch

        n = torch.get_num_threads()
        self.threads.append(n)
        return DraftPass(seconds=0.004 if n == 2 else 0.001, levels=1, more=True)

    def resync_requests(self) -> list[str]:
        return []


def test_a_turn_runs_on_the_count_cheaper_for_passes_and_forward_together():
    """Drafting alone is cheaper on one thread here, the forward on two by more: the turn, one
    count for both, goes to two. A forward on another count than its passes' is not a sample."""
    import torch

    before = torch.get_num_threads()
    drafter = _Drafter()
    received = []
    scheduler = SimpleNamespace(threads=1, signals_for=lambda i: [], receive=received.append)
    pump = InProcessDrafters([drafter], num_cpus=1)
    forward_s = {1: 0.006, 2: 0.001}        # the forward: two threads much faster

    async def run(fn, *args):
        return fn(*args)

    async def turns(k: int, threads: int | None) -> None:
        for _ in range(k):
            await pump(scheduler, run, threads)
            if pump.turn is not None:
                pump.observe_turn(pump.turn, forward_s[pump.turn])

    try:
        asyncio.run(turns(16 + 10, 2))           # 8 trials each, then 10 turns
        assert drafter.threads[:16].count(1) == drafter.threads[:16].count(2) == 8
        assert drafter.threads[16:] == [2] * 10      # 2: 4 + 1 ms a turn, against 1 + 6 on one thread
        assert pump.threads.cost(2) == pytest.approx(0.005) and pump.threads.cost(1) == pytest.approx(0.007)
        assert len(received) == 26 and all(e.draft_levels == 1 for e in received)
        asyncio.run(pump(scheduler, run, 2))
        picked = pump.turn
        pump.observe_turn(3 - picked, 100.0)        # its forward ran on the other count: no sample
        assert pump.turn is None and pump.threads.cost(picked) < 0.01
        drafter.threads.clear()
        asyncio.run(turns(3, None))              # no threads given: the turn keeps the current ones
        assert drafter.threads == [torch.get_num_threads()] * 3 and pump.turn is None
    finally:
        torch.set_num_threads(before)
