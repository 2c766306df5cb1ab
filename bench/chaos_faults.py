"""The chaos soak's faults (bench/chaos.py): the injector that kills and restarts the pipeline's
actors and the drafter's node and removes the verifier's node for good, and what the actors
hold and how much memory (leak checks), and the report as printed.

Imported by bench/chaos.py, which uses every name here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import random
import time
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.chaos import SoakConfig, SoakReport

MB = 2**20


class FaultInjector:
    """Kills the drafter, the verifier or the drafter node's raylet, or removes the verifier's node
    for good, at random moments. `verifier_nodes`: the nodes the soak may remove from under the
    verifier, all started with `verifier_args` (each one removed is replaced by a new node, so
    the cluster keeps a spare where Ray restarts the verifier)."""

    def __init__(self, cluster, drafter_node, node_args: dict, engine, cfg: SoakConfig, rng: random.Random,
                 verifier_nodes: list | None = None, verifier_args: dict | None = None):
        self.cluster, self.node, self.node_args = cluster, drafter_node, node_args
        self.verifier_nodes, self.verifier_args = list(verifier_nodes or []), verifier_args
        if "verifier_node" in cfg.faults and not (self.verifier_nodes and verifier_args):
            raise ValueError("the fault 'verifier_node' needs the nodes that host the verifier (verifier_nodes, "
                             "verifier_args): the soak cannot remove the head node")
        self.engine, self.cfg, self.rng = engine, cfg, rng
        self.counts: Counter = Counter()
        self.last_fault: float | None = None
        self._next: list[str] = []
        self.log: list = []
        self.t0 = time.monotonic()

    def round_done(self) -> bool:
        """Every configured fault kind was injected (successfully) at least once."""
        return all(self.counts[kind] > 0 for kind in self.cfg.faults)

    def choose(self) -> str:
        """Rounds of every fault kind in a random order: each kind happens once per round."""
        if not self._next:
            self._next = self.rng.sample(list(self.cfg.faults), len(self.cfg.faults))
        return self._next.pop()

    def run(self, load: concurrent.futures.Future) -> None:
        """Faults until the load ends. On the main thread: Ray's node management uses signals."""
        self.t0 = time.monotonic()
        while True:
            gap = self.rng.uniform(0.5, 1.5) * self.cfg.fault_every_s
            concurrent.futures.wait([load], timeout=gap)
            if load.done():
                return
            self.inject(self.choose())

    def inject(self, kind: str) -> None:
        import ray

        pipe = self.engine.pipelines[0]
        self.last_fault = start = time.monotonic()
        outcome = "ok"
        try:
            if kind == "drafter":
                ray.kill(pipe.drafters[0], no_restart=False)       # Ray restarts it
            elif kind == "verifier":
                ray.kill(pipe.verifier, no_restart=False)
            elif kind == "raylet":
                self.node.kill_raylet()                              # the node dies with its raylet
                time.sleep(self.cfg.node_down_s)
                self.cluster.remove_node(self.node, allow_graceful=False)   # reap the rest of it
                self.node = self.cluster.add_node(**self.node_args)  # and a fresh one joins
            elif kind == "verifier_node":
                self.lose_verifier_node(pipe)
            else:
                raise ValueError(f"unknown fault {kind!r}")
            self.counts[kind] += 1
        except Exception as e:       # e.g. killing an actor that is still restarting
            outcome = f"failed: {type(e).__name__}: {e}"[:200]
            self.counts[f"{kind} (failed: {type(e).__name__})"] += 1
        self.last_fault = time.monotonic()
        self.log.append((round(start - self.t0, 1), kind, outcome))

    def lose_verifier_node(self, pipe) -> None:
        """Remove the verifier's node for good (its id never returns) and add a new one in its place."""
        import ray

        where = ray.get(pipe.verifier.health.remote(), timeout=30)["node_id"]
        node = next((n for n in self.verifier_nodes if n.node_id == where), None)
        if node is None:
            raise RuntimeError(f"the verifier runs on node {where}, not on one the soak may remove")
        self.cluster.remove_node(node, allow_graceful=False)
        self.verifier_nodes.remove(node)
        self.verifier_nodes.append(self.cluster.add_node(**self.verifier_args))


# ---------------------------------------------------------------- after the load
async def held_state(engine) -> dict:
    """What the pipeline still holds; all zero when every request's state is freed."""
    pipe = engine.pipelines[0]
    v = await asyncio.wait_for(pipe.verifier.kv_usage.remote(), 10)
    held = {"blocks": v["total"] - v["free"], "ring": v["ring"],
            "state": v["streams"] + v["joins"] + v["reserved_blocks"] + v["to_free"]
            + len(engine.routes) + sum(p.active for p in engine.pipelines),
            "draft_blocks": 0}
    for d in pipe.drafters:
        try:
            info = await asyncio.wait_for(d.info.remote(), 10)
        except Exception:            # a drafter that is not back holds no blocks, but say so
            held["drafters_unreachable"] = held.get("drafters_unreachable", 0) + 1
            continue
        held["state"] += info["streams"]
        if info["kv_total"] is not None:
            held["draft_blocks"] += info["kv_total"] - info["kv_free"]
    return held


def actor_states(engine) -> dict:
    """Ray's view of the pipeline's actors: state, restarts (diagnostics for the report)."""
    from ray._private import state

    pipe, out = engine.pipelines[0], {}
    for name, actor in [("verifier", pipe.verifier), *((f"drafter{i}", d) for i, d in enumerate(pipe.drafters))]:
        with contextlib.suppress(Exception):
            a = state.actors(actor_id=actor._actor_id.hex())
            out[name] = {"state": a.get("State"), "restarts": a.get("NumRestarts")}
    return out


async def wait_until(check, timeout_s: float, every_s: float = 0.5):
    """Poll the coroutine function `check` until it returns a truthy value; None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            value = await check()
            if value:
                return value
        await asyncio.sleep(every_s)
    return None


async def process_rss(engine) -> dict:
    """Resident MB of the driver, the verifier and the drafter (with their incarnation ids)."""
    from cluster.actors import rss_bytes

    gc.collect()
    pipe = engine.pipelines[0]
    out = {"driver": (rss_bytes() / MB, None)}
    for name, call in (("verifier", pipe.verifier.kv_usage), ("drafter", pipe.drafters[0].info)):
        try:
            info = await asyncio.wait_for(call.remote(), 10)
            out[name] = (info["rss_bytes"] / MB, info["incarnation"])
        except Exception:        # not back: reported by the recovery check, not measurable here
            pass
    return out


# ---------------------------------------------------------------- the report
def print_report(report: SoakReport, problems: list[str]) -> None:
    rows = [("sent", report.sent), ("exact (greedy)", report.exact), ("complete (sampled)", report.complete_sampled),
            ("clear errors", report.clear_errors), ("  of which retryable", report.retryable_errors),
            ("lost", report.lost), ("hung", report.hung), ("leaked KV blocks", report.leaked_blocks),
            ("leaked ring slots", report.leaked_ring_slots), ("leaked draft KV blocks", report.leaked_draft_blocks),
            ("leaked streams / routes", report.leaked_state), ("exact after recovery", report.after_exact),
            ("recovered in (s)", "never" if report.recovered_s is None else f"{report.recovered_s:.1f}"),
            ("speculation (last verifier)", ", ".join(f"{k} {v}" for k, v in report.speculation.items())),
            ("faults", ", ".join(f"{k} {v}" for k, v in sorted(report.faults.items())) or "none"),
            ("verifier (/health)", report.verifier_health or "-"),
            ("tokens", report.tokens), ("wall (s)", f"{report.wall_s:.0f}")]
    rows += [(f"RSS {p} (MB)", f"{m['before']:.0f} -> {m['after']:.0f} ({m['delta']:+.0f}"
              f"{', restarted' if m['restarted'] else ''})") for p, m in report.rss_mb.items()]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for phase, counts in report.outcomes.items():
        print(f"  {phase}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for message, n in sorted(report.errors.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  error x{n}: {message}")
    for example in report.lost_examples:
        print(f"  lost: {example}")
    print("PASS" if not problems else "FAIL: " + "; ".join(problems))
