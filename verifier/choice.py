"""Of a few ways to do one kind of work, the one measured cheapest per unit (DESIGN.md §8).

Two users: the threads of the verifier's own lockstep turns (`verifier.inprocess`: its own, or
with the idle drafters' cores too) and how a lone stream's drafter on a device of its own runs
(`verifier.regime`: overlapped or in lockstep). Either way the candidates' costs are what this
machine measures now, not what a rule expects.
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
        best = min(options, key=self.cost)
        self.uses += 1
        if self.uses % self.recheck == 0:
            others = [n for n in options if n != best]
            return others[(self.uses // self.recheck) % len(others)]
        return best

    def cost(self, candidate: Hashable) -> float:
        """Median seconds per unit measured for `candidate` (inf before any sample)."""
        seen = self.samples.get(candidate)
        return statistics.median(seen) if seen else float("inf")

    def observe(self, candidate: Hashable, seconds: float, units: float) -> None:
        if units > 0:
            self.samples.setdefault(candidate, deque(maxlen=self.trials)).append(seconds / units)

    def report(self) -> dict[str, float]:
        """{candidate: median ms per unit} of every candidate measured."""
        return {str(n): 1e3 * self.cost(n) for n in sorted(self.samples, key=str)}
