"""Of a few ways to do one kind of work, the one measured cheapest per unit (DESIGN.md §8).

Two users, both over windows of steps (`WindowedChoice`): the threads of the verifier's own
lockstep turns (`verifier.inprocess`: its own, or with the idle drafters' cores too) and how a
lone stream's drafter on a device of its own runs (`verifier.regime`: overlapped or in
lockstep). Either way the candidates' costs are what this machine measures now, not what a rule
expects.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Sequence


class MeasuredChoice:
    """Of a few candidates for one kind of work, the one measured cheapest per unit.

    Each candidate is tried in turn (the one with the fewest samples first, the earlier given
    on a tie: the caller's default leads) until each has `trials`; then the cheapest by median
    seconds per unit over its last `trials` samples runs, and every `recheck`-th use goes to
    another candidate in turn, so that a drift (a neighbour's load, Ray's traffic) is seen."""

    def __init__(self, trials: int = 8, recheck: int = 64) -> None:
        self.trials, self.recheck = trials, recheck
        self.samples: dict[Hashable, deque] = {}     # candidate -> its last seconds per unit
        self.uses = 0                                # picks since every candidate had its trials

    def pick(self, candidates: Sequence[Hashable]) -> Hashable:
        options = list(dict.fromkeys(candidates))
        if len(options) == 1:
            return options[0]
        counts = {n: len(self.samples.get(n, ())) for n in options}
        if min(counts.values()) < self.trials:
            return min(options, key=lambda n: counts[n])
        best = self.best(options)
        self.uses += 1
        if self.uses % self.recheck == 0:
            others = [n for n in options if n != best]
            return others[(self.uses // self.recheck) % len(others)]
        return best

    def best(self, candidates: Sequence[Hashable]) -> Hashable:
        """The candidate measured cheapest (the earliest given among those unmeasured or tied)."""
        return min(dict.fromkeys(candidates), key=self.cost)

    def cost(self, candidate: Hashable) -> float:
        """Median seconds per unit measured for `candidate` (inf before any sample)."""
        seen = self.samples.get(candidate)
        return statistics.median(seen) if seen else float("inf")

    def observe(self, candidate: Hashable, seconds: float, units: float, settled: bool = False) -> None:
        """A sample of `candidate`; `settled`: it stands for every trial the candidate still lacks
        (it was seen to be clearly worse: no second trial until a recheck)."""
        if units > 0:
            seen = self.samples.setdefault(candidate, deque(maxlen=self.trials))
            seen.append(seconds / units)
            if settled:
                seen.extend([seconds / units] * (self.trials - len(seen)))

    def report(self) -> dict[str, float]:
        """{candidate: median ms per unit} of every candidate measured."""
        return {str(n): 1e3 * self.cost(n) for n in sorted(self.samples, key=str)}


class WindowedChoice:
    """Of a few ways to run a run of steps, the one measured cheapest per unit over windows of
    consecutive steps (`MeasuredChoice` over the windows): a window's cost is its wall time,
    step end to step end, so that what a way costs beside its own work (another thread's
    wake-ups, a core it takes from a neighbour) counts too, per unit of work the caller counts
    (committed tokens for the regime, rows verified for the threads). The first step after a
    switch or a restart is left out: it pays for the switch."""

    def __init__(self, default: Hashable, window: int = 12, trials: int = 2, recheck: int = 12,
                 gap_s: float | None = None, cut: float | None = None, cut_after: int = 3,
                 cut_first: float | None = None) -> None:
        """`gap_s`: a step that began later than this after the last one ended (the loop idled
        between them) restarts the measurement; None: waits between steps are a way's cost.
        `cut`: a window that after `cut_after` steps already costs more per unit than `cut` times
        the cheapest other candidate measured ends there, its sample standing for every trial the
        way still lacks (a way clearly worse is not run for a whole window, nor tried again before
        a recheck); None: windows run whole (for a unit too noisy over a few steps, such as
        committed tokens). `cut_first`: a larger margin at which the window ends after its first
        measured step already (a trial of a way 1.6 times dearer then costs the switch's step and
        one more, not four)."""
        self.choice = MeasuredChoice(trials, recheck)
        self.current = default
        self.window, self.gap_s = window, gap_s
        self.cut, self.cut_after, self.cut_first = cut, cut_after, cut_first
        self._last: float | None = None      # when the previous step ended
        self._reset(skip=True)

    def restart(self, now: float | None) -> None:
        """Measure again from `now` (None: from the next step's end); the next step is left out."""
        self._last = now
        self._reset(skip=True)

    def observe(self, units: float, now: float, candidates: Sequence[Hashable], began: float | None = None) -> None:
        """A step on `current` ended at `now`, having done `units`; at a window's end the way for
        the next is picked among `candidates`."""
        if self._last is None or (self.gap_s is not None and began is not None and began - self._last > self.gap_s):
            self.restart(now)
            return
        seconds, self._last = now - self._last, now
        if self._skip:
            self._skip = False
            return
        self._steps += 1
        self._units += units
        self._seconds += seconds
        worse = self._steps < self.window and self._clearly_worse(candidates)
        if self._steps >= self.window or worse:
            self.choice.observe(self.current, self._seconds, self._units, settled=worse)
            chosen = self.choice.pick(candidates)
            self._reset(skip=chosen != self.current)
            self.current = chosen

    def _clearly_worse(self, candidates: Sequence[Hashable]) -> bool:
        """The window so far costs `cut` times the cheapest other candidate's measured cost (after
        `cut_after` steps; `cut_first` times it, after one)."""
        margin = self.cut if self._steps >= self.cut_after else self.cut_first
        if margin is None or self._units <= 0:
            return False
        best_other = min((self.choice.cost(c) for c in candidates if c != self.current), default=float("inf"))
        return self._seconds / self._units > margin * best_other

    def _reset(self, skip: bool) -> None:
        self._steps, self._units, self._seconds = 0, 0.0, 0.0
        self._skip = skip
