"""Autoscaling both sides of the pipeline from the pipeline's own signals (issue 6).

**Verifiers: Serve's custom policy.** Each replica of the Serve ingress deployment hosts one
verifier pipeline, so the deployment's replica count is the verifier count and
`verifier_scaling` is its `autoscaling_config`. Each replica reports, through Serve's
`record_autoscaling_stats` hook, what it saw since its previous report (`replica_signals`):

- `ongoing_requests`: generations admitted and not finished;
- `verifier_busy_fraction`: target-forward time / wall time: how loaded the verifier is;
- `verifier_idle_fraction`: time the verifier waited for a tree with requests pending / its loop
  time: how starved it is of drafts;
- `ring_occupancy`: mean fill of the rings (1 = every sequence's ring full: drafters ahead).

`PipelineLoadPolicy` asks for enough replicas that ongoing requests per replica stay at
`target_ongoing_requests` *and* the mean busy fraction at `target_busy_fraction`; it does not
shrink while the verifiers are still busier than `scale_down_busy_fraction`. Serve wraps it
with `min_replicas` / `max_replicas` and the up/down delays.

**Drafters: inside each replica.** `DrafterAutoscaler` reads its verifier's signals every
`drafter_scaling.period_s` and adds a drafter while the verifier is starved (idle fraction above
`starved_idle_fraction` with rings not full) or removes one while the rings stay full and the
verifier is not starved, each only after the condition held for the up/down delay, within
[`min_per_verifier`, `max_per_verifier`]. A removed drafter is stopped and killed; the
verifier hands its sequences to the remaining drafters once it stops hearing from it.

The decisions are plain functions of the signals (`decide_drafters`, the policy's `desired`),
tested without Ray; the loops only gather signals and act.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("specflash.autoscaling")


# ---------------------------------------------------------------- signals
@dataclass(frozen=True)
class Signals:
    """What one verifier did during a window."""

    busy_fraction: float = 0.0        # target forwards / wall time of the window
    idle_fraction: float = 0.0        # waiting for trees with work pending / verifier loop time
    ring_occupancy: float = 0.0       # mean ring fill (0 when no sample)
    worked: bool = False              # any verification step in the window


class SignalWindow:
    """Turns the verifier's cumulative counters (`SpecStats.as_dict()`) into per-window `Signals`."""

    KEYS = ("verifier_busy_s", "verifier_idle_s", "verifier_wall_s", "ring_samples",
            "ring_occupancy_sum", "num_steps")

    def __init__(self) -> None:
        self.last: dict[str, float] | None = None
        self.last_t = 0.0

    def update(self, stats: dict, now: float | None = None) -> Signals:
        """Signals since the previous call (zeros on the first, or when the counters went back)."""
        now = time.monotonic() if now is None else now
        cur = {k: float(stats.get(k, 0.0) or 0.0) for k in self.KEYS}
        prev, prev_t = self.last, self.last_t
        self.last, self.last_t = cur, now
        if prev is None:
            return Signals()
        d = {k: cur[k] - prev[k] for k in self.KEYS}
        if any(v < 0 for v in d.values()):   # a restarted verifier: its counters began again
            return Signals()
        elapsed = now - prev_t
        return Signals(
            busy_fraction=min(1.0, d["verifier_busy_s"] / elapsed) if elapsed > 0 else 0.0,
            idle_fraction=d["verifier_idle_s"] / d["verifier_wall_s"] if d["verifier_wall_s"] > 0 else 0.0,
            ring_occupancy=d["ring_occupancy_sum"] / d["ring_samples"] if d["ring_samples"] > 0 else 0.0,
            worked=d["num_steps"] > 0,
        )


def replica_signals(window: SignalWindow, engine_stats: dict, ongoing: int,
                    now: float | None = None) -> dict[str, float]:
    """The metrics one replica hands Serve's `record_autoscaling_stats` (numbers only)."""
    s = window.update(engine_stats, now)
    drafters = engine_stats.get("drafters")
    return {"ongoing_requests": float(ongoing), "verifier_busy_fraction": s.busy_fraction,
            "verifier_idle_fraction": s.idle_fraction, "ring_occupancy": s.ring_occupancy,
            "drafters": float(len(drafters) if isinstance(drafters, list) else 0)}


# ---------------------------------------------------------------- verifier side (Serve)
class PipelineLoadPolicy:
    """Serve custom autoscaling policy (`policy_function: cluster.autoscaling:PipelineLoadPolicy`).

    Serve instantiates the class once with `policy_kwargs` and calls it every autoscaling tick
    with an `AutoscalingContext`; it returns (desired replicas, policy state)."""

    def __init__(self, target_busy_fraction: float = 0.8, scale_down_busy_fraction: float = 0.5) -> None:
        if not 0 < scale_down_busy_fraction <= target_busy_fraction <= 1:
            raise ValueError("need 0 < scale_down_busy_fraction <= target_busy_fraction <= 1, got "
                             f"{scale_down_busy_fraction} and {target_busy_fraction}")
        self.target_busy, self.keep_busy = target_busy_fraction, scale_down_busy_fraction

    def desired(self, current: int, ongoing: float, target_ongoing: float,
                busy: list[float]) -> int:
        """Replicas wanted for `ongoing` requests and the replicas' busy fractions `busy`."""
        by_requests = ongoing / target_ongoing if target_ongoing > 0 else 0.0
        mean_busy = sum(busy) / len(busy) if busy else 0.0
        by_busy = current * mean_busy / self.target_busy
        want = max(by_requests, by_busy)
        if want < current and mean_busy > self.keep_busy:
            want = current       # the verifiers still work hard: shrinking would overload the rest
        return max(0, math.ceil(want - 1e-9))

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        per_replica = metrics.get("ongoing_requests")
        ongoing = sum(per_replica.values()) if per_replica else float(ctx.total_num_requests)
        target = float(getattr(ctx.config, "target_ongoing_requests", None) or 1.0)
        busy = list((metrics.get("verifier_busy_fraction") or {}).values())
        state = dict(ctx.policy_state or {})
        want = self.desired(ctx.current_num_replicas, ongoing, target, busy)
        state["last_decision"] = {"ongoing": ongoing, "busy": busy, "desired": want}
        return want, state


# ---------------------------------------------------------------- drafter side (in the replica)
@dataclass
class DrafterDecisionState:
    starved_since: float | None = None
    full_since: float | None = None


def decide_drafters(cfg, signals: Signals, count: int, state: DrafterDecisionState,
                    now: float) -> int:
    """+1, -1 or 0 drafters for one pipeline. `cfg` is a `cluster.config.DrafterScaling`."""
    starved = signals.worked and signals.idle_fraction > cfg.starved_idle_fraction \
        and signals.ring_occupancy < cfg.full_ring_occupancy
    full = signals.worked and signals.ring_occupancy >= cfg.full_ring_occupancy \
        and signals.idle_fraction <= cfg.starved_idle_fraction
    if not starved:
        state.starved_since = None
    elif state.starved_since is None:
        state.starved_since = now
    if not full:
        state.full_since = None
    elif state.full_since is None:
        state.full_since = now
    if count < cfg.min_per_verifier:
        return +1
    if count > cfg.max_per_verifier:
        return -1
    if starved and count < cfg.max_per_verifier and now - state.starved_since >= cfg.upscale_delay_s:
        state.starved_since = now        # the next step waits a whole delay again
        return +1
    if full and count > cfg.min_per_verifier and now - state.full_since >= cfg.downscale_delay_s:
        state.full_since = now
        return -1
    return 0


class DrafterAutoscaler:
    """Adjusts the drafters of each pipeline of a `PipelineEngine` (see the module docstring)."""

    def __init__(self, engine, cfg) -> None:
        self.engine, self.cfg = engine, cfg
        self.windows: dict[int, SignalWindow] = {}
        self.states: dict[int, DrafterDecisionState] = {}
        self.actions: list[tuple[float, int, int]] = []     # (time, pipeline, +1/-1): for /metrics, tests
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.period_s)
            try:
                await self.step()
            except Exception:    # a verifier being restarted, a Ray hiccup: try again next period
                log.exception("drafter autoscaling step failed")

    async def step(self, now: float | None = None) -> list[int]:
        """One round over the pipelines; returns the change applied to each."""
        now = time.monotonic() if now is None else now
        changes = []
        for i, pipe in enumerate(self.engine.pipelines):
            if getattr(pipe, "spawn_drafter", None) is None:
                changes.append(0)
                continue
            raw = await asyncio.wait_for(pipe.verifier.get_stats.remote(), 10)
            signals = self.windows.setdefault(i, SignalWindow()).update(raw, now)
            change = decide_drafters(self.cfg, signals, len(pipe.drafters),
                                     self.states.setdefault(i, DrafterDecisionState()), now)
            if change > 0:
                await self._add(pipe)
            elif change < 0:
                await self._remove(pipe)
            if change:
                self.actions.append((now, i, change))
                log.info("pipeline %d: %s a drafter (now %d; verifier idle %.2f, rings %.2f full)", i,
                         "added" if change > 0 else "removed", len(pipe.drafters),
                         signals.idle_fraction, signals.ring_occupancy)
            changes.append(change)
        return changes

    async def _add(self, pipe) -> None:
        index = 1 + max(pipe.drafter_indices, default=-1)
        drafter = pipe.spawn_drafter(index)
        await asyncio.wait_for(drafter.ready.remote(), 300)
        pipe.drafters.append(drafter)
        pipe.drafter_indices.append(index)

    async def _remove(self, pipe) -> None:
        import ray

        drafter = pipe.drafters.pop()
        pipe.drafter_indices.pop()
        try:
            await asyncio.wait_for(drafter.stop.remote(), 10)
        except Exception:
            pass
        ray.kill(drafter, no_restart=True)


def start_drafter_autoscaler(engine, app_args) -> DrafterAutoscaler | None:
    """A running DrafterAutoscaler for a PipelineEngine whose drafter count may change, else None.
    Call it on the event loop that serves the engine."""
    cfg = app_args.drafter_scaling
    if not cfg.enabled or not getattr(engine, "pipelines", None):
        return None
    scaler = DrafterAutoscaler(engine, cfg)
    scaler.start()
    return scaler
