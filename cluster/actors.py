"""The drafter and verifier as Ray actors (DESIGN.md §3, §7).

`VerifierActor` (cluster/verifier_actor.py) is an asyncio actor holding the
target, the ring and the output streams. `DrafterActor` (here) runs its own
thread; one `exchange` call per iteration delivers the trees it drafted (their
ObjectRefs; the tensors were `ray.put` by the drafter) and brings back the
signals queued for it. Then it drafts, in **one** batched draft pass, the next
tree of every sequence whose ring has room, on the prefix it *assumes*: the
trees in flight fully accepted plus its own guess of each bonus token
(DESIGN §3 step 2). A signal that contradicts the assumption bumps the epoch,
drops the trees in flight and rolls the draft KV back (drafter/streams.py).
When every ring is full, `exchange` long-polls: the drafter's backpressure.
Each call also says whether anything is left to draft (`idle`): only an idle
drafter's cores may run the verifier's forwards (cluster/verifier_actor.py).

A drafter may die or be restarted by Ray (`max_restarts`) at any time: the
verifier never waits for it past a short patience, and a restarted drafter
reattaches under a new incarnation id and is resynchronised. So may the
verifier: the drafter keeps calling it (with a growing pause) while it is
down, drops its streams, and the restarted verifier's "reset" confirms that.
A frame the drafter cannot decode (malformed, another wire version) and a put
the verifier refused are logged and counted; the drafter drops the streams
concerned and asks to be resynced. Several drafters may feed one verifier;
each sequence is fed by one of them.

`remote_classes()` gives the `ray.remote` versions with their fixed options.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid

import ray

from cluster.backends import (DraftSide, PipelineSettings, gpu_ids, in_lockstep, next_tree_shape, rss_bytes,
                              set_threads)
from drafter.streams import DraftStream
from cluster.verifier_actor import VerifierActor
from speculation.wire import Signal, TreeHeader, WireError, decode_signals, encode_tree, pack_header
from models.sampling import SamplingParams

log = logging.getLogger("specflash.cluster")

__all__ = ["DrafterActor", "VerifierActor", "PipelineSettings", "remote_classes"]


class DrafterActor:
    def __init__(self, index: int, verifier, draft_dir: str | None, target_dir: str,
                 settings: dict) -> None:
        """`verifier`: its VerifierActor, as a handle or as the (name, namespace) it was
        created under (what `build_pipeline_engine` passes)."""
        self.settings = PipelineSettings(**settings)
        set_threads(self.settings.num_cpus)
        if isinstance(verifier, (tuple, list)):     # (name, namespace) of a named VerifierActor
            verifier = ray.get_actor(verifier[0], namespace=verifier[1])
        self.index, self.verifier = index, verifier
        self._node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self._gpus = gpu_ids(self.settings.device)      # None on a CPU
        # the verifier's node, CPUs and GPUs, learnt once attached (lockstep while alone / on its GPU)
        self._verifier_node: str | None = None
        self._verifier_cpus = 0.0
        self._verifier_gpus: list[str] | None = None
        self.incarnation = uuid.uuid4().hex
        self.side = DraftSide(draft_dir, target_dir, self.settings)
        self.warm_up_s = self.side.warm_up(self.settings.spec_len)    # GPU: compile and capture now
        self.streams: dict[str, DraftStream] = {}
        self.counters = {"trees": 0, "nodes": 0, "rollbacks": 0, "wasted_nodes": 0, "draft_s": 0.0,
                         "frames_rejected": 0, "verifier_errors": 0, "resets": 0,
                         "exchanges": 0, "exchange_s_max": 0.0,   # calls to the verifier; the longest one
                         "work_s_max": 0.0}   # longest stretch between two exchanges (the verifier hears nothing)
        self._attached = threading.Event()
        self._stopped = threading.Event()
        self._error: str | None = None
        # with nothing to draft, one long-poll (woken early by any signal) keeps us seen as live
        # without a stream of empty calls competing with the verifier for the cores
        self._idle_wait_s = max(self.settings.poll_s, self.settings.drafter_timeout_s / 4)
        self._thread = threading.Thread(target=self._run, name="drafter-loop", daemon=True)
        self._thread.start()

    # -- public methods (called through Ray) ------------------------------------------
    def ready(self, timeout_s: float = 60.0) -> bool:
        """True once the drafter has attached to its verifier."""
        return self._attached.wait(timeout_s)

    def info(self) -> dict:
        cache = self.side.cache
        return {"index": self.index, "incarnation": self.incarnation, "streams": len(self.streams),
                "running": self._thread.is_alive(), "error": self._error, **self.counters,
                "node_id": ray.get_runtime_context().get_node_id(),
                "kv_free": None if cache is None else cache.num_free_blocks,
                "kv_total": None if cache is None else cache.num_blocks, "rss_bytes": rss_bytes(),
                "cuda_graphs": None if self.side.graphs is None else self.side.graphs.stats(),
                "warm_up_s": self.warm_up_s}

    def set_replay_corruption(self, corruption: float) -> None:
        """BENCHMARK ONLY: the corruption rate of the replay proposer (cluster/replay.py)."""
        self.side.proposer.corruption = corruption

    def set_replay(self, references: list[list[int]]) -> None:
        """BENCHMARK ONLY: the recorded target continuations the replay proposer replays."""
        self.side.proposer.references = [list(r) for r in references]

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    # -- the loop ----------------------------------------------------------------------
    def _run(self) -> None:
        puts, draft_s, levels, resync = [], 0.0, 0, []
        pause = 0.05
        while not self._stopped.is_set():
            more = any(s.ready(self._slots()) for s in self.streams.values())
            # with trees to deliver but none to draft next (every ring full: in lockstep, after
            # each tree), the call that files them also waits for the next signal: one call a
            # step instead of two, and the verifier has usually fetched the trees by its return
            busy = more
            called = time.perf_counter()
            try:
                reply = ray.get(self.verifier.exchange.remote(
                    self.index, self.incarnation, puts, 0.0 if busy else self._idle_wait_s,
                    draft_s, levels, resync, self._node, self.settings.num_cpus, self._gpus, not more))
            except ray.exceptions.RayActorError as e:
                # dead or restarting: what it held of ours is gone; keep calling until it is back
                self.counters["verifier_errors"] += 1
                self._verifier_node = None
                self._error = f"verifier unreachable: {str(e).strip().splitlines()[0] if str(e).strip() else e}"
                log.warning("drafter %d: %s; retrying in %.2f s", self.index, self._error, pause)
                puts, draft_s, levels, resync = [], 0.0, 0, resync + self._drop_streams(list(self.streams))
                time.sleep(pause)
                pause = min(2.0, 2 * pause)
                continue
            except Exception as e:
                if _refused_frame(e):   # the verifier rejected our puts: resync their streams
                    self.counters["frames_rejected"] += 1
                    self._error = f"verifier refused our frames: {e.cause}"
                    log.error("drafter %d: %s; resynchronising those streams", self.index, self._error)
                    mine = {unpack_stream(h) for h, _ in puts}
                    puts, draft_s, levels = [], 0.0, 0
                    resync = resync + self._drop_streams([s for s in self.streams if s in mine])
                    continue
                self._error = f"{type(e).__name__}: {e}"     # transient: retry after a pause
                time.sleep(0.1)
                continue
            self._attached.set()
            self.counters["exchanges"] += 1
            self.counters["exchange_s_max"] = max(self.counters["exchange_s_max"], time.perf_counter() - called)
            if self._verifier_node is None:
                self._learn_verifier()
            pause = 0.05
            puts, draft_s, levels, resync = [], 0.0, 0, []
            work_start = time.perf_counter()
            try:
                self._apply(decode_signals(reply))
                puts, draft_s, levels = self._draft()
                self.counters["work_s_max"] = max(self.counters["work_s_max"], time.perf_counter() - work_start)
            except Exception as e:      # a bug or a bad frame: drop our state, ask to be resynced
                if isinstance(e, WireError):
                    self.counters["frames_rejected"] += 1
                    log.error("drafter %d: rejected a signal frame: %s; resynchronising its streams",
                              self.index, e)
                else:
                    log.exception("drafter %d: step failed; resynchronising its streams", self.index)
                self._error = f"{type(e).__name__}: {e}"
                resync = self._drop_streams(list(self.streams))

    def _learn_verifier(self) -> None:
        """The verifier's node, CPUs and GPUs (from its health): "", 0 and None where it does
        not answer."""
        try:
            h = ray.get(self.verifier.health.remote(), timeout=10)
        except Exception:
            h = {}
        self._verifier_node, self._verifier_cpus = h.get("node_id") or "", float(h.get("cpus") or 0.0)
        self._verifier_gpus = h.get("gpus")

    def _lockstep(self) -> bool:
        """One tree in flight and nothing assumed past it (`backends.in_lockstep`, from our view:
        on our verifier's GPU, overlapped forwards of two processes are time-sliced, on an H200
        a verification cost 3-7x more beside our drafting, bench/results/gpu-20261130c/; as a
        lone stream's CPU drafter beside it, the verifier verifies on our cores too)."""
        return in_lockstep(self.settings, len(self.streams), self.settings.device == "cpu",
                           self._node, self.settings.num_cpus, self._gpus,
                           self._verifier_node or "", self._verifier_cpus, self._verifier_gpus)

    def _slots(self) -> int:
        return 1 if self._lockstep() else self.settings.ring_slots

    def _drop_streams(self, streams: list[str]) -> list[str]:
        """Forget these streams and free their draft KV; returns them (to ask for a resync)."""
        for stream in streams:
            self.streams.pop(stream, None)
            self.side.release(stream)
        return streams

    def _apply(self, signals: list[Signal]) -> None:
        for sig in signals:
            s = self.streams.get(sig.stream)
            if sig.kind in ("join", "resync"):
                if s is not None:
                    self.counters["wasted_nodes"] += s.resync(sig.token_ids, sig.epoch)
                self.side.release(sig.stream)
                params = dict(sig.params or {})
                seed = params.get("seed") or 0
                s = DraftStream(sig.stream, sig.token_ids, sig.epoch, SamplingParams(**params), seed)
                s.budget = sig.budget
                self.streams[sig.stream] = s
            elif sig.kind == "reset":     # the verifier does not know us: nothing we hold is wanted
                self.counters["resets"] += 1
                self._drop_streams(list(self.streams))
            elif sig.kind == "leave":
                if self.streams.pop(sig.stream, None) is not None:
                    self.side.release(sig.stream)
            elif s is not None:          # "step"
                bumped, keep, wasted = s.on_step(sig)
                s.budget = sig.budget
                if keep is not None:
                    self.side.rollback(sig.stream, keep)
                if bumped:
                    self.counters["rollbacks"] += 1
                    self.counters["wasted_nodes"] += wasted
                if len(s.confirmed) != sig.prefix_len:   # lost a signal: start over from scratch
                    log.error("drafter %d: stream %s out of step; dropping it", self.index, sig.stream)
                    self.streams.pop(sig.stream)
                    self.side.release(sig.stream)

    def _draft(self) -> tuple[list, float, int]:
        """One batched draft pass over every stream with room in its ring."""
        ready = [s for s in self.streams.values() if s.ready(self._slots())]
        ready = ready[: self.settings.max_batch_size]
        if not ready:
            return [], 0.0, 0
        items = []
        for s in ready:
            k, width, bridge = next_tree_shape(self.settings, s.params, s.budget, s.bridge)
            items.append((s.stream, s.position(), s.params, s.generator, k, width, s.epoch, bridge))
        # lockstep (one tree in flight): the next tree waits for this one's signal, so no
        # outcome is assumed and no bonus level drafted; the verifier never bridges
        assume = not self._lockstep()
        drafted, seconds = self.side.propose(items, assume)
        self.counters["draft_s"] += seconds
        puts = []
        for s, item, d in zip(ready, items, drafted):
            bridged, s.bridge = item[7] > 0, False
            t = d.tree.num_nodes
            if t == 0 or (bridged and d.bridge_tokens is None):
                s.budget = (0, s.budget[1])      # nothing to propose (no n-gram match): wait for a signal
                continue
            if bridged:
                s.record_bridge(d.bridge_tokens)
            prefix = s.position()
            f = s.record(len(prefix), d.outcome, t, None if d.outcome is not None else d.cached)
            anchor = len(s.confirmed)
            probs = d.tree.draft_probs
            header = TreeHeader(s.stream, s.epoch, f.tree_id, len(prefix), anchor, prefix[anchor:], t,
                                0 if probs is None else int(probs.shape[-1]), d.outcome)
            ref = ray.put(encode_tree(header, d.tree.token_ids, d.tree.parent_ids, d.tree.depths, probs))
            puts.append((pack_header(header), [ref]))
            self.counters["trees"] += 1
            self.counters["nodes"] += t
        levels = max(item[4] + int(assume) + item[7] for item in items)
        return puts, seconds, levels


def _refused_frame(e: Exception) -> bool:
    return isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.as_instanceof_cause(), WireError)


def unpack_stream(header_bytes: bytes) -> str | None:
    """The stream a packed tree header of ours names (None if it does not decode)."""
    from speculation.wire import unpack_header

    try:
        return unpack_header(header_bytes).stream
    except WireError:
        return None


def remote_classes(drafter_max_restarts: int = 10, verifier_max_restarts: int = 10):
    """(`ray.remote(DrafterActor)`, `ray.remote(VerifierActor)`) with their fixed options.

    Both restart on failure (-1 = without limit) and their in-flight calls are
    not retried: a restarted drafter is resynchronised by the verifier; a
    restarted verifier comes back empty, so the requests it was serving fail
    with a retryable error (cluster/pipeline.py) and new ones are served.
    """
    drafter = ray.remote(max_restarts=drafter_max_restarts, max_task_retries=0,
                         max_concurrency=4)(DrafterActor)
    verifier = ray.remote(max_restarts=verifier_max_restarts, max_task_retries=0,
                          max_concurrency=1000)(VerifierActor)
    return drafter, verifier
