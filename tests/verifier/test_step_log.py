"""SPECFLASH_STEP_LOG: a JSON line per verification step and per drafter exchange
(speculation/step_log.py), nothing without it."""
from __future__ import annotations

import json

from cluster.local import build_engine, speculation_for
from drafter.draft_side import DraftSide
from drafter.runtime import Drafter
from models import SamplingParams
from models.presets import config_of
from speculation.requests import GenerationRequest
from speculation.settings import EngineSettings
from speculation.step_log import ENV
from speculation.transport import TreePut, VerifierInfo
from speculation.wire import Signal

PROMPT = list(b"def add(a, b):\n    return")


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_engine_logs_each_step_with_what_it_kept(tiny_target, close_draft, tmp_path, monkeypatch):
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV, str(log))
    engine = build_engine(tiny_target, close_draft).engine
    request = GenerationRequest("r0", PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                                speculation_for("sync", 3, 1))
    out = engine.generate([request])[0]
    steps = _lines(log)
    assert steps and all(s["role"] == "verifier" and s["forward_s"] > 0 and s["idle_s"] >= 0 for s in steps)
    assert all(s["wall_s"] >= s["forward_s"] + s["draft_s"] for s in steps)
    kept = [q for s in steps for q in s["sequences"]]
    assert {q["seq"] for q in kept} == {"r0"}
    assert sum(q["kept"] for q in kept) == len(out.token_ids) == 20      # every committed token, once
    assert sum(q["nodes"] for q in kept) == out.stats.num_drafted > 0    # the trees it verified
    assert len(steps) == out.stats.num_steps
    assert all(s["draft_s"] > 0 for s in steps if any(q["nodes"] for q in s["sequences"]))   # drafted in process
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)


def test_nothing_is_written_without_the_variable(tiny_target, close_draft, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    engine = build_engine(tiny_target, close_draft).engine
    engine.generate([GenerationRequest("r0", PROMPT, SamplingParams(temperature=0.0, max_tokens=4),
                                       speculation_for("sync", 2, 1))])
    assert not engine_logs(tmp_path)


def engine_logs(directory) -> list:
    return [p for p in directory.rglob("*") if p.is_file()]


class _ScriptedVerifier:
    """A verifier link that answers each exchange with the next scripted signals."""

    def __init__(self, script: list[list[Signal]]) -> None:
        self.script, self.calls = script, []

    def exchange(self, call):
        self.calls.append(call)
        return self.script.pop(0) if self.script else []

    def put_tree(self, header, tree) -> TreePut:
        return TreePut(header, tree)

    def verifier_info(self) -> VerifierInfo:
        return VerifierInfo()


def test_a_drafter_logs_each_exchange_and_the_drafting_after_it(tiny_target, close_draft, tmp_path, monkeypatch):
    log = tmp_path / "exchanges.jsonl"
    monkeypatch.setenv(ENV, str(log))
    settings = EngineSettings(spec_len=3)
    side = DraftSide.build(str(close_draft), config_of(str(tiny_target)).vocab_size, settings)
    drafter = Drafter(4, side, settings)
    join = Signal("join", "s", epoch=1, prefix_len=len(PROMPT), token_ids=PROMPT, budget=(3, 1),
                  params={"temperature": 0.0}, proposer="model")
    link = _ScriptedVerifier([[join, Signal("leave", "other")], []])
    drafter.run_once(link)
    drafter.run_once(link)
    first, second = _lines(log)
    assert first["role"] == "drafter" and first["drafter"] == 4
    assert first["signals"] == {"join": 1, "leave": 1} and first["restarts"] == 0
    assert first["delivered"] == 0 and first["drafted"] == 1 and first["levels"] >= 3 and first["draft_s"] > 0
    assert second["signals"] == {} and second["delivered"] == 1 == len(link.calls[1].puts)
    assert second["t"] >= first["t"]
