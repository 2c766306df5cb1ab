"""A scheduler and its loop in one process, driven the way a remote drafter and a client drive a
verifier (no Ray): `exchange` is a drafter's call, `generate` a request."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine

import torch

from models.presets import eos_of
from models.sampling import SamplingParams
from speculation.policy import threads_of
from speculation.requests import SpeculationOptions
from speculation.settings import EngineSettings
from speculation.step import StepItem
from speculation.transport import Exchange
from speculation.wire import Signal
from verifier.loop import EngineLoop
from verifier.scheduler import Scheduler
from verifier.target import TargetSide


def run_restoring_threads(coro: Coroutine, seconds: float = 120):
    """`coro` run to its end within `seconds`; the torch threads the actor set are given back to
    the session after it."""
    threads = torch.get_num_threads()
    try:
        return asyncio.run(asyncio.wait_for(coro, seconds))
    finally:
        torch.set_num_threads(threads)

class Harness:
    def __init__(self, target_dir, **settings) -> None:
        st = EngineSettings(**settings)
        torch.set_num_threads(threads_of(st.num_cpus))
        self.side = TargetSide(str(target_dir), st.num_blocks, st.block_size)
        self.scheduler = Scheduler(self.side, st, eos_ids=eos_of(str(target_dir)))
        self.loop = EngineLoop(self.scheduler)

    async def exchange(self, drafter: int, incarnation: str, puts=(), wait_s: float = 0.0, **kw) -> list[Signal]:
        """A drafter's exchange: its trees filed, the signals queued for it taken."""
        self.loop.ensure_running()
        self.scheduler.receive(Exchange(drafter, incarnation, list(puts), wait_s, **kw))
        return self.scheduler.signals_for(drafter)

    def generate(self, rid: str, prompt: list[int], params: SamplingParams, spec: dict) -> AsyncIterator:
        return self.loop.generate(rid, prompt, params, SpeculationOptions(**spec))

    def stream(self, rid: str, prompt: list[int], params: SamplingParams, budget: tuple[int, int] = (2, 1),
               drafter: int | None = 0, mode: str = "auto"):
        """A stream as admission leaves it (ring, budget, drafter), without a step run."""
        s = self.scheduler.add(rid, prompt, params, SpeculationOptions(mode=mode), lambda chunk: None)
        self.scheduler.joins.remove(rid)
        s.admitted, s.drafter, s.budget = True, drafter, budget
        self.scheduler.ring.add_stream(rid)
        return s

    def step_threads(self, items: list[tuple], turn: int | None = None) -> int:
        return self.scheduler.step_threads([StepItem(*it) for it in items], turn)

    def lendable_later(self) -> int:
        return self.scheduler.registry.lendable_threads(now=False)

    def plain_step_s(self, rows: int) -> float | None:
        return self.scheduler.costs.plain_step_s(rows, self.lendable_later())
