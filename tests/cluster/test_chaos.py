"""Reliability of the Ray pipeline under faults (issue 7): a short fault-injection soak
(bench/chaos.py) on the session cluster, a verifier restarted by Ray, a drafter node lost
for good, the verifier's node lost for good (issue 26), and malformed / version-mismatched wire frames sent to live actors.

Tests that kill nodes add a node of their own (a resource no other test uses) to the
session cluster and remove it after, so the shared head and drafter nodes are untouched.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

import msgpack
import numpy as np
import pytest
import ray

from tests.ray_cluster import DRAFTER_RESOURCE, VERIFIER_RESOURCE
from .pipeline_helpers import collect, hf_greedy, prompts, request, run
from .test_pipeline_faults import kill_after, wait_for

@pytest.fixture
def extra_node(ray_cluster):
    """`add(resource) -> (node, its add_node args)`: a node of the test's own on the session
    cluster; every node the test left behind (other than the session's two) is removed after."""
    cluster = ray_cluster.cluster

    def add(resource: str):
        args = {"num_cpus": 2, "resources": {resource: 4}, "object_store_memory": 96 * 2**20}
        node = cluster.add_node(**args)
        cluster.wait_for_nodes()
        return node, args

    yield add
    for node in list(cluster.worker_nodes):
        if node.node_id not in (ray_cluster.drafter_node, ray_cluster.verifier_node):
            cluster.remove_node(node)


def test_short_soak_nothing_lost_hung_or_leaked(ray_cluster, extra_node, tiny_target, close_draft, bench_script):
    chaos = bench_script("chaos")
    node, node_args = extra_node("specflash_chaos_drafter")
    # the verifier's node lost for good has a test of its own (below): the session's verifier is on the head
    faults = tuple(f for f in chaos.FAULTS if f != "verifier_node")
    cfg = chaos.SoakConfig(duration_s=45, max_requests=150, concurrency=3, request_timeout_s=60, faults=faults,
                           fault_every_s=5, node_down_s=2, max_tokens=32, warmup_requests=4,
                           after_requests=4, settle_s=90, rss_margin_mb=96, seed=7)
    report = chaos.run_soak(ray_cluster.cluster, node, node_args,
                            chaos.placement_args("specflash_chaos_drafter", VERIFIER_RESOURCE),
                            str(tiny_target), str(close_draft), cfg)
    summary = json.dumps({k: v for k, v in asdict(report).items() if k != "config"})
    assert report.problems(cfg.rss_margin_mb) == [], summary
    assert report.lost == report.hung == report.leaked_blocks == report.leaked_ring_slots == 0
    assert set(faults) <= set(report.faults), f"every fault kind must be injected: {report.faults}"
    assert report.exact >= 10 and report.after_exact == cfg.after_requests, summary
    assert report.sent == (report.exact + report.complete_sampled + report.clear_errors
                           + report.lost + report.hung)
    assert set(report.speculation) == set(chaos.SPECULATION_COUNTERS), report.speculation


def test_the_soak_refuses_two_policies_at_once(bench_script, capsys):
    """`--restart-depth` and `--bridge-depth` are one choice (as in the cluster config): a
    clear error before any cluster starts."""
    chaos = bench_script("chaos")
    for bad in (["--restart-depth", "1", "--bridge-depth", "2"], ["--restart-depth", "-2"], ["--bridge-depth", "9"]):
        with pytest.raises(SystemExit) as refused:
            chaos.main(bad)
        assert refused.value.code == 2, bad
    assert "at most one of them above 0" in capsys.readouterr().err


def test_the_verifier_node_fault_needs_nodes_it_may_remove(bench_script):
    """The soak cannot take the head node away: asked for "verifier_node" without the verifier's
    own removable nodes, it refuses before any load."""
    import random

    chaos = bench_script("chaos")
    with pytest.raises(ValueError, match="cannot remove the head node"):
        chaos.FaultInjector(None, None, {}, None, chaos.SoakConfig(faults=("verifier_node",)), random.Random(0))


def test_verifier_restarted_in_flight_fail_retryable_new_ones_served(make_engine, tiny_target, close_draft,
                                                                      hf_target):
    engine = make_engine(tiny_target, close_draft, verifier_max_restarts=2, drafter_timeout_s=1.0,
                         chunk_timeout_s=60)
    verifier = engine.pipelines[0].verifier
    before = run(engine.health())["pipelines"][0]["incarnation"]
    p1, p2 = prompts(2, seed=41)
    killed = []
    on_chunk = kill_after(verifier, 5, killed)            # Ray restarts it (max_restarts)
    tokens, last = run(collect(engine, request("in-flight", p1, 200, "chain", 3), on_chunk), 120)
    assert killed and last.finish_reason == "error"
    assert last.error.startswith("retryable: ") and "died" in last.error
    assert tokens == hf_greedy(hf_target, p1, len(tokens)), "tokens before the error are the target's"

    def back_with_drafter():
        h = run(engine.health(), 30)
        return h if h["ok"] and h["speculation"] else None

    health = wait_for(back_with_drafter, timeout=120)
    assert health["pipelines"][0]["incarnation"] != before, "the verifier must have been restarted"
    tokens2, last2 = run(collect(engine, request("after", p2, 48, "chain", 3)))
    assert tokens2 == hf_greedy(hf_target, p2, 48) and last2.finish_reason == "length"
    assert last2.num_drafted > 0, "the drafter must reattach to the restarted verifier and speculate"
    usage = ray.get(verifier.kv_usage.remote())
    assert usage["free"] == usage["total"] and usage["ring"] == 0 and usage["streams"] == 0


def test_drafter_node_lost_for_good_serves_without_speculation(make_engine, ray_cluster, extra_node,
                                                               tiny_target, close_draft, hf_target):
    from cluster.config import ActorPlacement, AppArgs, PlacementConfig
    from serving.openai_api import OpenAIServer, ServerSettings
    from cluster.pipeline import build_pipeline_engine
    from models import load_tokenizer

    node, _ = extra_node("specflash_lost_drafter")
    args = AppArgs(placement=PlacementConfig(
        drafter=ActorPlacement(num_cpus=1, resources={"specflash_lost_drafter": 1}),
        verifier=ActorPlacement(num_cpus=1, resources={VERIFIER_RESOURCE: 1})))
    engine = build_pipeline_engine(args, target_dir=str(tiny_target), draft_dir=str(close_draft),
                                   num_blocks=256, drafter_timeout_s=1.0)
    try:
        server = OpenAIServer(engine, load_tokenizer(tiny_target), ServerSettings(model_name="tiny",
                                                                                  max_context=256))
        p1, p2 = prompts(2, seed=51)
        tokens, last = run(collect(engine, request("before", p1, 32, "chain", 3)))
        assert tokens == hf_greedy(hf_target, p1, 32) and last.num_drafted > 0
        status, body = run(server.health())
        assert status == 200 and body["speculation"] is True

        ray_cluster.cluster.remove_node(node)              # gone for good: nothing offers its resource
        wait_for(lambda: not run(engine.health(), 30)["speculation"], timeout=60)
        status, body = run(server.health())
        assert status == 200 and body["speculation"] is False, body
        assert "drafter unavailable" in body["engine"]["speculation_reason"]
        metrics = run(server.metrics()).decode()
        assert "specflash_spec_speculation_enabled 0.0" in metrics
        assert "specflash_spec_drafters_alive 0.0" in metrics

        tokens2, last2 = run(collect(engine, request("alone", p2, 40, "chain", 3)), 60)
        assert tokens2 == hf_greedy(hf_target, p2, 40) and last2.finish_reason == "length"
        assert last2.num_drafted == 0, "with no drafter the verifier decodes alone"
    finally:
        engine.kill_pipeline_actors()


@pytest.mark.parametrize("strategy", ["NONE", "STRICT_SPREAD"])
def test_verifier_node_lost_for_good_restarts_elsewhere_and_health_says_so(strategy, ray_cluster, extra_node,
                                                                           tiny_target, close_draft, hf_target):
    """Issue 26 item 5: the verifier's node removed for good. Its request in flight ends
    retryable; while no node can host the verifier /health is 503 and names the lost node;
    once one that can joins, Ray restarts the verifier there, the drafter reattaches, /health
    says where it moved and new requests are served exactly. Under STRICT_SPREAD the verifier
    and its drafter sit in one placement group, bundles on distinct nodes: Ray places the lost
    bundle again on the new node, away from the drafter's, and restarts the verifier in it."""
    from cluster.config import ActorPlacement, AppArgs, PlacementConfig
    from cluster.pipeline import build_pipeline_engine
    from cluster.serve_app import replace_replica
    from models import load_tokenizer
    from serving.openai_api import OpenAIServer, ServerSettings

    resource = "specflash_lost_verifier"
    node, _ = extra_node(resource)
    args = AppArgs(placement=PlacementConfig(
        strategy=strategy, drafter=ActorPlacement(num_cpus=1, resources={DRAFTER_RESOURCE: 1}),
        verifier=ActorPlacement(num_cpus=1, resources={resource: 1})))
    engine = build_pipeline_engine(args, target_dir=str(tiny_target), draft_dir=str(close_draft), num_blocks=256,
                                   drafter_timeout_s=1.0, chunk_timeout_s=60)
    try:
        server = OpenAIServer(engine, load_tokenizer(tiny_target), ServerSettings(model_name="tiny", max_context=256))
        assert run(engine.health())["pipelines"][0]["node_id"] == node.node_id
        p1, p2 = prompts(2, seed=71)
        removed = []

        async def remove_node(chunk, tokens):
            if not removed and len(tokens) >= 5:
                removed.append(len(tokens))
                await asyncio.to_thread(ray_cluster.cluster.remove_node, node)   # nothing else offers `resource`

        tokens, last = run(collect(engine, request("in-flight", p1, 2000, "chain", 2), remove_node), 120)
        assert removed and last.finish_reason == "error" and last.error.startswith("retryable: "), last
        assert tokens == hf_greedy(hf_target, p1, len(tokens)), "tokens before the error are the target's"

        def lost_named():     # Ray has noticed the node's death; the verifier cannot be placed anywhere
            status, body = run(server.health(), 30)
            assert status == 503 and body["engine"]["ok"] is False, body
            return body if node.node_id in (body["engine"]["verifier"] or "") else None

        body = wait_for(lost_named, timeout=90)
        assert f"lost node {node.node_id}" in body["engine"]["verifier"]
        engine_health = body["engine"]
        assert replace_replica(engine_health) is None, "Serve waits while Ray may restart the verifier"
        assert "has not come back" in replace_replica(engine_health, grace_s=0.0)
        engine.restart_wait_s = 0.0     # down longer than a request waits: new ones fail at once, retryable
        refused, last = run(collect(engine, request("in-the-gap", p2, 8, "chain", 2)), 60)
        assert refused == [] and last.error.startswith("retryable: verifier: lost node"), last
        engine.restart_wait_s = 30.0

        spare, _ = extra_node(resource)                 # a live node that can host it: Ray restarts it there

        def back():
            status, body = run(server.health(), 30)
            return body if status == 200 and body["speculation"] else None

        body = wait_for(back, timeout=120)
        event = body["engine"]["verifier"]
        assert event.startswith(f"lost node {node.node_id} at ") and f"restarted on node {spare.node_id}" in event
        assert body["engine"]["pipelines"][0]["node_id"] == spare.node_id
        if strategy == "STRICT_SPREAD":
            from ray.util import placement_group_table

            pg = engine.pipelines[0].placement_group
            table = placement_group_table(pg)
            assert table["strategy"] == "STRICT_SPREAD" and table["state"] == "CREATED", table
            assert table["bundles_to_node_id"][0] == spare.node_id, table
            assert table["bundles_to_node_id"][1] == ray_cluster.drafter_node, table
        tokens2, last2 = run(collect(engine, request("after", p2, 40, "chain", 3)), 60)
        assert tokens2 == hf_greedy(hf_target, p2, 40) and last2.finish_reason == "length"
        assert last2.num_drafted > 0, "the drafter must reattach to the moved verifier and speculate"
    finally:
        engine.kill_pipeline_actors()


# ---------------------------------------------------------------- hostile frames
@ray.remote(num_cpus=0)
class CorruptingProxy:
    """Sits between a drafter and its verifier and spoils the frames it is told to, one each:
    "put_version" (a tree header of another wire version), "put_tensors" (a tree whose
    tensors disagree with its header), "reply_version" / "reply_garbage" (a signal frame of
    another version / not msgpack at all)."""

    def __init__(self, verifier) -> None:
        self.verifier, self.plan, self.done = verifier, [], []

    def arm(self, plan: list[str]) -> None:
        self.plan = list(plan)

    def spoiled(self) -> list[str]:
        return self.done

    async def exchange(self, drafter, incarnation, puts, wait_s, *rest):
        from speculation.wire import WIRE_VERSION

        kind = self.plan[0] if self.plan else None
        if kind == "put_version" and puts:
            body = msgpack.unpackb(puts[0][0])
            puts = [(msgpack.packb({**body, "v": WIRE_VERSION + 1}), puts[0][1])] + list(puts[1:])
            self._spoiled()
        elif kind == "put_tensors" and puts:
            frame = puts[0][1]                 # the tree frame travels in the call (cluster/transport.py)
            bad = (frame[0], np.zeros(len(frame[1]) + 1, np.int64), *frame[2:])
            puts = [(puts[0][0], bad)] + list(puts[1:])
            self._spoiled()
        reply = await self.verifier.exchange.remote(drafter, incarnation, puts, wait_s, *rest)
        if kind in ("reply_version", "reply_garbage") and msgpack.unpackb(reply)["items"]:
            self._spoiled()      # the signals in it are lost: the drafter must resync
            if kind == "reply_garbage":
                return b"\xc1\xc1 not msgpack"
            return msgpack.packb({**msgpack.unpackb(reply), "v": WIRE_VERSION + 1})
        return reply

    def _spoiled(self) -> None:
        self.done.append(self.plan.pop(0))


def test_actors_reject_bad_frames_log_and_keep_serving_exactly(ray_cluster, tiny_target, close_draft,
                                                                hf_target):
    from cluster.actors import remote_classes
    from speculation.settings import EngineSettings
    from cluster.pipeline import Pipeline, PipelineEngine
    from speculation.wire import WIRE_VERSION, TreeHeader, pack_header

    # the proxy spoils actor calls; a malformed tree over the exchange socket is refused the same
    # way (tests/cluster/test_exchange_socket.py)
    settings = EngineSettings(num_blocks=256, drafter_timeout_s=1.0, exchange="actor")
    drafter_cls, verifier_cls = remote_classes()
    verifier = verifier_cls.options(num_cpus=1, resources={VERIFIER_RESOURCE: 1}).remote(
        str(tiny_target), settings.model_dump())
    proxy = CorruptingProxy.options(resources={VERIFIER_RESOURCE: 0.01}).remote(verifier)
    drafter = drafter_cls.options(num_cpus=1, resources={DRAFTER_RESOURCE: 1}).remote(
        0, proxy, str(close_draft), str(tiny_target), settings.model_dump())
    engine = PipelineEngine([Pipeline(verifier, [drafter])], settings, chunk_timeout_s=60)
    try:
        assert ray.get(drafter.ready.remote(60), timeout=90)
        # an intruder's frames, straight into the verifier: refused whole, nothing attached
        ref = ray.put(("not", "a", "tree"))
        header = TreeHeader("nobody", 0, 0, 1, 1, [], 0, 0)
        other_version = msgpack.packb({**msgpack.unpackb(pack_header(header)), "v": WIRE_VERSION + 1})
        for frame in (b"\xc1 garbage", other_version, msgpack.packb({"v": WIRE_VERSION, "kind": "tree"})):
            with pytest.raises(ray.exceptions.RayTaskError, match="WireError"):
                ray.get(verifier.exchange.remote(7, "intruder", [(frame, [ref])], 0.0), timeout=30)
        assert 7 not in run(engine.health())["pipelines"][0]["drafters_live"]

        # spoiled frames on the live drafter <-> verifier path, during a request
        plan = ["put_version", "put_tensors", "reply_version", "reply_garbage"]
        ray.get(proxy.arm.remote(plan))
        served = []
        for i, prompt in enumerate(prompts(4, seed=61)):
            tokens, last = run(collect(engine, request(f"r{i}", prompt, 40, "chain", 3)))
            assert tokens == hf_greedy(hf_target, prompt, 40) and last.finish_reason == "length"
            served.append(last.num_drafted)
            if ray.get(proxy.spoiled.remote()) == plan:
                break
        assert ray.get(proxy.spoiled.remote()) == plan, "every kind of bad frame must have been sent"

        v_stats = run(engine.stats())
        d_info = ray.get(drafter.info.remote())
        assert v_stats["frames_rejected"] >= 3 + 2, "3 intruder frames, a bad header and a bad tree"
        assert d_info["frames_rejected"] >= 3, "a refused put and two bad signal frames"
        assert d_info["running"] and run(engine.health())["ok"]
        # and the pair still speculates, exactly
        prompt = prompts(5, seed=62)[4]
        tokens, last = run(collect(engine, request("after", prompt, 40, "chain", 3)))
        assert tokens == hf_greedy(hf_target, prompt, 40) and last.num_drafted > 0
        usage = ray.get(verifier.kv_usage.remote())
        assert usage["free"] == usage["total"] and usage["ring"] == 0
    finally:
        engine.kill_pipeline_actors()
        ray.kill(proxy)
