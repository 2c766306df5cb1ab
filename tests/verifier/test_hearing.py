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


def test_a_waiting_drafter_hears_of_a_new_stream_before_its_prefill(tiny_target, monkeypatch):
    """A stream's "resync" reaches a drafter waiting in an exchange before the target's prefill
    of its prompt ends, so that the drafter catches up on the prompt meanwhile: the prefill,
    inline on the engine's thread, is held back until the reply has left for the caller's loop
    (`EngineLoop._hand_out`). The prefill here holds the GIL for 0.4 s, as a forward that does
    not release it would; without the hand-out the reply waits for it to end."""
    import ctypes
    import threading

    import cluster.actors as actors
    from cluster.actors import VerifierActor, settings_dict
    from speculation.wire import decode_signals

    monkeypatch.setattr(actors, "node_id", lambda: "node-1")
    actor = VerifierActor(str(tiny_target), settings_dict(EngineSettings(num_blocks=64, num_cpus=1, lookup=False)))
    hold_gil = ctypes.PyDLL(None).usleep          # a C call that keeps the GIL
    times: dict[str, float] = {}
    prefill = actor.scheduler.prefill

    def slow_prefill(*args):
        times["prefill_start"] = time.monotonic()
        hold_gil(400_000)
        times["prefill_end"] = time.monotonic()
        return prefill(*args)

    actor.scheduler.prefill = slow_prefill
    returned: list[float] = []

    class Stamped(set):
        """`_replying`, stamping the moment a reply is back on its caller's loop: the drafter's
        own code after that (its loop's teardown, the decoding) may wait for the GIL that the
        prefill then holds, which is not the hand-out's to prevent."""

        def discard(self, call) -> None:
            if call in self:
                returned.append(time.monotonic())
            super().discard(call)

    actor._replying = Stamped(actor._replying)
    try:
        # a drafter on another node (so that the stream is its, not the verifier's stand-in's)
        asyncio.run(actor.exchange(0, "inc", [], 0.0, 0.0, 0, [], "node-2", 1.0, None, True))

        def drafter():
            while "resync" not in times:
                frame = asyncio.run(actor.exchange(0, "inc", [], 3.0, 0.0, 0, [], "node-2", 1.0, None, True))
                if any(sig.kind == "resync" for sig in decode_signals(frame)):
                    times["resync"] = returned[-1]       # this call's reply, back on its loop

        waiting = threading.Thread(target=drafter, daemon=True)
        waiting.start()
        time.sleep(0.3)                           # the drafter is in its long-poll

        async def one_request():
            params = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}
            async for _ in actor.generate("r", list(range(3, 40)), params, {"mode": "chain", "spec_len": 2}):
                pass

        asyncio.run(one_request())
        waiting.join(10)
        assert "resync" in times and "prefill_end" in times, times
        assert times["resync"] < times["prefill_end"], times
    finally:
        actor.shutdown()
