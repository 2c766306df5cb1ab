"""A lone stream's regime, overlapped or in lockstep, measured (verifier/regime.py)."""
from __future__ import annotations

import asyncio

import torch

from drafter.runtime import Drafter
from models.sampling import SamplingParams
from speculation.settings import EngineSettings
from speculation.wire import Signal
from verifier.regime import LOCKSTEP, OVERLAP, RegimeChoice

from .harness import Harness


def run_steps(choice: RegimeChoice, stream: str, n: int, clock: list[float], seconds_per_step: dict) -> None:
    """`n` steps of `stream`, each committing 2 tokens in the current way's time."""
    for _ in range(n):
        clock[0] += seconds_per_step[choice.lockstep()]
        choice.observe(stream, 2, clock[0])


def test_each_way_is_measured_then_the_faster_kept_and_the_other_rechecked():
    choice = RegimeChoice(True, window=4, trials=2, recheck=3)
    assert choice.lockstep() is OVERLAP                      # the rule's way first
    measured = []                                            # the way each completed window ran
    observe = choice.windows.choice.observe
    choice.windows.choice.observe = lambda way, seconds, tokens, **kw: (measured.append(way),
                                                                       observe(way, seconds, tokens, **kw))
    clock, speed = [0.0], {OVERLAP: 0.030, LOCKSTEP: 0.020}   # lockstep commits faster here
    while len(measured) < 8:
        run_steps(choice, "a", 1, clock, speed)
    # alternated until each had 2 windows, then lockstep, overlap rechecked at every 3rd pick
    assert measured == [OVERLAP, LOCKSTEP, OVERLAP, LOCKSTEP, LOCKSTEP, LOCKSTEP, OVERLAP, LOCKSTEP]

    report = choice.report()
    assert report["regime"] == "lockstep"
    assert abs(report["ms_per_token_by_regime"]["lockstep"] - 10.0) < 1e-6     # 20 ms a step, 2 tokens
    assert abs(report["ms_per_token_by_regime"]["overlap"] - 15.0) < 1e-6


def test_a_switch_leaves_steps_whose_waits_train_no_cost_model():
    choice = RegimeChoice(True, window=2, trials=1, settle=2)
    clock, speed = [0.0], {OVERLAP: 0.030, LOCKSTEP: 0.020}
    run_steps(choice, "a", 4, clock, speed)        # its first step, a skipped one, a window of 2
    assert choice.lockstep() is LOCKSTEP and choice.settling == 2    # switched: lockstep untried
    run_steps(choice, "a", 1, clock, speed)
    assert choice.settling == 1
    run_steps(choice, "a", 1, clock, speed)
    assert choice.settling == 0


def test_a_new_stream_or_none_restarts_the_measurement():
    choice = RegimeChoice(True, window=4, trials=2)
    clock, speed = [0.0], {OVERLAP: 0.030, LOCKSTEP: 0.020}
    run_steps(choice, "a", 3, clock, speed)
    clock[0] += 5.0                                # the client's pause, a prefill: not a step's cost
    run_steps(choice, "b", 3, clock, speed)        # a new stream: its first steps start a new window
    choice.observe(None, 0, clock[0] + 9.0)        # a second stream joined: nothing is measured
    run_steps(choice, "b", 2, clock, speed)
    assert choice.windows.choice.samples == {}             # no window completed across any of those


def test_the_drafter_follows_the_verifiers_word_for_a_lone_stream_only():
    d = Drafter.__new__(Drafter)
    d.settings, d.node, d.gpus, d.streams = EngineSettings(lockstep_alone=False), "n1", None, {"a": object()}
    from speculation.transport import VerifierInfo
    d.verifier, d.told_lockstep = VerifierInfo("n1", 1.0, None), None
    assert not d.lockstep()                        # the rule: a CPU drafter kept overlapped
    d.told_lockstep = True
    assert d.lockstep()
    d.streams["b"] = object()                      # two streams: the rule again
    assert not d.lockstep()


def test_the_scheduler_measures_a_lone_stream_on_another_node_and_tells_its_drafter(tiny_target):
    threads = torch.get_num_threads()
    try:
        va = Harness(tiny_target, **{"num_blocks": 64, "block_size": 16, "lookup": False})
        sch = va.scheduler
        asyncio.run(va.exchange(0, "d0", [], 0.0, node="n2", cpus=1.0))     # another node: the rule overlaps
        s = va.stream("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8))
        s.prefilled = True
        assert sch.members.measured(0) and sch.members.lone_stream() == "a"
        assert not sch.members.lockstep(0) and sch.members.plan_bridges()
        sch.regime.current = LOCKSTEP
        assert sch.members.lockstep(0) and not sch.members.plan_bridges()
        sch.members.resync(s)
        assert va.scheduler.signals_for(0)[-1].lockstep is True
        t = va.stream("b", [5, 6, 8], SamplingParams(temperature=0.0, max_tokens=8))
        t.prefilled = True
        assert sch.members.lone_stream() is None and not sch.members.lockstep(0)    # two streams: the rule
        del sch.streams["b"]
        sch.regime = type(sch.regime)(False)            # `lockstep_measured` off: the rule alone
        assert not sch.members.measured(0) and not sch.members.lockstep(0)
    finally:
        torch.set_num_threads(threads)


def test_a_restarted_verifiers_reset_drops_the_word():
    d = Drafter.__new__(Drafter)
    d.told_lockstep, d.streams = True, {}
    d.stats = type("S", (), {"observe_reset": lambda self: None})()
    d.side = None
    d.apply([Signal("reset", "")])
    assert d.told_lockstep is None
