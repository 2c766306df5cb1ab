"""Which drafter feeds which stream, and what each drafter is told (DESIGN.md §3).

A drafter that attaches with a new incarnation id (new, or restarted by Ray) is told to drop
whatever it held ("reset"), then resynchronised from the committed prefixes of the streams it
feeds, adopting streams whose drafter is gone; streams of a dead drafter move to a live one.
Part of the scheduler (verifier/scheduler.py), kept apart so that each reads on its own.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING

from speculation.transport import Exchange
from speculation.wire import Signal
from verifier.ring import RingEntry
from verifier.stream import VerifyStream

if TYPE_CHECKING:
    from speculation.step import StepItem
    from verifier.scheduler import Scheduler

log = logging.getLogger("specflash.verifier")


class Membership:
    def __init__(self, scheduler: Scheduler) -> None:
        self.sch = scheduler
        self.registry = scheduler.registry

    # -- exchanges -----------------------------------------------------------------------
    def receive(self, call: Exchange) -> None:
        """File a drafter's trees in the ring, attach it if it is new, resync what it lost."""
        sch = self.sch
        if self.registry.heard(call):
            self._attach(call.drafter, call.incarnation)
        if call.draft_levels:
            if not self.lockstep(call.drafter):   # in lockstep a step prices the wait for its trees
                sch.costs.overlap.observe_draft(call.draft_levels, call.draft_s)
            self.registry.observe_tree_time(call.drafter, call.draft_s)
        for put in call.puts:
            self._put(call.drafter, put.header, put.payload)
        for stream in call.resync:            # the drafter lost its state for these streams
            s = sch.streams.get(stream)
            if s is not None and s.admitted and s.drafter == call.drafter:
                self.resync(s)
        if call.drafter not in self.registry.in_process:   # those the loop pumps itself, then collects
            sch.on_work()

    def _put(self, drafter: int, header, payload) -> None:
        sch = self.sch
        s = sch.streams.get(header.stream)
        entry = RingEntry(header, payload)
        if s is None or s.drafter != drafter:
            sch.drop([entry])
            return
        ok, dropped = sch.ring.put(entry)
        sch.drop([e for e in dropped if e is not entry])
        if ok:
            sch.fetch(entry)
        elif entry.header.epoch >= sch.ring.stream(s.request_id).epoch:
            sch.stats.observe_dropped(1, header.num_nodes)
            self.resync(s)        # the drafter's count of slots disagrees with the ring

    # -- assignment ----------------------------------------------------------------------
    def _attach(self, drafter: int, incarnation: str) -> None:
        """A new or restarted drafter (or we restarted): it drops whatever it held ("reset"),
        then the streams it fed and the orphans are resynchronised (on it, or wherever
        `_choose` puts them)."""
        if any(s.drafter == drafter for s in self.sch.streams.values()):
            log.warning("drafter %d restarted (incarnation %s)", drafter, incarnation[:8])
        self.registry.send(drafter, Signal("reset", ""))
        for s in list(self.sch.streams.values()):
            if s.admitted and self._wants_drafter(s) and \
                    (s.drafter == drafter or s.drafter is None or not self.registry.live(s.drafter)):
                self.assign(s, self._choose(s) if self.registry.local is not None else drafter)

    def _wants_drafter(self, s: VerifyStream) -> bool:
        """Speculating streams get a drafter; a feature-conditioned one only once the prompt's
        features exist (after its prefill)."""
        return s.mode != "off" and (not self.sch.features or s.prefilled)

    def _choose(self, s: VerifyStream, company: int = 0) -> int | None:
        """The drafter for a stream: the least loaded live one; or the stand-in in our own
        process (`registry.local`, `lockstep_in_verifier`) where the stream would be alone in
        lockstep with a drafter on our cores or GPU: the sides take turns either way, and in our
        process a turn costs no call. None while no drafter of another process is live.
        `company`: streams joining beside it that will want a drafter too."""
        live = self.registry.live_ids()
        if not live:
            return None
        local = self.registry.local
        alone = not company and not any(t.drafter is not None for t in self.sch.streams.values()
                                        if t is not s and t.admitted)
        if local is not None and alone and self.sch.settings.lockstep_in_verifier and \
                any(self.registry.lockstep(d, 1) for d in live):
            return local
        return self._least_loaded(live)

    def assign_new(self, s: VerifyStream) -> None:
        """A stream just admitted: a drafter, if it speculates (`_choose`); streams the stand-in
        drafted for alone move to the drafters of other processes once it has company."""
        drafter = self._choose(s) if self._wants_drafter(s) else None
        if drafter is None:
            return
        self.assign(s, drafter)
        local = self.registry.local
        if drafter != local:
            for t in list(self.sch.streams.values()):
                if t.drafter == local and local is not None:
                    self.assign(t, self._least_loaded(self.registry.live_ids()))

    def _least_loaded(self, live: list[int]) -> int:
        load = {i: sum(t.drafter == i for t in self.sch.streams.values()) for i in live}
        return min(live, key=load.get)

    def assign(self, s: VerifyStream, drafter: int | None) -> None:
        if s.drafter is not None and s.drafter != drafter:
            self.registry.send(s.drafter, Signal("leave", s.request_id))
        s.drafter = drafter
        if drafter is not None:
            self.resync(s)

    def resync(self, s: VerifyStream) -> None:
        """The drafter restarts the stream from its whole committed prefix."""
        s.first_tree = True
        ring = self.sch.ring.stream(s.request_id)
        self.sch.drop(ring.bump(ring.epoch + 1))
        params = asdict(s.params)
        # a coupled (seeded) request: the drafter proposes under the target's own noise, keyed by the
        # seed its params carry, and ships no q (the walk reads none); otherwise its own stream of
        # randomness, `draft_seed`, independent of the verifier's draws, and the q it drew from
        if not s.params.coupled:
            params["draft_seed"] = s.seed + 1
        s.unsent, s.sent_budget = [], s.budget
        features = None
        if self.sch.features:
            s.features_sent = 0
            features = s.unsent_features()
        self.registry.send(s.drafter, Signal("resync", s.request_id, ring.epoch, -1, len(s.committed),
                                             list(s.committed), s.budget, params, s.proposer, features,
                                             self.lockstep(s.drafter)))

    def rebalance(self) -> None:
        """Streams of a dead drafter move to a live one, if any (else they decode alone); the
        stand-in's streams stop speculating with the drafters of other processes (it stands in
        for their turns only)."""
        live = self.registry.live_ids()
        local = self.registry.local
        for s in list(self.sch.streams.values()):
            if not (s.admitted and self._wants_drafter(s)):
                continue
            if s.drafter is not None and s.drafter == local and not live:
                self.assign(s, None)
            elif live and not self.registry.live(s.drafter):
                self.assign(s, self._choose(s))

    # -- what the drafters are doing -----------------------------------------------------
    def lockstep(self, drafter: int | None, streams: int | None = None) -> bool:
        """Whether `drafter` runs in lockstep: by the rule (`registry.lockstep`), or for a lone
        stream where the rule would overlap, as measured (`verifier.regime`). `streams`: the
        streams it would feed (default: those it feeds)."""
        streams = self._fed_by(drafter) if streams is None else streams
        if streams == 1 and self.measured(drafter):
            return self.sch.regime.lockstep()
        return self.registry.lockstep(drafter, streams)

    def _fed_by(self, drafter: int | None) -> int:
        """Streams `drafter` feeds."""
        return sum(1 for t in self.sch.streams.values() if t.drafter == drafter)

    def overlapped_alone(self, drafter: int | None) -> bool:
        """Whether `drafter` feeds exactly one stream and runs overlapped with it (a lone stream's
        restart trees: `speculation.policy.restart_tree_depth`)."""
        return drafter is not None and self._fed_by(drafter) == 1 and not self.lockstep(drafter)

    def measured(self, drafter: int | None) -> bool:
        """Whether a lone stream's way of running with `drafter` is measured, not ruled: a drafter
        of another process that the rule would overlap with one stream."""
        return (self.sch.regime.enabled and self.sch.settings.ring_slots > 1 and drafter is not None
                and drafter not in self.registry.in_process and drafter in self.registry.drafters
                and not self.registry.lockstep(drafter, 1))

    def lone_stream(self) -> str | None:
        """The stream whose regime is measured now: the only admitted stream with a drafter, when
        that drafter's way is measured (`measured`); else None."""
        fed = [s for s in self.sch.streams.values() if s.admitted and s.drafter is not None]
        if len(fed) == 1 and self._fed_by(fed[0].drafter) == 1 and self.measured(fed[0].drafter):
            return fed[0].request_id
        return None

    def plan_bridges(self, joining: list[VerifyStream] = ()) -> bool:
        """Whether the planner counts bridge steps: not while every drafter runs in lockstep.
        `joining`: streams being admitted, planned before they have a drafter, counted with the
        drafter `_choose` will give them (a lone stream's first tree, planned as overlapped
        while the stand-in would draft it in lockstep, was priced by a model fitted from other
        steps: 44 ms for a row against 22 ms measured, and it decoded alone)."""
        if self.sch.settings.ring_slots == 1:
            return False
        fed = Counter(s.drafter for s in self.sch.streams.values() if s.drafter is not None)
        wanting = [s for s in joining if s.drafter is None and self._wants_drafter(s)]
        for s in wanting:
            drafter = self._choose(s, company=len(wanting) - 1)
            if drafter is not None:
                fed[drafter] += 1
        return not fed or not all(self.lockstep(i, n) for i, n in fed.items())

    def drafters_idle(self) -> bool:
        """No stream has work for a drafter of another process: every budget 0, the drafter told
        so, no bridge. A drafter in our own process (the stand-in, `registry.in_process`) takes
        turns with the target and never runs beside a forward, so its streams leave the lent
        cores idle (a lone stream's prefill ran on one thread for want of this: 35 ms more)."""
        in_process = self.registry.in_process
        return not any(s.budget[0] or s.sent_budget[0] or s.bridge for s in self.sch.streams.values()
                       if s.admitted and s.drafter is not None and s.drafter not in in_process)

    def drafters_blocked(self, batch: list[StepItem]) -> bool:
        """Every stream a drafter serves either has its tree in `batch` and that drafter in
        lockstep (one tree in flight), or no work for it: the drafters wait for this step's
        signals."""
        verifying = {it.seq.request_id for it in batch if it.header is not None}
        drafters = set()                  # of the streams verified now: each drafter's way, once
        for s in self.sch.streams.values():
            if not s.admitted or s.drafter is None:
                continue
            if s.request_id in verifying:
                drafters.add(s.drafter)
            elif s.budget[0] or s.sent_budget[0] or s.bridge:
                return False
        return all(self.lockstep(d) for d in drafters)

    def patience(self, s: VerifyStream) -> float:
        """How long a sequence may wait for its drafter's tree: a few of its tree times, or
        `max_tree_wait_s` for the first tree after a (re)sync (the drafter prefills first)."""
        if s.drafter in self.registry.in_process:
            return 0.0                    # drafted before the collect, or not coming
        if s.first_tree:
            return self.sch.settings.max_tree_wait_s
        tree_s = self.registry.drafters[s.drafter].tree_s
        return min(self.sch.settings.max_tree_wait_s, 3.0 * tree_s + 0.02)
