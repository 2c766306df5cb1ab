"""The planner under load, closed loop (speculation/planner.py; issue 26 item 8): a simulated batch
whose steps cost what the planner's model says, whose drafts are accepted level by level with
probability γ, timed by the simulation's own clock (no wall time). `auto` must do at least about
as well as decoding alone at every batch size, switch speculation off where the batch makes it
unprofitable, and win clearly where drafting pays."""
from __future__ import annotations

import random

import pytest

from speculation.planner import AdaptiveSpeculation


def simulate(n: int, gamma: float, a: float = 0.05, b: float = 0.01, d: float = 0.01,
             steps: int = 400, seed: int = 0) -> tuple[float, float, float]:
    """(share of steps that speculated, tokens per simulated second with `auto`, the same decoding
    alone) for `n` sequences of acceptance `gamma`; a step costs max(a + b·rows, d·levels)."""
    rng = random.Random(seed)
    planner = AdaptiveSpeculation(max_spec_len=4)
    for _ in range(50):               # the cost model fitted on the batch shapes it will see
        for rows in (n, 2 * n, 3 * n):
            planner.costs.observe_verify(rows, a + b * rows)
    planner.costs.d = d
    streams = [f"s{i}" for i in range(n)]
    for s in streams:
        planner.add(s, "auto", 4, 1)
    speculated, tokens, clock = 0, 0, 0.0
    for _ in range(steps):
        plan = planner.plan(streams)
        depths = [plan[s][0] for s in streams]
        speculated += any(depths)
        clock += max(a + b * sum(1 + k for k in depths), d * max(depths))
        for s, k in zip(streams, depths):
            accepted = 0
            while accepted < k and rng.random() < gamma:
                accepted += 1
            if k:
                planner.observe(s, k, accepted)
            tokens += accepted + 1
    return speculated / steps, tokens / clock, n / (a + b * n)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("gamma", [0.3, 0.5, 0.7])
def test_auto_never_loses_more_than_a_few_percent_to_decoding_alone(n, gamma):
    share, auto, off = simulate(n, gamma)
    assert auto >= 0.97 * off, (share, auto, off)


def test_a_batch_that_makes_speculation_unprofitable_goes_off():
    share, auto, off = simulate(16, 0.7)       # 16 rows: each extra row costs more than it returns
    assert share <= 0.02 and auto == pytest.approx(off, rel=0.01)
    share, _, _ = simulate(8, 0.3)             # a poor draft: only the probes speculate
    assert share <= 0.05


def test_a_good_draft_on_a_small_batch_speculates_and_wins():
    share, auto, off = simulate(1, 0.7)
    assert share >= 0.9 and auto >= 1.4 * off
    share, auto, off = simulate(2, 0.7)
    assert share >= 0.9 and auto >= 1.2 * off
