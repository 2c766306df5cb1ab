"""What a verification step costs, measured, one model per way of stepping (DESIGN.md §8).

The planner (`speculation.planner.AdaptiveSpeculation`) weighs committed tokens against
step time; the step time comes from here. Three linear models, fitted from the steps
themselves:

- **overlap**: drafting runs beside verification (the pipeline with trees in flight): a
  step costs the larger of the forward and the drafter's levels, plus, when it speculates,
  the measured wait for trees per speculating step (`CostModel.wait`). The wait is a cost of
  the step, not of its rows: fitted into the forward's a + b·rows, the waits of the few
  speculating steps among many plain ones made every row look dear and the planner decline
  (bench/README.md, one core per model on math);
- **lockstep**: the drafter drafts while the verifier waits (one tree in flight; the
  in-process engine always): the forward plus the wait for the trees, the wait priced as a
  part per tree plus one per draft level. On a CPU a lockstep verification runs on the
  drafter's cores too: one fit of both kinds of step would misprice each;
- **plain**: steps in which every sequence decodes alone while they borrow idle drafters'
  cores (a CPU), or on a GPU, where a one-row forward runs another kernel than a few-row one:
  the baseline a plan must beat.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from speculation.cost_model import CostModel, one_off_costs
from speculation.planner import AdaptiveSpeculation

# how long a batch's recent size is remembered when planning (`StepCosts.refilling`)
REFILL_MEMORY_S = 1.0


@dataclass
class StepKind:
    """What a verification step's batch was planned as, noted when it is collected
    (`verifier.scheduler.Scheduler.collect`), for pricing the idle waits before it."""

    planned: bool = False      # some sequence of it had a budget > 0 (a tree, a bridge after one, a late tree)
    catching_up: bool = False  # some sequence waited for its drafter's first tree after a (re)sync
    lockstep: bool = False     # it has drafted trees, every one's drafter in lockstep when collected
    settling: bool = False     # a lone stream's regime switched a step or two before (`verifier.regime`):
    #                            trees drafted the other way may still arrive, so its waits price neither way
    trial: bool = False        # its lockstep turn ran on a thread count being tried, not the one the turns
    #                            run on (`verifier.inprocess.InProcessDrafters.trying`): priced nowhere


class StepCosts:
    def __init__(self, planner: AdaptiveSpeculation, model, settings, threads: int) -> None:
        """`settings`: the engine's (`speculation.settings.EngineSettings`: its device)."""
        self.planner, self.settings, self.threads = planner, settings, threads
        self.overlap = planner.costs
        self.lockstep = CostModel(overlap=False)
        self.plain = CostModel()
        for m in (self.overlap, self.lockstep, self.plain):
            m.one_off = one_off_costs(model)
        self.idle_carry = 0.0                        # idle seconds since the last verify step
        self._recent_rows: deque = deque()           # (time, sequences planned for)
        self.forward_by_rows: dict[int, list[float]] = {}   # rows -> [count, seconds] of target forwards
        self.borrowed_by_rows: dict[int, list[float]] = {}  # the same, for steps on borrowed cores

    def choose(self, overlapped: bool, lendable_later: int) -> None:
        """Before a plan: while every drafter runs in lockstep, a step costs the wait for its
        trees plus the forward and no bridges follow; else drafting runs beside verification
        and contradicted outcomes bridge. `lendable_later`: the threads a plain step would have
        once the drafters idle."""
        self.planner.bridges = overlapped
        self.planner.costs = self.overlap if overlapped else self.lockstep
        if overlapped and not self.overlap.observed and self.borrowing_measured(lendable_later):
            # No step on our own threads measured yet (plain ones run on the drafters' cores
            # too): a speculating step, which gives those cores back, is priced as the measured
            # plain step on our threads alone (ideal scaling), not as the model's prior (52 ms
            # for 16 rows; one thread of this project's CPU took ~210 ms).
            a, b = self.plain.coefficients
            scale = lendable_later / self.threads
            self.overlap.prior = (a * scale, b * scale)
        if not overlapped and not self.lockstep.observed and self.plain.observed:
            # No lockstep step measured yet, plain ones are: a lockstep forward runs on the
            # drafter's cores too, as the plain steps did, so it starts from their cost, not the
            # model's prior (22 ms a row). Against measured 13 ms plain steps, that prior made every
            # tree look a loss and a server whose first requests decoded alone never speculated
            # (`bench/load.py --engine pipeline`: 0 of 1388 steps drafted).
            self.lockstep.prior = self.plain.coefficients

    def borrowing_measured(self, lendable_later: int) -> bool:
        """Plain steps would run on borrowed cores (once the drafters are idle: a drafter busy
        with a tree now does not make decoding alone dearer), and such steps have been measured."""
        return self.plain.observed and lendable_later != self.threads

    def plain_step_s(self, rows: int, lendable_later: int) -> float | None:
        """What a step of `rows` sequences all decoding alone costs: on borrowed cores, when it
        would borrow and such steps have been measured; on a GPU, as plain steps measured; else
        None (the planner's own model)."""
        if self.borrowing_measured(lendable_later) or (self.settings.device != "cpu" and self.plain.observed):
            return self.plain.step_time(rows, 0)
        return None

    def refilling(self, rows: int, lendable_later: int) -> int:
        """Sequences a plan should assume besides the `rows` running now: while plain steps
        borrow the drafters' cores, as many as the batch has lost within the last
        `REFILL_MEMORY_S` (under steady load, sequences that finished are replaced within a
        fraction of a second; a tree given now keeps its drafter busy, and so every step on
        our own threads, while they join). 0 elsewhere."""
        now = time.monotonic()
        recent = self._recent_rows
        recent.append((now, rows))
        while recent and recent[0][0] < now - REFILL_MEMORY_S:
            recent.popleft()
        if not self.borrowing_measured(lendable_later):
            return 0
        return max(0, max(n for _, n in recent) - rows)

    def observe_forward(self, rows: int, seconds: float, borrowed: bool) -> None:
        shapes = self.borrowed_by_rows if borrowed else self.forward_by_rows
        shape = shapes.setdefault(rows, [0, 0.0])
        shape[0] += 1
        shape[1] += seconds

    def observe_step(self, rows: int, step_s: float, lockstep_levels: int | None, borrowed: bool,
                     drafted: bool, spec: StepKind) -> None:
        """A step's cost, paid where it belongs: its time after admission, and the idle waits
        before it to the drafting that made them. `lockstep_levels`: the deepest drafted tree's
        depth when every drafted tree came from a drafter in lockstep (None otherwise). The wait
        for a drafter's first trees after a (re)sync (`spec.catching_up`: its prompt's prefill)
        is left out: once a request, not once a step; so is a wait while a lone stream's regime
        settles after a switch (`spec.settling`). A step whose turn ran on a thread count being
        tried (`spec.trial`) prices nothing: plans are for the count the turns run on (the
        embedded pair's one-thread trial turns, 36 ms a forward against 22, went into the lockstep
        model's row means and draft fit, and priced trees dear for dozens of steps after)."""
        if spec.trial:
            self.idle_carry = 0.0
            return
        priced = not (spec.catching_up or spec.settling)
        waited = self.idle_carry if priced else 0.0
        if lockstep_levels is not None:
            # the drafters drafted these trees while we waited (lockstep): that wait is the
            # draft's cost (a part per tree and one per level), the forward alone the
            # verification's (a sum, not a max)
            self.lockstep.observe_verify(rows, step_s)
            if waited > 0:
                self.lockstep.observe_draft(lockstep_levels, waited)
        else:
            costs = self.plain if borrowed and not drafted else self.overlap
            costs.observe_verify(rows, step_s)
            if not drafted and not borrowed and self.planner.costs is self.lockstep:
                # in lockstep a step of sequences all decoding alone is the row count the plans
                # weigh trees against: without it the lockstep line was fitted from tree steps
                # alone (4 and 7 rows on this CPU: 1 row extrapolated to 4.8 ms, measured 9.5)
                # and decoding alone looked too cheap to speculate against
                self.lockstep.observe_verify(rows, step_s)
            if spec.planned and priced:
                self.overlap.observe_wait(waited)
            if not drafted and not borrowed and self.settings.device != "cpu":
                # on a GPU a one-row forward runs another kernel than a few-row one (fp32 8B on an
                # H200: 12 ms against 19-21 ms for 2-5 rows), which a + b·rows fitted over
                # speculating steps cannot see: plain steps get their own model, the baseline
                self.plain.observe_verify(rows, step_s)
        self.idle_carry = 0.0

    def report(self) -> dict:
        a, b = self.planner.costs.coefficients
        pa, pb = self.plain.coefficients if self.plain.observed else (None, None)
        return {"verify_cost_a_s": a, "verify_cost_b_s": b,
                "overlap_wait_s": self.overlap.wait,          # the wait for trees per speculating step
                "plain_cost_a_s": pa, "plain_cost_b_s": pb,     # steps on borrowed cores
                "draft_level_s": self.planner.costs.d,        # of the model the planner uses now
                "lockstep_draft_level_s": self.lockstep.d,    # the wait for a tree per level, in lockstep
                "lockstep_draft_fixed_s": self.lockstep.draft_coefficients[0],   # ... and per tree
                # mean target forward (ms) per batch shape: what a verification costs here
                "forward_ms_by_rows": {r: 1e3 * t / n for r, (n, t) in sorted(self.forward_by_rows.items())},
                "borrowed_forward_ms_by_rows": {r: 1e3 * t / n for r, (n, t)
                                                in sorted(self.borrowed_by_rows.items())},
                # what the planner's model prices a verification of 1-8 rows at now (ms)
                "planner_verify_ms_by_rows": {r: 1e3 * self.planner.costs.verify_time(r) for r in range(1, 9)},
                # the planner's step models: seconds predicted for a step of 1 and 16 rows
                **{f"{name}_step_{rows}_rows_s": model.step_time(rows, 0)
                   for name, model in (("overlap", self.overlap), ("lockstep", self.lockstep),
                                       ("plain", self.plain)) for rows in (1, 16)}}
