"""Failures in the asynchronous pipeline (issue 4): a drafter killed mid-generation, a
verifier killed with requests in flight. Nothing may hang; exactness must survive."""
from __future__ import annotations

import asyncio
import time

import ray

from .pipeline_helpers import collect, hf_greedy, prompts, request, run


def wait_for(predicate, timeout: float = 60.0, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout} s")


def kill_after(actor, num_tokens: int, killed: list):
    """An `on_chunk` callback that kills `actor` (Ray may restart it) once `num_tokens` streamed;
    it records the count then in `killed`."""
    async def on_chunk(chunk, tokens):
        if not killed and len(tokens) >= num_tokens:
            ray.kill(actor, no_restart=False)
            killed.append(len(tokens))

    return on_chunk


def wait_for_restart(drafter, before: str, timeout: float = 90.0) -> dict:
    """The drafter's info once it runs under an incarnation other than `before` (a restart) and
    has attached to its verifier: a request sent before its first exchange would find no live
    drafter and decode alone until it attached (a 40-token request on the tiny pair can end first)."""
    def restarted():
        try:
            info = ray.get(drafter.info.remote(), timeout=5)
        except Exception:
            return None
        return info if info["incarnation"] != before and info["running"] and info["attached"] else None

    return wait_for(restarted, timeout=timeout)


def test_drafter_killed_mid_generation_request_completes_exactly(make_engine, tiny_target, close_draft,
                                                                  hf_target):
    engine = make_engine(tiny_target, close_draft, drafter_timeout_s=1.0)
    drafter = engine.pipelines[0].drafters[0]
    before = ray.get(drafter.info.remote())["incarnation"]
    prompt = prompts(1, seed=21)[0]
    killed_at = []
    on_chunk = kill_after(drafter, 8, killed_at)           # Ray restarts it (max_restarts)
    tokens, last = run(collect(engine, request("victim", prompt, 160, "chain", 4), on_chunk), 180)
    assert killed_at and killed_at[0] < 160, "the drafter must die mid-generation"
    assert tokens == hf_greedy(hf_target, prompt, 160)
    assert last.finish_reason == "length"

    # the restarted drafter reattaches (new incarnation) and speculates again
    wait_for_restart(drafter, before)
    prompt2 = prompts(2, seed=22)[1]
    tokens2, last2 = run(collect(engine, request("after", prompt2, 40, "chain", 4)))
    assert tokens2 == hf_greedy(hf_target, prompt2, 40)
    assert last2.num_drafted > 0, "the drafter must rejoin and speculate after its restart"


def test_drafters_are_given_their_verifier_by_name(make_engine, tiny_target, close_draft):
    """A restartable drafter's constructor arguments hold no actor handle (Ray keeps such an
    argument in the object store, where it may not outlive a restart: ray-project/ray#53727):
    each verifier is a named actor, and that name finds it."""
    engine = make_engine(tiny_target, close_draft, num_pipelines=2)
    named = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("specflash-verifier-")}
    ids = {ray.get_actor(name, namespace=ns)._actor_id for ns, name in named}
    assert {p.verifier._actor_id for p in engine.pipelines} <= ids


def test_verifier_killed_fails_fast_and_other_pipeline_unaffected(make_engine, tiny_target, close_draft,
                                                                  hf_target):
    engine = make_engine(tiny_target, close_draft, num_pipelines=2, chunk_timeout_s=60)
    p1, p2 = prompts(2, seed=31)
    killed = {}

    async def kill_after_some(chunk, tokens):
        if not killed and len(tokens) >= 5:
            victim = engine.pipelines[engine.routes["victim"]]
            ray.kill(victim.verifier, no_restart=True)
            killed["t"] = time.monotonic()

    async def both():
        first = asyncio.create_task(collect(engine, request("victim", p1, 2000, "chain", 2,
                                                            ignore_eos=True), kill_after_some))
        while "victim" not in engine.routes:    # the victim holds its pipeline: the survivor gets the other
            await asyncio.sleep(0.01)             # (a fixed pause raced the victim's first step after a GC)
        second = asyncio.create_task(collect(engine, request("survivor", p2, 60, "tree", 3, 2)))
        victim = await first
        ended = time.monotonic()
        return victim, ended, await second

    (tokens, last), ended, (tokens2, last2) = run(both(), 180)
    assert killed, "the verifier must be killed mid-generation"
    assert last.finished and last.finish_reason == "error"
    assert "died" in last.error and "retryable" in last.error
    assert ended - killed["t"] < 20, "the failure must surface within a bounded time"
    health = run(engine.health())
    errors = [p.get("error") for p in health["pipelines"]]     # a verifier's failed step says why
    assert last2 is not None and last2.finish_reason == "length", (last2, len(tokens2), errors)
    assert tokens2 == hf_greedy(hf_target, p2, 60)
    assert not health["ok"] and sum(p["ok"] for p in health["pipelines"]) == 1
