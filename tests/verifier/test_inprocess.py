"""The in-process pump's choice of threads for a lockstep turn (verifier/inprocess.py): its
own, or with an idle drafter's cores borrowed, whichever commits tokens faster over windows of
steps (`verifier.choice.WindowedChoice`), and `MeasuredChoice` beneath it."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from drafter.runtime import DraftPass
from verifier.choice import MeasuredChoice, WindowedChoice
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


def test_a_turn_runs_on_the_count_whose_steps_verify_rows_fastest():
    """Windows of steps, step end to step end: one thread's steps take 3 ms here and two
    threads' 5 ms (what the turn's own seconds would not show: a second thread's wait for a
    busy core lands between the turns). The first step after a switch is left out; a trial of
    the count already measured clearly worse ends after `cut_after` steps; a step whose forward
    ran on another count, or that began after an idle loop, restarts the window."""
    import torch

    before = torch.get_num_threads()
    drafter = _Drafter()
    received = []
    scheduler = SimpleNamespace(threads=1, signals_for=lambda i: [], receive=received.append)
    pump = InProcessDrafters([drafter], num_cpus=1)
    window = pump.threads.window
    step_s, clock = {1: 0.003, 2: 0.005}, [0.0]

    async def run(fn, *args):
        return fn(*args)

    async def steps(k: int, threads: int | None, gap: float = 0.0) -> None:
        for _ in range(k):
            began = clock[0] + gap
            await pump(scheduler, run, threads)
            turn = pump.turn
            clock[0] = began + step_s[turn if turn is not None else 1]
            if turn is not None:
                trials.append(pump.trying(turn))
                pump.observe_step(turn, 2, began, clock[0])

    trials = []
    try:
        # the lent count first (its first step starts the clock, the next is left out), then one
        # thread's window; two threads' second trial is cut after its first measured step (5 ms
        # against 3: more than `CUT_FIRST` times), then one thread's second window, each after the
        # switch's step
        cut = 1
        asyncio.run(steps(3 * (window + 1) + cut + 3, 2))
        runs = drafter.threads
        assert runs[:window + 2] == [2] * (window + 2) and runs[window + 2:2 * window + 3] == [1] * (window + 1)
        assert runs[2 * window + 3:2 * window + 4 + cut] == [2] * (cut + 1)
        assert runs[2 * window + 4 + cut:] == [1] * (window + 2)
        assert pump.report() == {"1": pytest.approx(1.5), "2": pytest.approx(2.5)}    # ms per row
        # a turn on a count other than the cheapest measured (the first offered before any) is a trial,
        # which the step costs leave out (verifier.costs.StepKind.trial)
        assert trials == [False] * (window + 2) + [True] * (window + 1) + [True] * (cut + 1) + [False] * (window + 2)
        drafter.threads.clear()
        asyncio.run(steps(window, 2))
        assert drafter.threads == [1] * window           # one thread: 1.5 ms a token against 2.5
        assert len(received) == 4 * window + cut + 6 and all(e.draft_levels == 1 for e in received)
        # a forward on another count than its passes', or a step after an idle loop: no sample
        asyncio.run(pump(scheduler, run, 2))
        pump.observe_step(2, 2, clock[0], clock[0] + 100.0)
        clock[0] += 100.0
        asyncio.run(steps(2 * window, 2))
        assert max(max(q) for q in pump.threads.choice.samples.values()) < 0.01
        samples = {n: list(q) for n, q in pump.threads.choice.samples.items()}
        asyncio.run(steps(2 * window, 2, gap=1.0))
        assert {n: list(q) for n, q in pump.threads.choice.samples.items()} == samples
        drafter.threads.clear()
        asyncio.run(steps(3, None))              # no threads given: the turn keeps the current ones
        assert drafter.threads == [torch.get_num_threads()] * 3 and pump.turn is None
    finally:
        torch.set_num_threads(before)


def test_a_window_on_a_way_clearly_worse_is_cut_short():
    """`cut`: once the other way is measured, a window that after `cut_after` steps costs more
    than `cut` times it per unit ends there, its sample standing for every trial the way lacks
    (not tried again before a recheck); within the margin, or without a cut, it runs whole."""
    def run(costs: dict, cut) -> list:
        w = WindowedChoice("a", window=6, trials=2, recheck=100, cut=cut, cut_after=2)
        clock, ways = 0.0, []
        w.observe(1, clock, ("a", "b"))               # starts the clock
        for _ in range(40):
            ways.append(w.current)
            clock += costs[w.current]
            w.observe(1, clock, ("a", "b"))
        return ways

    # a (the default) runs its window (the first step after the start left out); b at 3x is cut
    # after the switch's step and 2 more, which settles both its trials; then a alone
    cut = run({"a": 1.0, "b": 3.0}, 1.2)
    assert cut[:7] == ["a"] * 7 and cut[7:] == ["b"] * 3 + ["a"] * 30
    assert run({"a": 1.0, "b": 3.0}, None).count("b") == 14          # no cut: two whole windows
    # `cut_first`: at that margin the window ends after its first measured step; below it, after
    # `cut_after`
    def run_first(cost_b: float) -> list:
        w = WindowedChoice("a", window=6, trials=2, recheck=100, cut=1.2, cut_after=3, cut_first=1.4)
        clock, ways = 0.0, []
        w.observe(1, clock, ("a", "b"))
        for _ in range(40):
            ways.append(w.current)
            clock += {"a": 1.0, "b": cost_b}[w.current]
            w.observe(1, clock, ("a", "b"))
        return ways

    assert run_first(1.6)[7:] == ["b"] * 2 + ["a"] * 31              # the switch's step and one
    assert run_first(1.3)[7:] == ["b"] * 4 + ["a"] * 29              # the switch's step and three
    assert run_first(1.1).count("b") == 14
    assert run({"a": 1.0, "b": 1.1}, 1.2).count("b") == 14          # within the margin: whole


def test_when_the_counts_on_offer_change_the_turn_restarts_on_the_most():
    """A window begun on the verifier's own threads while the drafter was busy does not run on
    once the drafter's cores are lent: the turn moves to the most threads and measures afresh."""
    import torch

    before = torch.get_num_threads()
    drafter = _Drafter()
    scheduler = SimpleNamespace(threads=1, signals_for=lambda i: [], receive=lambda e: None)
    pump = InProcessDrafters([drafter], num_cpus=1)

    async def run(fn, *args):
        return fn(*args)

    try:
        for offered in (1, 1, 1, 2, 2, 1, 2):
            asyncio.run(pump(scheduler, run, offered))
            pump.observe_step(pump.turn, 2, 0.0, 0.001)
        assert drafter.threads == [1, 1, 1, 2, 2, 1, 2]
        assert pump.threads.choice.samples == {}                 # no window ran whole
    finally:
        torch.set_num_threads(before)
