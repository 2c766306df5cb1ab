"""Autoscaling of both sides (issue 6): the verifier policy Serve runs, the drafter decisions, and
the drafter autoscaler acting on a live pipeline (drafter count changes, output stays exact)."""
from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace

import pytest

from cluster.autoscaling import (DrafterAutoscaler, DrafterDecisionState, PipelineLoadPolicy, SignalWindow,
                                 Signals, decide_drafters, replica_signals)
from cluster.config import AppArgs, DrafterScaling, ReplicaScaling

from .pipeline_helpers import collect, hf_greedy, prompts, request


def ctx(current, ongoing=None, busy=None, total=0.0, target=8.0):
    metrics = {}
    if ongoing is not None:
        metrics["ongoing_requests"] = {f"r{i}": v for i, v in enumerate(ongoing)}
    if busy is not None:
        metrics["verifier_busy_fraction"] = {f"r{i}": v for i, v in enumerate(busy)}
    return SimpleNamespace(current_num_replicas=current, aggregated_metrics=metrics, total_num_requests=total,
                           config=SimpleNamespace(target_ongoing_requests=target), policy_state={})


# ---------------------------------------------------------------- verifier policy
def test_policy_scales_with_requests_and_with_verifier_busy_fraction():
    policy = PipelineLoadPolicy(target_busy_fraction=0.8, scale_down_busy_fraction=0.5)
    # requests alone: 40 ongoing at 8 per replica -> 5
    assert policy(ctx(2, ongoing=[20, 20], busy=[0.3, 0.3]))[0] == 5
    # few requests but verifiers saturated: 2 replicas at 100 % busy, target 80 % -> 3
    assert policy(ctx(2, ongoing=[2, 2], busy=[1.0, 1.0]))[0] == 3
    # exactly on target: no change
    assert policy(ctx(2, ongoing=[8, 8], busy=[0.8, 0.8]))[0] == 2
    # light load, idle verifiers: shrink (Serve clamps to min_replicas afterwards)
    assert policy(ctx(4, ongoing=[1, 0, 0, 0], busy=[0.1, 0.0, 0.0, 0.0]))[0] == 1
    # light request count but verifiers still busier than the keep threshold: hold
    assert policy(ctx(4, ongoing=[1, 1, 1, 1], busy=[0.6, 0.6, 0.6, 0.6]))[0] == 4
    # no custom metrics yet (replicas starting): Serve's own request count is used
    want, state = policy(ctx(1, total=20.0))
    assert want == 3 and state["last_decision"]["ongoing"] == 20.0


def test_policy_rejects_inconsistent_thresholds():
    with pytest.raises(ValueError, match="scale_down_busy_fraction"):
        PipelineLoadPolicy(target_busy_fraction=0.5, scale_down_busy_fraction=0.7)


def test_policy_goes_through_serves_own_config_and_loader():
    """The autoscaling_config we render is what Serve accepts; the policy it deserialises is
    instantiated with our kwargs, as Serve's controller does, and then decides."""
    from ray.serve.config import AutoscalingConfig

    scaling = ReplicaScaling(min_replicas=1, max_replicas=4, target_ongoing_requests=8,
                             policy_kwargs={"target_busy_fraction": 0.5})
    cfg = AutoscalingConfig(**scaling.autoscaling_config())
    assert cfg.policy.policy_function == "cluster.autoscaling:PipelineLoadPolicy"
    cls = cfg.policy.get_policy()
    policy = cls(**cfg.policy.policy_kwargs)
    assert policy.target_busy == 0.5
    assert policy(ctx(1, ongoing=[1], busy=[1.0]))[0] == 2


# ---------------------------------------------------------------- signals
def test_signal_window_differences_counters():
    w = SignalWindow()
    base = {"verifier_busy_s": 1.0, "verifier_idle_s": 0.5, "verifier_wall_s": 2.0, "ring_samples": 10,
            "ring_occupancy_sum": 5.0, "num_steps": 4}
    assert w.update(base, now=100.0) == Signals()
    nxt = {"verifier_busy_s": 4.0, "verifier_idle_s": 1.5, "verifier_wall_s": 6.0, "ring_samples": 20,
           "ring_occupancy_sum": 14.0, "num_steps": 9}
    s = w.update(nxt, now=110.0)
    assert s == Signals(busy_fraction=0.3, idle_fraction=0.25, ring_occupancy=0.9, worked=True)
    # a restarted verifier: counters went back to zero -> no signal rather than a negative one
    assert w.update({k: 0 for k in nxt}, now=120.0) == Signals()
    out = replica_signals(SignalWindow(), {"drafters": [{}, {}]}, ongoing=3)
    assert out["ongoing_requests"] == 3.0 and out["drafters"] == 2.0
    assert all(isinstance(v, float) for v in out.values())


# ---------------------------------------------------------------- drafter decisions
def test_drafter_decisions_follow_starvation_and_full_rings_after_their_delays():
    cfg = DrafterScaling(min_per_verifier=1, max_per_verifier=3, starved_idle_fraction=0.2,
                         full_ring_occupancy=0.9, upscale_delay_s=10, downscale_delay_s=30)
    starved = Signals(busy_fraction=0.5, idle_fraction=0.4, ring_occupancy=0.1, worked=True)
    full = Signals(busy_fraction=0.9, idle_fraction=0.0, ring_occupancy=0.95, worked=True)
    quiet = Signals()
    st = DrafterDecisionState()
    assert decide_drafters(cfg, starved, 1, st, now=0.0) == 0       # starvation must last
    assert decide_drafters(cfg, starved, 1, st, now=5.0) == 0
    assert decide_drafters(cfg, starved, 1, st, now=10.0) == +1
    assert decide_drafters(cfg, starved, 2, st, now=11.0) == 0      # the next step waits again
    assert decide_drafters(cfg, quiet, 2, st, now=25.0) == 0        # a quiet window resets it
    assert decide_drafters(cfg, starved, 3, st, now=40.0) == 0      # at the maximum
    assert decide_drafters(cfg, starved, 3, st, now=99.0) == 0
    st = DrafterDecisionState()
    assert decide_drafters(cfg, full, 3, st, now=0.0) == 0
    assert decide_drafters(cfg, full, 3, st, now=30.0) == -1
    assert decide_drafters(cfg, full, 1, DrafterDecisionState(full_since=0.0), now=100.0) == 0  # at minimum
    # out of bounds after a config change: back inside at once
    assert decide_drafters(cfg, quiet, 0, DrafterDecisionState(), now=0.0) == +1
    assert decide_drafters(cfg, quiet, 5, DrafterDecisionState(), now=0.0) == -1


def test_drafter_scaling_config_is_checked():
    with pytest.raises(ValueError, match="min_per_verifier <= max_per_verifier"):
        DrafterScaling(min_per_verifier=3, max_per_verifier=2)
    with pytest.raises(ValueError, match="outside drafter_scaling"):
        AppArgs(drafters_per_verifier=3, drafter_scaling=DrafterScaling(max_per_verifier=2))
    assert not DrafterScaling().enabled and DrafterScaling(max_per_verifier=2).enabled


# ---------------------------------------------------------------- on a live pipeline
def test_drafter_autoscaler_adds_and_removes_drafters_of_a_live_pipeline(make_engine, tiny_target,
                                                                          close_draft, hf_target):
    """Thresholds set so a running request reads as starved: one drafter is added and attaches to
    the verifier; then the maximum is lowered and it is removed; the requests' output stays exact."""
    import ray

    engine = make_engine(tiny_target, close_draft, drafters=1)
    pipe = engine.pipelines[0]
    grow = DrafterScaling(min_per_verifier=1, max_per_verifier=2, starved_idle_fraction=1e-6,
                          full_ring_occupancy=1.0, upscale_delay_s=0, downscale_delay_s=0)
    # The removal path, not the full-ring signal (a matter of timing, unit-tested above): a lowered
    # maximum makes the second drafter one too many at the next step, whatever the rings hold.
    shrink = DrafterScaling(min_per_verifier=1, max_per_verifier=1, upscale_delay_s=0,
                            downscale_delay_s=0)
    scaler = DrafterAutoscaler(engine, grow)
    ps = prompts(6, seed=41)
    seen, outputs = {}, []

    async def traffic(stop: asyncio.Event):
        """Requests back to back, the prompts in turn, until told to stop (within 300 s): a new
        drafter's start may take many rounds of requests, and the removal must still find
        traffic running (a cap of 30 requests ran out between the two once drafting got faster)."""
        deadline = time.monotonic() + 300
        for k in itertools.count():
            if stop.is_set() or time.monotonic() > deadline:
                return
            prompt = ps[k % len(ps)]
            tokens, last = await collect(engine, request(f"scaled-{k}", prompt, 200, "chain", 4))
            outputs.append((prompt, tokens, last.finish_reason))

    async def step_until(task, change) -> bool:
        while not task.done():
            await asyncio.sleep(0.5)
            if await scaler.step() == [change]:
                return True
        return False

    async def scenario():
        stop = asyncio.Event()
        task = asyncio.ensure_future(traffic(stop))
        await scaler.step()                                   # opens the first window
        seen["added"] = await step_until(task, +1)
        seen["live_after_add"] = (await pipe.verifier.health.remote())["drafters_live"]
        scaler.cfg = shrink
        seen["removed"] = await step_until(task, -1)
        stop.set()
        await task

    asyncio.run(asyncio.wait_for(scenario(), 400))
    assert seen["added"] and seen["removed"], (seen, scaler.actions)
    assert 1 in seen["live_after_add"], seen
    assert [c for _, _, c in scaler.actions] == [+1, -1]
    assert len(pipe.drafters) == 1 and pipe.drafter_indices == [0]
    assert outputs
    want = {tuple(p): hf_greedy(hf_target, p, 200) for p in ps}     # the prompts repeat
    for prompt, tokens, reason in outputs:
        assert tokens == want[tuple(prompt)] and reason == "length"
    assert ray.get(pipe.verifier.health.remote(), timeout=10)["ok"]
