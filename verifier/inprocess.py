"""Drafters in the verifier's own process: the in-process transport (DESIGN.md §1).

The scheduler meets these drafters exactly as it meets remote ones: through `Exchange`
calls to `Scheduler.receive` and the signals it queues for them. Only the carrying differs:
instead of a drafter looping on its own thread, the engine's loop pumps each drafter once
before it collects a batch (`EngineLoop.pump`): the signals of the last step go in, the
drafter drafts its next trees on the model thread, and the trees come back as themselves
(no encoding). With one core set shared by both models this is the classic synchronous
draft-then-verify step; a drafter here always runs in lockstep (`ring_slots` 1).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from speculation.transport import Exchange
from speculation.wire import Signal


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
        """One round: each drafter takes its signals, drafts (on the model thread, on `threads`)
        and files what it drafted, in one exchange."""
        for d in self.drafters:
            signals = scheduler.signals_for(d.index)
            if signals or d.streams:
                drafted = await run(self._draft, d, signals, threads)
            else:                     # nothing to hear, nothing to draft: no hop to the model thread
                drafted = d.draft()
            scheduler.receive(Exchange(d.index, d.incarnation, drafted.puts, 0.0, drafted.seconds, drafted.levels,
                                       d.resync_requests(), d.node, self.num_cpus, None, not drafted.more))

    @staticmethod
    def _draft(drafter: Drafting, signals: list[Signal], threads: int | None):
        import torch

        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        drafter.apply(signals)
        return drafter.draft()
