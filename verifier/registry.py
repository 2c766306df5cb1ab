"""The drafters a verifier knows: who is live, where each runs, and the signals queued for each.

A drafter is known by its index and its incarnation (new on every restart). The registry
keeps, per drafter, when it was last heard from, its recent tree time, its node, CPUs and
GPUs, and whether it said it is idle; and an outbox of signals it takes with its next
exchange. Which streams a drafter feeds is the scheduler's (verifier/scheduler.py); the
decisions that depend only on the drafters are here: liveness, lockstep, the cores a plain
step may borrow.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from speculation.policy import in_lockstep, plain_step_threads
from speculation.settings import EngineSettings
from speculation.transport import Exchange
from speculation.wire import Signal


def gives_a_tree(sig: Signal) -> bool:
    """Whether a signal gives its drafter a tree to draft (a budget of depth > 0)."""
    return bool(sig.budget) and sig.budget[0] > 0


@dataclass
class DrafterInfo:
    incarnation: str
    last_seen: float                  # the registry's hearing clock (`DrafterRegistry.heard_at`)
    tree_s: float = 0.02              # recent seconds per tree it drafted (EMA)
    node: str = ""
    cpus: float = 0.0
    gpus: list[str] | None = None
    idle: bool = False                # nothing to draft by its own word, and no tree given since

    def as_dict(self) -> dict:
        return {"node": self.node, "cpus": self.cpus, "gpus": self.gpus, "idle": self.idle}


class DrafterRegistry:
    def __init__(self, settings: EngineSettings, node_id: str = "", gpu_ids: list[str] | None = None,
                 threads: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.node_id, self.gpu_ids, self.threads = settings, node_id, gpu_ids, threads
        self.clock = clock
        self.drafters: dict[int, DrafterInfo] = {}
        self.outbox: dict[int, list[Signal]] = defaultdict(list)
        self.on_mail: Callable[[int], None] | None = None   # wakes a drafter waiting in a long-poll
        # drafters in our own process (verifier/inprocess.py): alive while we are, always in
        # lockstep, no cores to lend; `local`, if set, is one that only stands in for a remote
        # drafter's lockstep turns (cluster/actors.py), left out of the remote drafters' lists
        self.in_process: set[int] = set()
        self.local: int | None = None
        # seconds our loop could not hear anyone (a forward run on the loop's own thread, which
        # holds exchanges until it ends): not counted against a drafter's silence
        self.deaf_s = 0.0

    def heard_at(self) -> float:
        """The hearing clock: `clock` stopped while we were deaf (`excuse`)."""
        return self.clock() - self.deaf_s

    def excuse(self, seconds: float) -> None:
        """We could not hear exchanges for `seconds` (our loop was running a forward)."""
        self.deaf_s += seconds

    def __contains__(self, drafter: int) -> bool:
        return drafter in self.drafters

    def heard(self, call: Exchange) -> bool:
        """Record a drafter's exchange. True when it is new or restarted (a new incarnation): the
        caller attaches it (`Scheduler._attach`)."""
        info = self.drafters.get(call.drafter)
        new = info is None or info.incarnation != call.incarnation
        if new:
            info = self.drafters[call.drafter] = DrafterInfo(call.incarnation, self.heard_at())
            self.outbox.pop(call.drafter, None)
        info.last_seen = self.heard_at()
        info.node, info.cpus = call.node, call.cpus
        info.gpus = None if call.gpus is None else [str(g) for g in call.gpus]
        # idle unless signals giving it a tree to draft wait for it here (this reply carries them)
        info.idle = (((not call.puts) if call.idle is None else bool(call.idle))
                     and not any(map(gives_a_tree, self.outbox.get(call.drafter, ()))))
        return new

    def observe_tree_time(self, drafter: int, seconds: float) -> None:
        info = self.drafters[drafter]
        info.tree_s = 0.7 * info.tree_s + 0.3 * seconds

    def live(self, drafter: int | None) -> bool:
        if drafter in self.in_process:
            return drafter in self.drafters           # in our process: alive while we are
        d = self.drafters.get(drafter) if drafter is not None else None
        return d is not None and self.heard_at() - d.last_seen < self.settings.drafter_timeout_s

    def live_ids(self) -> list[int]:
        """The live drafters (the `local` stand-in aside)."""
        return [i for i in self.drafters if i != self.local and self.live(i)]

    def send(self, drafter: int, sig: Signal) -> None:
        self.outbox[drafter].append(sig)
        if drafter in self.drafters and gives_a_tree(sig):
            self.drafters[drafter].idle = False     # a tree to draft: its cores are its own again
        if self.on_mail is not None:
            self.on_mail(drafter)

    def has_mail(self, drafter: int) -> bool:
        return bool(self.outbox.get(drafter))

    def take(self, drafter: int) -> list[Signal]:
        return self.outbox.pop(drafter, [])

    def lockstep(self, drafter: int | None, streams: int) -> bool:
        """Whether `drafter`, feeding `streams` streams, runs in lockstep (one tree in flight,
        nothing assumed; `speculation.policy.in_lockstep` from our view). The drafter decides
        the same from its side (drafter/runtime.py); a stream joining or leaving can leave the
        two views a step apart, which costs speed, never exactness."""
        if drafter in self.in_process:
            return True                               # drafts on our model thread: always turns
        d = self.drafters.get(drafter) if drafter is not None else None
        if d is None:
            return self.settings.ring_slots == 1
        return in_lockstep(self.settings, streams, self.settings.device == "cpu", d.node, d.cpus, d.gpus,
                           self.node_id, self.settings.num_cpus, self.gpu_ids)

    def lendable_threads(self, now: bool = True) -> int:
        """Threads a plain step would run on now: our own plus those of the live drafters that
        have nothing to draft (said so at their last exchange, and signalled nothing since: a
        drafter still finishing a tree would share its cores with the forward, which on two
        cores slows every one of its steps). `now=False`: once the drafters are idle, as they
        will be if every sequence decodes alone (what a plan is weighed against)."""
        live = [d.as_dict() for i, d in self.drafters.items()
                if i not in self.in_process and self.live(i) and (d.idle or not now)]
        return plain_step_threads(self.settings.plain_threads, self.threads, self.settings.device,
                                  self.node_id, live)

    def report(self) -> dict:
        """For `health`: which drafters are live, and why speculation is off when none is."""
        live = self.live_ids()
        reason = None
        if not live:
            reason = ("drafter unavailable: none has attached" if not self.drafters else
                      f"drafter unavailable: none heard from in {self.settings.drafter_timeout_s:g} s")
        return {"drafters_live": live, "speculation": bool(live), "speculation_reason": reason}
