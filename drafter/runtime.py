"""The drafter's half of the asynchronous protocol (DESIGN.md §3), free of Ray.

A `Drafter` keeps a `DraftStream` per sequence it feeds and a `DraftSide` that drafts. Its
loop, one iteration per `run_once`, makes one exchange with its verifier over a
`speculation.transport.VerifierLink`: it delivers the trees it drafted and takes back the
signals queued for it. Then it drafts, in **one** batched pass, the next tree of every
sequence whose ring has room, on the prefix it *assumes*: the trees in flight fully accepted
plus its own guess of each bonus token (DESIGN §3 step 2). A signal that contradicts the
assumption bumps the epoch, drops the trees in flight and rolls the draft KV back
(drafter/streams.py). With every ring full the exchange long-polls: backpressure. Each call
says whether anything is left to draft (`idle`): only an idle drafter's cores may run the
verifier's forwards (verifier/scheduler.py).

The verifier may die or restart at any time: the drafter keeps calling it, with a growing
pause, drops its streams, and the restarted verifier's "reset" confirms that. A frame it
cannot decode and a put the verifier refused are counted; the drafter drops the streams
concerned and asks for them to be resynced. `cluster.actors.DrafterActor` runs this loop on
a thread of a Ray actor; the in-process engine calls `apply` and `draft` itself
(verifier/inprocess.py).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import torch

from drafter.draft_side import DraftItem, DraftSide
from drafter.streams import DraftStream
from models.sampling import SamplingParams
from speculation.policy import in_lockstep, next_tree_shape
from speculation.settings import EngineSettings
from speculation.stats import SpecStats
from speculation.step_log import DrafterExchange, StepLog
from speculation.transport import (Exchange, ExchangeLost, FramesRefused, TreePut, VerifierInfo,
                                   VerifierLink, VerifierUnavailable)
from speculation.wire import Signal, TreeHeader, WireError

log = logging.getLogger("specflash.drafter")


@dataclass
class DraftPass:
    """What one draft pass produced, for the next exchange."""

    puts: list[TreePut] = field(default_factory=list)
    seconds: float = 0.0               # the pass's wall time
    levels: int = 0                    # draft forwards (levels) it ran
    more: bool = False                 # something is still left to draft (not idle)


def _keep_tree(header: TreeHeader, tree) -> TreePut:
    """In process a tree travels as itself."""
    return TreePut(header, tree)


class Drafter:
    def __init__(self, index: int, side: DraftSide, settings: EngineSettings, node: str = "",
                 gpus: list[str] | None = None) -> None:
        self.index, self.side, self.settings = index, side, settings
        self.node, self.gpus = node, gpus           # where we run (lockstep decisions)
        self.verifier = VerifierInfo()               # where our verifier runs, once learnt
        self.incarnation = uuid.uuid4().hex
        self.streams: dict[str, DraftStream] = {}
        self.stats = SpecStats()
        self.error: str | None = None
        self.attached = threading.Event()           # the first exchange went through
        # with nothing to draft, one long-poll (woken early by any signal) keeps us seen as live
        # without a stream of empty calls competing with the verifier for the cores
        self.idle_wait_s = max(settings.poll_s, settings.drafter_timeout_s / 4)
        self._next = DraftPass()                    # drafted, not yet delivered
        self._resync: list[str] = []                # streams to ask the verifier to resync
        self._pause = 0.05                          # between calls to an unreachable verifier
        self._learnt = False
        self.told_lockstep: bool | None = None      # the verifier's last word on lockstep (Signal.lockstep)
        self.step_log = StepLog()                   # SPECFLASH_STEP_LOG: a line per exchange

    # -- the loop ------------------------------------------------------------------------
    def run(self, link: VerifierLink, stopped: threading.Event) -> None:
        while not stopped.is_set():
            self.run_once(link)

    def run_once(self, link: VerifierLink) -> None:
        """One exchange, then the signals it brought applied and the next trees drafted."""
        more = any(s.ready(self.slots()) for s in self.streams.values())
        # with trees to deliver but none to draft next (every ring full: in lockstep, after each
        # tree), the call that files them also waits for the next signal: one call a step
        # instead of two, and the verifier has usually fetched the trees by its return
        call = self.exchange_call(0.0 if more else self.idle_wait_s, not more)
        called = time.perf_counter()
        try:
            signals = link.exchange(call)
        except VerifierUnavailable as e:
            # dead or restarting: what it held of ours is gone; keep calling until it is back
            self.stats.observe_verifier_error()
            self._learnt = False
            self.error = f"verifier unreachable: {e}"
            log.warning("drafter %d: %s; retrying in %.2f s", self.index, self.error, self._pause)
            self._resync = call.resync + self.drop_streams(list(self.streams))
            time.sleep(self._pause)
            self._pause = min(2.0, 2 * self._pause)
            return
        except (WireError, ExchangeLost) as e:    # the call may have gone through, its signals are lost
            if isinstance(e, WireError):
                self.stats.observe_rejected_frame()
                self.attached.set()
            self.error = f"{type(e).__name__}: {e}"
            log.error("drafter %d: signals lost (%s); resynchronising its streams", self.index, self.error)
            self._resync = call.resync + self.drop_streams(list(self.streams))
            return
        except FramesRefused as e:            # the verifier rejected our puts: resync their streams
            self.stats.observe_rejected_frame()
            self.error = f"verifier refused our frames: {e}"
            log.error("drafter %d: %s; resynchronising those streams", self.index, self.error)
            mine = {p.header.stream for p in call.puts}
            self._resync = call.resync + self.drop_streams([s for s in self.streams if s in mine])
            return
        except Exception as e:                 # transient: retry after a pause, puts and all
            self.error = f"{type(e).__name__}: {e}"
            self._next, self._resync = DraftPass(call.puts, call.draft_s, call.draft_levels), call.resync
            time.sleep(0.1)
            return
        self.attached.set()
        exchange_s = time.perf_counter() - called
        self.stats.observe_exchange(exchange_s)
        if not self._learnt:
            self.verifier, self._learnt = link.verifier_info(), True
        self._pause = 0.05
        work_start = time.perf_counter()
        try:
            self.apply(signals)
            self._next = self.draft(link.put_tree)
            self.stats.observe_work(time.perf_counter() - work_start)
            if self.step_log.on:
                self._log_exchange(call, exchange_s, signals)
        except Exception as e:      # a bug: drop our state, ask to be resynced
            log.exception("drafter %d: step failed; resynchronising its streams", self.index)
            self.error = f"{type(e).__name__}: {e}"
            self._next, self._resync = DraftPass(), self.drop_streams(list(self.streams))

    def _log_exchange(self, call: Exchange, exchange_s: float, signals: list[Signal]) -> None:
        done = self._next
        kinds = dict(Counter(sig.kind for sig in signals))
        self.step_log.write(DrafterExchange(time.time(), self.index, exchange_s, call.wait_s, len(call.puts), kinds,
                                            sum(1 for sig in signals if sig.kind == "step" and sig.restart),
                                            done.seconds, done.levels, len(done.puts)))

    def resync_requests(self) -> list[str]:
        """The streams to ask the verifier to resync (asked once)."""
        resync, self._resync = self._resync, []
        return resync

    def exchange_call(self, wait_s: float, idle: bool) -> Exchange:
        """The next exchange: what was drafted since the last one, and the streams to resync."""
        done, self._next = self._next, DraftPass()
        return Exchange(self.index, self.incarnation, done.puts, wait_s, done.seconds, done.levels,
                        self.resync_requests(),
                        self.node, self.settings.num_cpus, self.gpus, idle)

    # -- state --------------------------------------------------------------------------
    def lockstep(self) -> bool:
        """One tree in flight and nothing assumed past it (`speculation.policy.in_lockstep`, from
        our view: on our verifier's GPU, overlapped forwards of two processes are time-sliced;
        as a lone stream's CPU drafter beside it, the verifier verifies on our cores too). With
        one stream, the verifier's last word instead where it gave one: it measures which way
        commits more (`verifier.regime`)."""
        if self.told_lockstep is not None and len(self.streams) == 1:
            return self.told_lockstep
        v = self.verifier
        return in_lockstep(self.settings, len(self.streams), self.settings.device == "cpu",
                           self.node, self.settings.num_cpus, self.gpus, v.node, v.cpus, v.gpus)

    def slots(self) -> int:
        return 1 if self.lockstep() else self.settings.ring_slots

    def drop_streams(self, streams: list[str]) -> list[str]:
        """Forget these streams and free their draft KV; returns them (to ask for a resync)."""
        for stream in streams:
            self.streams.pop(stream, None)
            self.side.release(stream)
        return streams

    def apply(self, signals: list[Signal]) -> None:
        for sig in signals:
            if sig.lockstep is not None:
                self.told_lockstep = sig.lockstep
            s = self.streams.get(sig.stream)
            if sig.kind in ("join", "resync"):
                if s is not None:
                    self.stats.observe_wasted(s.resync(sig.token_ids, sig.epoch))
                self.side.release(sig.stream)
                params = dict(sig.params or {})
                seed = params.pop("draft_seed", None)             # an unseeded request's own randomness
                seed = (params.get("seed") or 0) if seed is None else seed
                s = DraftStream(sig.stream, sig.token_ids, sig.epoch, SamplingParams(**params), seed,
                                sig.proposer or "model")
                s.budget = sig.budget
                self.streams[sig.stream] = s
            elif sig.kind == "reset":     # the verifier does not know us: nothing we hold is wanted
                self.stats.observe_reset()
                self.told_lockstep = None
                self.drop_streams(list(self.streams))
            elif sig.kind == "leave":
                if self.streams.pop(sig.stream, None) is not None:
                    self.side.release(sig.stream, sig.token_ids or None)
            elif s is not None:          # "step"
                bumped, keep, wasted = s.on_step(sig)
                s.budget = sig.budget
                if keep is not None:
                    self.side.rollback(sig.stream, keep)
                if bumped:
                    self.stats.observe_rollback()
                    self.stats.observe_wasted(wasted)
                if len(s.confirmed) != sig.prefix_len:   # lost a signal: start over from scratch
                    log.error("drafter %d: stream %s out of step; dropping it", self.index, sig.stream)
                    self.streams.pop(sig.stream)
                    self.side.release(sig.stream)
                    continue
            if sig.features is not None and sig.stream in self.streams:
                start, features = sig.features
                self.side.observe_features(sig.stream, start, torch.as_tensor(features))

    def draft(self, put_tree=_keep_tree) -> DraftPass:
        """One batched draft pass over every stream with room in its ring. `put_tree(header,
        tree) -> TreePut`: how a tree travels (the link's)."""
        slots = self.slots()
        ready = [s for s in self.streams.values() if s.ready(slots)][: self.settings.max_batch_size]
        if not ready:
            return DraftPass()
        items = []
        for s in ready:
            k, width, bridge = next_tree_shape(self.settings, s.params, s.budget, s.bridge, s.proposer, s.restart)
            items.append(DraftItem(s.stream, s.position(), s.params, s.generator, k, width, s.epoch, bridge,
                                   s.proposer))
        # lockstep (one tree in flight): the next tree waits for this one's signal, so no
        # outcome is assumed and no bonus level drafted; the verifier never bridges
        assume = not self.lockstep()
        drafted, seconds = self.side.propose(items, assume)
        self.stats.observe_time("draft", seconds)
        puts = []
        for s, item, d in zip(ready, items, drafted):
            bridged, s.bridge = item.bridge > 0, False
            t = d.tree.num_nodes
            if t == 0 or (bridged and d.bridge_tokens is None):
                s.budget = (0, s.budget[1])      # nothing to propose (no n-gram match): wait for a signal
                continue
            if bridged:
                s.record_bridge(d.bridge_tokens)
            prefix = s.position()
            f = s.record(len(prefix), d.outcome, t, None if d.outcome is not None else d.cached)
            anchor = len(s.confirmed)
            probs, columns = d.tree.draft_probs, d.tree.draft_columns
            header = TreeHeader(s.stream, s.epoch, f.tree_id, len(prefix), anchor, prefix[anchor:], t,
                                0 if probs is None else self.side.vocab_size, d.outcome,
                                0 if columns is None else int(columns.shape[0]))
            puts.append(put_tree(header, d.tree))
            self.stats.observe_drafted(t)
        levels = max(item.depth + int(assume) + item.bridge for item in items)
        more = any(s.ready(self.slots()) for s in self.streams.values())
        return DraftPass(puts, seconds, levels, more)
