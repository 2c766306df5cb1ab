"""What a verification step costs (verifier/costs.py): each wait priced where it belongs."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from models.sampling import SamplingParams
from speculation.planner import AdaptiveSpeculation
from verifier.costs import StepCosts, StepKind

from .harness import Harness


def step_costs() -> StepCosts:
    model = SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.zeros(1)))     # a CPU model
    return StepCosts(AdaptiveSpeculation(max_spec_len=6), model, SimpleNamespace(device="cpu"), threads=1)


def test_waits_for_trees_cost_a_speculating_step_and_a_drafters_catch_up_costs_none():
    """One core per model on math (bench/README.md): the first tree came after the drafter's
    150 ms prefill, later trees ~20 ms late after each bridge, plain and bridge steps on time.
    The forwards fit a + b·rows alone; the late trees' waits average over the speculating steps
    (bridges included); the prefill's wait is once a request and counts nowhere."""
    c = step_costs()
    c.idle_carry = 0.150
    c.observe_step(4, 0.050, None, False, True, StepKind(planned=True, catching_up=True))
    assert c.overlap.wait == 0.0 and c.idle_carry == 0.0
    for _ in range(30):
        c.observe_step(1, 0.035, None, False, False, StepKind())                 # decoding alone
        c.idle_carry = 0.020
        c.observe_step(4, 0.050, None, False, True, StepKind(planned=True))      # a tree, 20 ms late
        c.observe_step(1, 0.035, None, False, False, StepKind(planned=True))     # the bridge after it
    a, b = c.overlap.coefficients
    assert a + b == pytest.approx(0.035, rel=0.02) and a + 4 * b == pytest.approx(0.050, rel=0.02)
    assert c.overlap.wait == pytest.approx(0.010, rel=0.2)
    assert c.overlap.step_time(4, 3) == pytest.approx(0.050 + c.overlap.wait, rel=0.02)


def test_in_lockstep_the_wait_is_the_draft_per_level_less_the_catch_up():
    c = step_costs()
    for _ in range(3):          # the drafter's first trees after its resyncs: prefills, not levels
        c.idle_carry = 0.200
        c.observe_step(4, 0.050, 3, False, True, StepKind(planned=True, catching_up=True))
    assert c.lockstep.d == 0.004                                  # the prior, untouched
    for _ in range(20):
        c.idle_carry = 0.018
        c.observe_step(4, 0.050, 3, False, True, StepKind(planned=True))
    # 18 ms for 3 levels (the first such sample left out: a shape's one-off cost)
    assert c.lockstep.d == pytest.approx(0.006)
    assert c.overlap.wait == 0.0


def test_a_turn_on_a_thread_count_being_tried_prices_nothing():
    """The stand-in's trial turns on another thread count (verifier/inprocess.py) are not what
    the turns cost: neither the forward nor the wait before it enters any model."""
    c = step_costs()
    for _ in range(6):
        c.idle_carry = 0.009
        c.observe_step(4, 0.024, 3, False, True, StepKind(planned=True))
    before = (c.lockstep.verify_time(4), c.lockstep.draft_coefficients)
    for _ in range(4):
        c.idle_carry = 0.014
        c.observe_step(4, 0.036, 3, False, True, StepKind(planned=True, trial=True))
        assert c.idle_carry == 0.0
    assert (c.lockstep.verify_time(4), c.lockstep.draft_coefficients) == before
    assert before[0] == pytest.approx(0.024)


def test_in_lockstep_steps_decoding_alone_price_one_row_for_the_lockstep_plans():
    """The in-process engine steps in lockstep: its plans weigh a tree against decoding alone
    by the lockstep model, which must see the one-row steps too. Fitted from tree steps alone
    (4 and 7 rows) it priced one row at half its cost and the planner stopped speculating."""
    c = step_costs()
    c.choose(False, 1)                                   # lockstep (no overlap)
    assert c.planner.costs is c.lockstep
    for _ in range(12):
        c.observe_step(4, 0.0105, 3, False, True, StepKind(planned=True))
        c.observe_step(7, 0.0180, 3, False, True, StepKind(planned=True))
        c.observe_step(1, 0.0090, None, False, False, StepKind())             # decoding alone
    assert c.lockstep.verify_time(1) == pytest.approx(0.009)
    c2 = step_costs()
    c2.choose(True, 1)                                   # overlapped: the plain step is no lockstep step
    for _ in range(3):                                   # (a shape's first cost is left out)
        c2.observe_step(1, 0.009, None, False, False, StepKind())
    assert not c2.lockstep.observed and c2.overlap.observed


def test_a_lockstep_plan_starts_from_the_measured_plain_steps():
    """A server whose first requests decode alone (plain steps on the drafter's cores, 13 ms)
    and whose lone stream then asks for trees in lockstep: its plans start from the plain
    steps' cost, not the model's prior (22 ms a row and more), against which every tree was a
    loss and the stream never speculated."""
    c = step_costs()
    for _ in range(6):
        c.observe_step(1, 0.013, None, True, False, StepKind())             # borrowed plain steps
    assert c.plain.observed and not c.lockstep.observed
    c.choose(False, 2)                                                     # a lone stream: lockstep
    assert c.lockstep.coefficients == c.plain.coefficients
    c.planner.add("s", "auto", 4, 1)
    plan = c.planner.plan(["s"], plain_step_s=c.plain_step_s(1, 2))
    assert plan["s"][0] > 0


def test_collect_notes_what_the_batch_was_planned_as(tiny_target):
    """A bridge after a contradicted tree is a speculating step; a tree still awaited after a
    resync makes the step's wait a catch-up; a sequence decoding alone by plan is neither."""
    threads = torch.get_num_threads()
    try:
        va = Harness(tiny_target, **{"num_blocks": 64, "block_size": 16, "lookup": False})
        asyncio.run(va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0))
        sch = va.scheduler
        params = SamplingParams(temperature=0.0, max_tokens=4)
        alone = va.stream("a", [5, 6, 7], params, budget=(0, 0))
        alone.prefilled = True
        sch.collect([alone], 0.0)
        assert sch.step_kind == StepKind(planned=False, catching_up=False)
        bridging = va.stream("b", [5, 6, 7], params, budget=(2, 1))
        bridging.prefilled, bridging.bridge, bridging.first_tree = True, True, False
        sch.collect([alone, bridging], 0.0)
        assert sch.step_kind == StepKind(planned=True, catching_up=False)
        waiting = va.stream("w", [5, 6, 7], params, budget=(2, 1))
        waiting.prefilled = True                       # its drafter was just told to (re)start it
        batch, _ = sch.collect([waiting], 1.0)
        assert batch == []                             # waits for its first tree ...
        batch, _ = sch.collect([waiting], 1e9)         # ... until its patience runs out
        assert len(batch) == 1 and sch.step_kind == StepKind(planned=True, catching_up=True)
    finally:
        torch.set_num_threads(threads)


def test_waits_while_a_regime_switch_settles_price_neither_way():
    """Right after a lone stream's regime switched (`verifier.regime`), trees drafted the other
    way may still arrive: the waits before those steps are no draft level's and no tree's."""
    c = step_costs()
    for _ in range(3):
        c.idle_carry = 0.050
        c.observe_step(4, 0.050, 3, False, True, StepKind(planned=True, lockstep=True, settling=True))
        c.idle_carry = 0.050
        c.observe_step(4, 0.050, None, False, True, StepKind(planned=True, settling=True))
    assert c.lockstep.d == 0.004 and c.overlap.wait == 0.0 and c.idle_carry == 0.0
    c.idle_carry = 0.050
    c.observe_step(4, 0.050, None, False, True, StepKind(planned=True))
    assert c.overlap.wait == pytest.approx(0.010)


def test_the_report_shows_how_the_planner_prices_each_row_count_and_what_new_sequences_start_from():
    """What `bench/e2e.py`'s pipeline runs were read from when its planner stopped speculating:
    the price of 1-8 rows in the model the planner uses now, and the proposers' pools."""
    c = step_costs()
    for _ in range(10):
        c.observe_step(4, 0.050, None, False, True, StepKind(planned=True))
        c.observe_step(1, 0.035, None, False, True, StepKind(planned=True))
    priced = c.report()["planner_verify_ms_by_rows"]
    assert list(priced) == list(range(1, 9)) and priced[4] == pytest.approx(50.0)
    c.planner.add("s", "auto", 4, 1)
    for _ in range(5):
        c.planner.observe("s", 4, 4)
    pool = c.planner.report()
    assert pool["pool_gamma"]["model"] > 0.9 and pool["pool_probe_gap"] == {}
