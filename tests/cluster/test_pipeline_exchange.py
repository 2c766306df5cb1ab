"""The exchange over a socket per drafter (cluster/exchange_socket.py, the default) through Ray:
exact output, the socket really carries the exchanges, actor calls where asked for, and a
drafter's restart reconnects. The shared test cluster puts drafters and verifiers on different
nodes, so these connections are TCP; tests/cluster/test_exchange_socket.py covers the Unix
socket and the faults of one connection without Ray."""
from __future__ import annotations

import asyncio

import ray

from .pipeline_helpers import collect, hf_greedy, prompts, request, run
from .test_pipeline_faults import kill_after, wait_for_restart


def _served(engine) -> int:
    return ray.get(engine.pipelines[0].verifier.health.remote(), timeout=10)["socket_exchanges"]


def test_sockets_carry_the_exchanges_and_output_is_exact(make_engine, tiny_target, close_draft, hf_target):
    engine = make_engine(tiny_target, close_draft)
    drafter = engine.pipelines[0].drafters[0]
    ps = prompts(3, seed=31)

    async def all_of():
        return await asyncio.gather(*(collect(engine, request(f"c{i}", p, 40, "chain", 4)) for i, p in enumerate(ps)))

    outs = run(all_of(), 180)
    for (tokens, last), p in zip(outs, ps):
        assert tokens == hf_greedy(hf_target, p, 40) and last.finish_reason == "length"
        assert last.num_drafted > 0
    # every exchange went through the socket, none by actor call; the idle
    # drafter goes on long-polling, so its count is read between two of the verifier's (and a
    # reply the verifier has written may not have been read yet)
    served_before = _served(engine)
    info = ray.get(drafter.info.remote(), timeout=10)
    served_after = _served(engine)
    assert info["socket_exchanges"] > 10 and info["socket_exchanges_lost"] == 0, info
    assert not info["exchanges_by_call"] and info["exchanges"] == info["socket_exchanges"], info
    assert served_before - 1 <= info["socket_exchanges"] <= served_after


def test_actor_calls_where_asked_for(make_engine, tiny_target, close_draft, hf_target):
    engine = make_engine(tiny_target, close_draft, exchange="actor")
    prompt = prompts(1, seed=32)[0]
    tokens, last = run(collect(engine, request("calls", prompt, 24, "chain", 4)))
    assert tokens == hf_greedy(hf_target, prompt, 24) and last.num_drafted > 0
    assert _served(engine) == 0
    assert ray.get(engine.pipelines[0].drafters[0].info.remote(), timeout=10)["exchanges"] > 0


def test_a_restarted_drafter_reconnects_its_socket(make_engine, tiny_target, close_draft, hf_target):
    engine = make_engine(tiny_target, close_draft, drafter_timeout_s=1.0)
    drafter = engine.pipelines[0].drafters[0]
    before = ray.get(drafter.info.remote())["incarnation"]
    prompt = prompts(1, seed=33)[0]
    killed = []
    tokens, last = run(collect(engine, request("victim", prompt, 120, "chain", 4), kill_after(drafter, 8, killed)), 180)
    assert killed and tokens == hf_greedy(hf_target, prompt, 120) and last.finish_reason == "length"
    wait_for_restart(drafter, before)
    served = _served(engine)
    prompt2 = prompts(2, seed=34)[1]
    tokens2, last2 = run(collect(engine, request("after", prompt2, 40, "chain", 4)))
    assert tokens2 == hf_greedy(hf_target, prompt2, 40) and last2.num_drafted > 0
    info = ray.get(drafter.info.remote(), timeout=10)
    assert info["socket_exchanges"] > 0 and _served(engine) > served, info
    health = ray.get(engine.pipelines[0].verifier.health.remote(), timeout=10)
    assert health["exchange_connections"] == 1, health     # the dead incarnation's connection closed

