"""Drafters in the verifier's own process: the in-process transport (DESIGN.md §1).

The scheduler meets these drafters exactly as it meets remote ones: through `Exchange`
calls to `Scheduler.receive` and the signals it queues for them. Only the carrying differs:
instead of a drafter looping on its own thread, the engine's loop pumps each drafter once
before it collects a batch (`EngineLoop.pump`): the signals of the last step go in, the
drafter drafts its next trees on the model thread, and the trees come back as themselves
(no encoding). With one core set shared by both models this is the classic synchronous
draft-then-verify step; a drafter here always runs in lockstep (`ring_slots` 1).

Where the verifier may borrow an idle remote drafter's cores (the stand-in drafter of the Ray
verifier, `lockstep_in_verifier`), a lockstep turn (the draft passes and the forward that
verifies them) runs on whichever of its own threads and the borrowed ones has measured cheaper
per row verified over windows of steps (`verifier.choice.WindowedChoice`: step end to step
end, so that what a count costs beside the turn counts too). Rows, not committed tokens: both
counts verify the same trees, and a window's tokens vary with the acceptance by ~15% where its
rows do not, so a count clearly worse shows within a few steps: its window is cut there, after
one measured step at 1.4 times the other's cost or three at 1.2, and it is not tried again
before a recheck (a one-thread turn of the embedded pair cost 1.6 times a two-thread one on an
Intel Xeon, 56 ms against 35: its trials took 27 of a 160-token request's 60 steps before any
cut, 4 with the cut after three, 2 with the cut after one). When the counts on offer change (an
idle drafter's cores come or go) the measurement restarts on the first, the most threads: a
window begun without them says nothing of the choice now. One count for the whole turn:
switching torch's thread count between the passes and the forward cost more than either choice
saved (a micro-pair level took 1.2 ms on one thread between forwards on two, 1.9 ms when the
forward's count was chosen apart, 1.0 ms with everything on one). On two shared cores a team
of two threads waits for the core that Ray's own threads and the consumer's process keep waking
on, which on the micro pair costs more than the second thread saves (bench/README.md, "micro
pair"; a turn's own seconds hid it: two threads measured cheaper per turn, one thread ran more
steps a second), while the embedded pair's turns gain from it. The output is the verifier's
either way.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from speculation.transport import Exchange
from speculation.wire import Signal
from verifier.choice import WindowedChoice

IDLE_GAP_S = 0.002    # a step begun this long after the last one ended followed an idle loop: not measured
CUT = 1.2             # a count's window ends once it costs this times the other's per row (WindowedChoice.cut)
CUT_FIRST = 1.4       # ... or after its first measured step at this (WindowedChoice.cut_first)


class Drafting(Protocol):
    """A drafter's runtime (drafter.runtime.Drafter): what the pump needs of it."""

    index: int
    incarnation: str
    node: str
    streams: dict                 # the streams it feeds

    def apply(self, signals: list[Signal]) -> None: ...

    def draft(self):              # -> drafter.runtime.DraftPass
        ...

    def resync_requests(self) -> list[str]: ...


class InProcessDrafters:
    def __init__(self, drafters: list[Drafting], num_cpus: float = 0.0) -> None:
        self.drafters = drafters
        self.num_cpus = num_cpus
        # a lockstep turn's threads: our own, or with the idle drafters' too (None: not chosen yet)
        self.threads = WindowedChoice(None, gap_s=IDLE_GAP_S, cut=CUT, cut_first=CUT_FIRST)
        self.candidates: tuple[int, ...] = ()   # the counts this round's turn could run on
        self.turn: int | None = None      # the threads this round's passes ran on (None: none chosen)

    def attach(self, scheduler) -> None:
        """Each drafter's first exchange: the scheduler registers it (and says "reset") as one of
        its own process."""
        for d in self.drafters:
            scheduler.registry.in_process.add(d.index)
            scheduler.receive(Exchange(d.index, d.incarnation, node=d.node, cpus=self.num_cpus, idle=True))

    def settle(self, scheduler) -> None:
        """Deliver the signals still queued (the last step's "leave"s free the draft KV), drafting
        nothing."""
        for d in self.drafters:
            d.apply(scheduler.signals_for(d.index))

    async def __call__(self, scheduler, run: Callable[..., Awaitable], threads: int | None = None) -> None:
        """One round: each drafter takes its signals, drafts (on the model thread) and files what
        it drafted, in one exchange. `threads`: what the verifier may use now, its idle
        drafters' cores included; the turn runs on that or on the verifier's own threads,
        whichever has measured cheaper (`WindowedChoice`, fed by `observe_step`)."""
        n = None if threads is None else self._pick((threads, scheduler.threads))
        self.turn = None
        for d in self.drafters:
            signals = scheduler.signals_for(d.index)
            if signals or d.streams:
                drafted = await run(self._draft, d, signals, n)
                if n is not None and drafted.levels:
                    self.turn = n
            else:                     # nothing to hear, nothing to draft: no hop to the model thread
                drafted = d.draft()
            scheduler.receive(Exchange(d.index, d.incarnation, drafted.puts, 0.0, drafted.seconds, drafted.levels,
                                       d.resync_requests(), d.node, self.num_cpus, None, not drafted.more))

    def _pick(self, candidates: tuple[int, ...]) -> int:
        offered = tuple(dict.fromkeys(candidates))
        if offered != self.candidates:      # the first turn, or the counts changed
            self.candidates = offered
            self.threads.current = offered[0]
            self.threads.restart(None)
        return self.threads.current

    def trying(self, threads: int) -> bool:
        """Whether this round's turn ran on `threads` as a trial: not the count measured cheapest
        (the first offered until one is measured)."""
        return self.turn is not None and threads == self.turn and \
            threads != self.threads.choice.best(self.candidates)

    def observe_step(self, threads: int, rows: int, began: float, ended: float) -> None:
        """The step whose forward verified this round's trees ran on `threads`, from `began` to
        `ended`, verifying `rows` (each tree's nodes and its root): measured, when its passes ran
        on that count too."""
        if self.turn is not None and threads == self.turn:
            self.threads.observe(rows, ended, self.candidates, began)
        else:
            self.threads.restart(ended)
        self.turn = None

    def report(self) -> dict[str, float]:
        """{threads: median ms per row verified} of each count measured."""
        return self.threads.choice.report()

    @staticmethod
    def _draft(drafter: Drafting, signals: list[Signal], threads: int | None):
        import torch

        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        drafter.apply(signals)
        return drafter.draft()
