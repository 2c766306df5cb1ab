"""A forward run on the engine loop's own thread holds every exchange until it ends: that
wait is not a drafter's silence (verifier/registry.py `excuse`, verifier/loop.py), and the
actor answers health from its last report meanwhile (cluster/actors.py)."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from speculation.settings import EngineSettings
from speculation.transport import Exchange
from verifier.loop import EngineLoop
from verifier.registry import DrafterRegistry


def test_time_we_could_not_hear_is_not_a_drafters_silence():
    now = [100.0]
    reg = DrafterRegistry(EngineSettings(drafter_timeout_s=2.0), clock=lambda: now[0])
    reg.heard(Exchange(3, "inc"))
    now[0] += 1.5
    assert reg.live(3)
    now[0] += 1.5                     # 3 s since it was heard: gone ...
    assert not reg.live(3)
    reg.excuse(2.5)                   # ... unless we were deaf for 2.5 of them
    assert reg.live(3)
    now[0] += 1.5                     # and silent again while we listen
    assert not reg.live(3)


def test_an_inline_model_call_is_excused_and_a_threaded_one_is_not():
    reg = DrafterRegistry(EngineSettings())
    inline = EngineLoop(SimpleNamespace(registry=reg), inline=True)
    assert asyncio.run(inline.run_model(lambda x: time.sleep(0.05) or x, 7)) == 7
    assert 0.05 <= reg.deaf_s < 1.0
    other = DrafterRegistry(EngineSettings())
    threaded = EngineLoop(SimpleNamespace(registry=other))
    try:
        asyncio.run(threaded.run_model(time.sleep, 0.05))
    finally:
        threaded.close()
    assert other.deaf_s == 0.0      # its loop kept hearing exchanges during the forward


def test_the_actor_answers_health_while_its_engine_is_in_a_long_forward(tiny_target, monkeypatch):
    import cluster.actors as actors
    from cluster.actors import VerifierActor, settings_dict

    monkeypatch.setattr(actors, "node_id", lambda: "node-1")
    actor = VerifierActor(str(tiny_target), settings_dict(EngineSettings(num_blocks=64, num_cpus=1, lookup=False)))
    try:
        fresh = asyncio.run(actor.health())
        assert "engine_busy_s" not in fresh
        actor.engine.loop.call_soon_threadsafe(time.sleep, 2.5)      # the engine's thread busy
        time.sleep(0.1)
        began = time.monotonic()
        busy = asyncio.run(actor.health())
        assert time.monotonic() - began < 2.0
        assert busy["engine_busy_s"] >= actors.REPORT_WAIT_S and busy["incarnation"] == actor.incarnation
        assert {k: v for k, v in busy.items() if k != "engine_busy_s"} == fresh
        usage = asyncio.run(actor.kv_usage())
        assert "engine_busy_s" in usage and usage["total"] == 64
        time.sleep(1.0)
        assert "engine_busy_s" not in asyncio.run(actor.health())    # the thread answers again
    finally:
        actor.shutdown()
