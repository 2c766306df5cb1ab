"""One thread runs a process's models, their building and warm-up included (verifier/loop.py):
a second thread opening OpenMP regions gives the process a second OpenMP team, and with more
OpenMP threads than cores every forward slows (a micro forward 0.74 → 2.15 ms here). Each
shell that owns a model thread (the verifier actor, the drafter actor, the local engine) is
checked by recording the thread of every linear layer's forward, no Ray needed."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict

import pytest

import models
import models.loader as loader
import models.linear as linear
import cluster.actors as actors
import verifier.inprocess as inprocess
from cluster.actors import DrafterActor, VerifierActor, settings_dict
from cluster.local import build_local_engine
from models.sampling import SamplingParams
from speculation.requests import GenerationRequest, SpeculationOptions
from speculation.settings import EngineSettings


@pytest.fixture
def forward_threads(monkeypatch):
    """The ids of the threads that loaded a model (weights converted, packed: parallel regions
    on the CPU) or ran any linear layer of one, from now on."""
    seen: set[int] = set()
    forward, load_model = linear.Linear.forward, loader.load_model

    def recording(self, x):
        seen.add(threading.get_ident())
        return forward(self, x)

    def loading(*args, **kwargs):
        seen.add(threading.get_ident())
        return load_model(*args, **kwargs)

    monkeypatch.setattr(linear.Linear, "forward", recording)
    monkeypatch.setattr(loader, "load_model", loading)
    monkeypatch.setattr(models, "load_model", loading)
    return seen


def settings(**overrides) -> dict:
    return settings_dict(EngineSettings(num_blocks=128, num_cpus=1, spec_len=3, lookup=False), **overrides)


def test_the_verifier_actor_builds_warms_up_and_serves_on_its_model_thread(tiny_target, close_draft,
                                                                          forward_threads, monkeypatch):
    """The models' loading, the stand-in drafter's turns and the target's prefill and
    verifications all run on one thread, not the one that constructed the actor nor its event loop."""
    monkeypatch.setattr(actors, "node_id", lambda: "node-1")
    # every step measured, however late the loop comes back to the next one (on a loaded host a
    # step may begin more than IDLE_GAP_S after the last, which restarts the windows)
    monkeypatch.setattr(inprocess, "IDLE_GAP_S", None)
    actor = VerifierActor(str(tiny_target), settings(), str(close_draft))
    assert actor.local is not None and forward_threads         # loaded both models
    built_on = set(forward_threads)
    assert threading.get_ident() not in built_on

    async def serve() -> list[int]:
        # a drafter of another process on our node, live and idle: a lone stream is then drafted by
        # the stand-in in this process (lockstep_in_verifier)
        await actor.exchange(0, "remote", [], 0.0, node="node-1", cpus=1.0, idle=True)
        tokens = []
        async for chunk in actor.generate("r", [5, 6, 7, 8], asdict(SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)),
                                          asdict(SpeculationOptions(mode="chain", spec_len=3))):
            assert chunk.finish_reason != "error", chunk.error
            tokens += chunk.token_ids
        # the stand-in's turns tried its own thread and the idle drafter's borrowed core in turn (a
        # window of steps each: 160 tokens take 40 steps or more, 4 tokens a step at most, and two
        # windows of 12 with a left-out step before each take 26)
        by_threads = (await actor.get_stats())["local_drafter"]["ms_per_row_by_threads"]
        assert set(by_threads) == {"1", "2"} and all(ms > 0 for ms in by_threads.values())
        return tokens

    try:
        assert len(asyncio.run(serve())) == 160
    finally:
        actor.shutdown()
    assert forward_threads == built_on and len(built_on) == 1
    assert actor.local.drafters[0].stats.as_dict()["draft_s"] > 0     # the stand-in drafted on it too


class _Unreachable:
    """A verifier link that is never there: the drafter keeps retrying, drafting nothing."""


def test_the_drafter_actor_builds_and_warms_up_on_its_loop_thread(tiny_target, close_draft, forward_threads):
    actor = DrafterActor(0, _Unreachable(), str(close_draft), str(tiny_target), settings())
    try:
        assert forward_threads == {actor._thread.ident}
    finally:
        actor._stopped.set()
        actor._thread.join(timeout=10)


def test_the_local_engine_builds_on_the_thread_that_runs_it(tiny_target, close_draft, forward_threads):
    engine, _ = build_local_engine(str(tiny_target), str(close_draft), EngineSettings(num_blocks=128))
    try:
        request = GenerationRequest("r", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=8),
                                    SpeculationOptions(mode="chain", spec_len=3))

        async def serve() -> int:
            return sum([len(c.token_ids) async for c in engine.generate(request)])

        assert asyncio.run(serve()) == 8
        assert forward_threads == {engine.thread.ident}
    finally:
        engine.shutdown()


def test_a_local_engine_that_cannot_be_built_raises_and_stops_its_thread(tmp_path):
    from cluster.local import LocalEngine

    def build():
        raise ValueError("no such model")

    before = threading.active_count()
    with pytest.raises(ValueError, match="no such model"):
        LocalEngine(build)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before
