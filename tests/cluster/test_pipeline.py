"""The asynchronous pipeline on a multi-node Ray cluster: exact greedy output (issue 4).

Drafter and verifier run on different Ray nodes (custom resources, or a
STRICT_SPREAD placement group); every output is compared token for token with
Hugging Face `generate` of the target alone.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import ray

from .pipeline_helpers import collect, hf_greedy, prompts, request, run


def node_ids(engine) -> tuple[str, list[str]]:
    p = engine.pipelines[0]
    verifier = ray.get(p.verifier.health.remote())["node_id"]
    return verifier, [ray.get(d.info.remote())["node_id"] for d in p.drafters]


@pytest.fixture(scope="module")
def close_engine(ray_cluster, tiny_target, close_draft):
    from cluster.pipeline import build_pipeline_engine
    from tests.ray_cluster import pipeline_args

    engine = build_pipeline_engine(pipeline_args(), target_dir=str(tiny_target), draft_dir=str(close_draft),
                                   num_blocks=512)
    yield engine
    engine.kill_pipeline_actors()


def test_drafter_and_verifier_on_different_nodes(close_engine, ray_cluster):
    verifier, drafters = node_ids(close_engine)
    assert verifier == ray_cluster.verifier_node
    assert drafters == [ray_cluster.drafter_node]


@pytest.mark.parametrize("mode,spec_len,width", [("chain", 4, 1), ("chain", 1, 1), ("tree", 3, 3),
                                                 ("auto", 4, 2), ("off", 4, 1)])
def test_greedy_equals_hf_generate(close_engine, hf_target, mode, spec_len, width):
    for i, prompt in enumerate(prompts(3, seed=spec_len * 10 + width)):
        tokens, last = run(collect(close_engine, request(f"{mode}{spec_len}{width}-{i}", prompt, 40, mode,
                                                         spec_len, width)))
        assert tokens == hf_greedy(hf_target, prompt, 40)
        assert last.finished and last.finish_reason == "length"
        if mode in ("chain", "tree"):
            assert last.num_drafted > 0, "a chain / tree request must have speculated"
        if mode == "off":
            assert last.num_drafted == 0


def test_stop_token_ends_like_hf_eos(close_engine, hf_target):
    """A stop token ends the request where HF `generate` with that token as EOS ends."""
    prompt = prompts(1, seed=5)[0]
    reference = hf_greedy(hf_target, prompt, 30)
    stop = reference[9]
    first = reference.index(stop)
    tokens, last = run(collect(close_engine, request("stop", prompt, 30, "chain", 4, stop_token_ids=[stop])))
    assert tokens == reference[: first + 1]
    assert last.finish_reason == "stop"


def test_concurrent_sequences_exact_and_kv_freed(close_engine, hf_target):
    """32 sequences of different lengths in flight at once, joining and leaving the batch freely."""
    ps = prompts(32, seed=7)
    lengths = [8 + (5 * i) % 33 for i in range(32)]
    modes = ["chain", "tree", "auto", "off"]

    async def all_of():
        return await asyncio.gather(*(collect(close_engine, request(
            f"c{i}", p, n, modes[i % 4], 2 + i % 3, 2)) for i, (p, n) in enumerate(zip(ps, lengths))))

    results = run(all_of(), timeout=240)
    for (tokens, last), p, n in zip(results, ps, lengths):
        assert tokens == hf_greedy(hf_target, p, n)
        assert last.finish_reason == "length"
    usage = ray.get(close_engine.pipelines[0].verifier.kv_usage.remote())
    assert usage["free"] == usage["total"] and usage["ring"] == 0
    info = ray.get(close_engine.pipelines[0].drafters[0].info.remote())
    assert info["kv_free"] == info["kv_total"] and info["streams"] == 0
    stats = run(close_engine.stats())
    assert stats["num_batches"] < stats["num_steps"], "sequences must share target forwards"


def test_abort_frees_kv_and_ring(close_engine):
    async def abort_midway():
        seen = []

        async def on_chunk(chunk, tokens):
            seen.append(len(tokens))
            if len(tokens) >= 5:
                await close_engine.abort("to-abort")

        tokens, last = await collect(close_engine, request("to-abort", [1, 2, 3], 200, "chain", 3), on_chunk)
        return tokens, last

    tokens, last = run(abort_midway())
    assert last.finished and last.finish_reason == "abort"
    assert len(tokens) < 200
    # ring slots go at once; KV blocks at the verifier loop's next reap (a forward in flight may
    # still read them), so within one step, not necessarily before the abort chunk arrives
    deadline, usage = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        usage = ray.get(close_engine.pipelines[0].verifier.kv_usage.remote())
        if usage["free"] == usage["total"]:
            break
        time.sleep(0.05)
    assert usage["free"] == usage["total"] and usage["ring"] == 0, usage


def test_strict_spread_placement_group(make_engine, tiny_target, close_draft, hf_target):
    """STRICT_SPREAD: the verifier and its two drafters each land on a different node."""
    engine = make_engine(tiny_target, close_draft, drafters=1, strategy="STRICT_SPREAD")
    verifier, drafters = node_ids(engine)
    assert verifier != drafters[0]
    prompt = prompts(1, seed=3)[0]
    tokens, _ = run(collect(engine, request("pg", prompt, 30, "tree", 3, 2)))
    assert tokens == hf_greedy(hf_target, prompt, 30)


def test_rollback_storm_far_draft_exact(make_engine, tiny_target, far_draft, hf_target):
    """A draft far from the target: most trees are rejected and rolled back; output stays exact."""
    engine = make_engine(tiny_target, far_draft, drafters=2)
    ps = prompts(3, seed=11)

    async def all_of():
        return await asyncio.gather(*(collect(engine, request(f"far{i}", p, 32, "chain", 5))
                                      for i, p in enumerate(ps)))

    for (tokens, last), p in zip(run(all_of(), timeout=180), ps):
        assert tokens == hf_greedy(hf_target, p, 32)
        assert last.num_drafted > 0
    stats = run(engine.stats())
    assert stats["acceptance_rate"] < 0.5
    assert stats["drafter_rollbacks"] > 5, stats
    assert {d["streams"] for d in stats["drafters"]} == {0}


def _borrowed(engine) -> int:
    return run(engine.stats())["borrowed_steps"]


def test_plain_steps_borrow_the_cores_of_an_idle_drafter_on_the_same_node(ray_cluster, tiny_target,
                                                                          close_draft, hf_target):
    """On one CPU node, a step with no tree while the drafter has nothing to draft runs on the
    drafter's cores too; a speculating request never does; a drafter on another node lends nothing."""
    from cluster.config import ActorPlacement, AppArgs, PlacementConfig
    from cluster.pipeline import build_pipeline_engine
    from tests.ray_cluster import VERIFIER_RESOURCE

    same_node = ActorPlacement(num_cpus=1, resources={VERIFIER_RESOURCE: 1})
    # lockstep_alone off: a lone stream would otherwise run in lockstep, borrowing each step
    engine = build_pipeline_engine(AppArgs(placement=PlacementConfig(drafter=same_node, verifier=same_node)),
                                   target_dir=str(tiny_target), draft_dir=str(close_draft), num_blocks=256,
                                   lockstep_alone=False)
    try:
        verifier, drafters = node_ids(engine)
        assert drafters == [verifier]
        prompt = prompts(1, seed=11)[0]
        tokens, _ = run(collect(engine, request("borrow-off", prompt, 24, "off", 4, 1)))
        assert tokens == hf_greedy(hf_target, prompt, 24)
        after_off = _borrowed(engine)
        assert after_off >= 20              # 24 tokens: one prefill + 23 plain steps, on 2 threads
        tokens, last = run(collect(engine, request("borrow-chain", prompt, 24, "chain", 3, 1)))
        assert tokens == hf_greedy(hf_target, prompt, 24) and last.num_drafted > 0
        # the drafter was busy throughout, but for at most the last step (one token left: no draft fits)
        assert _borrowed(engine) - after_off <= 1
        assert run(engine.stats())["costs"]
    finally:
        engine.kill_pipeline_actors()


def test_a_lone_stream_the_rules_would_overlap_runs_both_ways_as_measured_and_stays_exact(
        ray_cluster, tiny_target, close_draft, hf_target):
    """`lockstep_measured` (default): with `lockstep_alone` off the rules overlap a lone stream;
    the verifier runs it in windows of each way instead, tells the drafter with every signal,
    and keeps the way that committed more per second. Every token stays the target's."""
    from cluster.config import ActorPlacement, AppArgs, PlacementConfig
    from cluster.pipeline import build_pipeline_engine
    from tests.ray_cluster import VERIFIER_RESOURCE

    same_node = ActorPlacement(num_cpus=1, resources={VERIFIER_RESOURCE: 1})
    engine = build_pipeline_engine(AppArgs(placement=PlacementConfig(drafter=same_node, verifier=same_node)),
                                   target_dir=str(tiny_target), draft_dir=str(close_draft), num_blocks=256,
                                   lockstep_alone=False, plain_threads=0)
    try:
        for j in range(3):
            prompt = prompts(1, seed=40 + j)[0]
            tokens, last = run(collect(engine, request(f"regime-{j}", prompt, 64, "chain", 3, 1)))
            assert tokens == hf_greedy(hf_target, prompt, 64) and last.num_drafted > 0
        (costs,) = run(engine.stats())["costs"]
        assert costs["regime"] in ("overlap", "lockstep")
        assert set(costs["ms_per_token_by_regime"]) == {"overlap", "lockstep"}     # both ways measured
        assert all(ms > 0 for ms in costs["ms_per_token_by_regime"].values())
        # what the planner priced and what a new sequence starts from (how its stalls were read)
        assert list(costs["planner_verify_ms_by_rows"]) == list(range(1, 9))
        assert 0 < costs["pool_gamma"]["model"] <= 1 and costs["pool_probe_gap"] == {}   # chains: no probes
    finally:
        engine.kill_pipeline_actors()


def test_a_drafter_on_another_node_lends_no_cores(close_engine, hf_target):
    before = _borrowed(close_engine)
    prompt = prompts(1, seed=12)[0]
    tokens, _ = run(collect(close_engine, request("noborrow-off", prompt, 16, "off", 4, 1)))
    assert tokens == hf_greedy(hf_target, prompt, 16)
    assert _borrowed(close_engine) == before


def test_lockstep_one_tree_in_flight_borrows_the_idle_drafters_cores(ray_cluster, tiny_target,
                                                                     close_draft, far_draft, hf_target):
    """`ring_slots=1` on one CPU node (lockstep), or the default `lockstep_alone` with one
    stream: the drafter drafts only from the committed prefix, so nothing is assumed and nothing
    rolled back; while the verifier checks its tree the drafter waits for the signal and the
    verification runs on its cores too. Exact throughout, with a close draft (chains and trees)
    and with a far one. By default (`lockstep_in_verifier`) such a lone stream's turns are
    drafted in the verifier's own process, borrowing the idle drafter's cores the same way."""
    from cluster.config import ActorPlacement, AppArgs, PlacementConfig
    from cluster.pipeline import build_pipeline_engine
    from tests.ray_cluster import VERIFIER_RESOURCE

    same_node = ActorPlacement(num_cpus=1, resources={VERIFIER_RESOURCE: 1})
    args = AppArgs(placement=PlacementConfig(drafter=same_node, verifier=same_node))
    for draft, slots, cases, in_verifier in (
            (close_draft, 1, [("chain", 3, 1), ("tree", 3, 2)], False), (far_draft, 1, [("chain", 4, 1)], False),
            (close_draft, 2, [("chain", 3, 1)], False), (close_draft, 2, [("chain", 3, 1), ("tree", 3, 2)], True)):
        # `lockstep_in_verifier` (the default): the verifier drafts a lone stream's turns itself
        engine = build_pipeline_engine(args, target_dir=str(tiny_target), draft_dir=str(draft),
                                       num_blocks=256, ring_slots=slots, lockstep_in_verifier=in_verifier)
        try:
            for j, (mode, k, width) in enumerate(cases):
                prompt = prompts(1, seed=20 + j)[0]
                before = run(engine.stats())
                tokens, last = run(collect(engine, request(f"lock-{mode}-{j}", prompt, 24, mode, k, width)))
                assert tokens == hf_greedy(hf_target, prompt, 24)
                assert last.num_drafted > 0
                after = run(engine.stats())
                spec_steps = after["num_spec_steps"] - before["num_spec_steps"]
                borrowed = after["borrowed_steps"] - before["borrowed_steps"]
                if in_verifier:   # a window of steps on the borrowed cores or its own: whole cases on either
                    assert spec_steps > 0
                else:             # every verification of a tree borrowed the waiting drafter's core
                    assert spec_steps > 0 and borrowed >= spec_steps
            stats = run(engine.stats())
            assert stats["drafter_rollbacks"] == 0, stats     # nothing assumed, nothing undone
            by_actor = sum(d["trees_drafted"] for d in stats["drafters"])
            by_verifier = sum(d["trees_drafted"] for d in stats["local_drafters"])
            assert (by_verifier > 0 and by_actor == 0) if in_verifier else (by_actor > 0 and by_verifier == 0)
            if in_verifier:       # its first window ran on the borrowed cores (both counts measured in
                # tests/cluster/test_model_threads.py)
                assert stats["borrowed_steps"] > 0, stats
                assert set(stats["local_drafters"][0]["ms_per_row_by_threads"]) <= {"1", "2"}, stats
        finally:
            engine.kill_pipeline_actors()


def test_each_actor_role_gets_its_openmp_wait_policy(monkeypatch):
    """cluster.pipeline.actor_env: the role's own variable over OMP_WAIT_POLICY over the default;
    an empty value leaves the actor libgomp's default (no variable set for it)."""
    from cluster.pipeline import ACTOR_WAIT_POLICY, actor_env

    def policy(role):
        return actor_env(role).get("runtime_env", {}).get("env_vars", {}).get("OMP_WAIT_POLICY")

    for name in ("OMP_WAIT_POLICY", "SPECFLASH_VERIFIER_OMP_WAIT_POLICY", "SPECFLASH_DRAFTER_OMP_WAIT_POLICY",
                 "SPECFLASH_STEP_LOG"):
        monkeypatch.delenv(name, raising=False)
    assert ACTOR_WAIT_POLICY == {"verifier": "", "drafter": "PASSIVE"}
    assert actor_env("verifier") == {} and policy("drafter") == "PASSIVE", "the verifier keeps libgomp's default"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert [policy(r) for r in ("verifier", "drafter")] == ["ACTIVE", "ACTIVE"]
    monkeypatch.setenv("SPECFLASH_VERIFIER_OMP_WAIT_POLICY", "")
    monkeypatch.setenv("SPECFLASH_DRAFTER_OMP_WAIT_POLICY", "PASSIVE")
    assert actor_env("verifier") == {} and policy("drafter") == "PASSIVE"
    monkeypatch.setenv("SPECFLASH_STEP_LOG", "/tmp/steps.jsonl")     # the step log reaches both roles
    assert actor_env("verifier") == {"runtime_env": {"env_vars": {"SPECFLASH_STEP_LOG": "/tmp/steps.jsonl"}}}
    assert actor_env("drafter")["runtime_env"]["env_vars"] == {"OMP_WAIT_POLICY": "PASSIVE",
                                                               "SPECFLASH_STEP_LOG": "/tmp/steps.jsonl"}
