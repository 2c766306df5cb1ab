"""The scheduler's loop on an asyncio event loop, forwards on one model thread.

`EngineLoop` is what every engine runs: the Ray verifier actor (cluster/actors.py) and the
in-process engine (cluster/local.py) differ only in where their drafters live. Requests come
in through `generate` (an async generator of chunks); each `step` admits and prefills new
requests, lets in-process drafters draft (`pump`), collects the batch, runs the speculative
step (`speculation.step.speculative_step`) and publishes. Every forward and prefill runs on
one model thread, and the event loop keeps serving drafters' exchanges and aborts while the
target runs. `inline=True` runs them on the caller's thread instead (the blocking `generate`
of the in-process engine).

One thread runs a process's torch work, its models' building and warm-up included
(`model_thread`: the actors build on it and hand it to the loop). libgomp gives each thread
that opens a parallel region an OpenMP team of its own, and once two threads have, there are
more OpenMP threads than cores and every team's idle threads sleep between regions instead of
spinning. On this 2-core CPU a micro-pair forward took 0.74 ms on the one thread that built
the model and 2.15 ms, on either thread, once the other had opened a region too
(bench/README.md, "`specflash generate` in every mode": one OpenMP team per process).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from speculation.requests import GenerationChunk, SpeculationOptions
from speculation.step import speculative_step
from verifier.scheduler import Scheduler, settle_riders

log = logging.getLogger("specflash.verifier")

# Python's garbage collector in this process: seconds paused and full collections (a pause on
# the model thread lengthens a forward, one on the event loop delays a step)
_GC = {"s": 0.0, "full": 0, "since": None}


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["since"] = time.perf_counter()
    elif _GC["since"] is not None:
        _GC["s"] += time.perf_counter() - _GC["since"]
        _GC["full"] += int(info.get("generation") == 2)
        _GC["since"] = None


def gc_report() -> dict:
    if _gc_timer not in gc.callbacks:
        gc.callbacks.append(_gc_timer)
    return {"gc_s": _GC["s"], "gc_full_collections": _GC["full"]}


def model_thread() -> ThreadPoolExecutor:
    """A new model thread: one worker, which should build the models it will run."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-model")


class EngineLoop:
    def __init__(self, scheduler: Scheduler, pump: Callable[..., Awaitable] | None = None,
                 inline: bool = False, thread: ThreadPoolExecutor | None = None) -> None:
        """`pump(scheduler, run)`: in-process drafters, drafting before each collect
        (verifier/inprocess.py); None where drafters live elsewhere. `inline`: run the model's
        work on the calling thread, not the model thread. `thread`: the model thread, the
        one that built the models (`model_thread`); None = a new one."""
        self.scheduler = scheduler
        self.pump = pump
        self.inline = inline
        self._model_thread = thread or model_thread()
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        scheduler.on_work = self._poke
        gc_report()

    # -- requests ------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: list[int], params, spec: SpeculationOptions | None,
                       prefix_cache: bool = True) -> AsyncIterator[GenerationChunk]:
        """The request's chunks as the steps commit them; leaving early aborts it."""
        self.ensure_running()
        queue: asyncio.Queue = asyncio.Queue()
        self.scheduler.add(request_id, prompt, params, spec, queue.put_nowait, prefix_cache)
        try:
            while True:
                chunk = await queue.get()
                yield chunk
                if chunk.finished:
                    return
        finally:
            s = self.scheduler.streams.get(request_id)
            if s is not None:
                self.scheduler.finish(s, "abort", notify=False)

    def ensure_running(self) -> None:
        """Start the loop's task on the running event loop (once per event loop)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.get_loop() is not loop or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self.run())

    def close(self) -> None:
        """Stop the loop's task and the model thread."""
        if self._task is not None and not self._task.done():
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)
        if self._model_thread is not None:
            self._model_thread.shutdown(wait=False)

    async def aclose(self) -> None:
        """`close`, from the loop's own event loop: its task cancelled and awaited."""
        task = self._task
        self.close()
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await self.step()
                if self.inline:            # the model's work did not yield: let requests and aborts in
                    await asyncio.sleep(0)
            except Exception as e:     # a bug: fail the running requests, keep serving
                log.exception("verifier step failed")
                self.scheduler.fail_all(f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.01)

    # -- a step --------------------------------------------------------------------------
    async def step(self) -> bool:
        """One pass: admit, draft (in process), collect, verify, publish. Returns whether a
        forward ran (False: idle, or waiting for trees)."""
        sch = self.scheduler
        start = time.monotonic()
        if self._wake is not None:   # work that arrives from here on (a request, a tree) ends our waits
            self._wake.clear()
        await self.admit()
        active = sch.active()
        if not active:
            if self.pump is not None and any(sch.registry.outbox.get(d.index)
                                             for d in getattr(self.pump, "drafters", ())):
                # in-process drafters hear their streams' "leave"s now, not at the next request:
                # their draft KV is freed (and, with prefix caching, left cached) while idle
                await self.pump(sch, self.run_model, sch.registry.lendable_threads())
            if not sch.target.partial:     # no prompt's next chunk waiting either
                await self._sleep(sch.settings.poll_s)
            return False
        sch.members.rebalance()
        draft_s = 0.0
        if self.pump is not None:          # in-process drafters draft now, on the model thread
            begin = time.monotonic()
            await self.pump(sch, self.run_model, sch.registry.lendable_threads())
            draft_s = time.monotonic() - begin
            sch.stats.observe_idle(draft_s)        # the target waits while the drafter drafts
            sch.costs.idle_carry += draft_s
            active = sch.active()          # requests may have ended meanwhile
        admitted = time.monotonic()        # prefills and drafting are not a verification step's cost
        batch, deadline = sch.collect(active, start)
        if not batch:                      # every sequence waits for its tree: verifier idle
            await self._sleep(max(0.0, deadline - time.monotonic()))
            waited = time.monotonic() - start
            sch.stats.observe_idle(waited)
            sch.stats.observe_wall(waited)
            sch.costs.idle_carry += waited
            return False
        threads = sch.step_threads(batch)
        if sch.announced:           # bridge chains, drafted on the model thread before the forward
            await self.run_model(sch.bridge_chains, batch, threads)
        chunks = sch.riders               # prompts' chunks ride in this forward (chunked prefill)
        outcomes, seconds = await speculative_step(batch, sch.target, self.run_model, threads, chunks)
        sch.publish(outcomes, draft_s, seconds)
        if chunks:
            settle_riders(sch, chunks, seconds)
        end = time.monotonic()
        sch.stats.observe_wall(end - start)
        # the planner pays what a step really costs: its wall time plus the idle waits before it
        sch.observe_step(batch, seconds, threads, end - admitted, chunks)
        return True

    async def admit(self) -> None:
        """Free finished sequences' KV and prefill new ones (between forwards, never during)."""
        sch = self.scheduler
        to_free, joins, threads = sch.plan_admission()
        if not to_free and not joins:
            return
        features = await self.run_model(sch.prefill, to_free, joins, threads)
        sch.prefilled(joins, features)

    async def run_model(self, fn: Callable, *args):
        if self.inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    async def _sleep(self, seconds: float) -> None:
        """Up to `seconds`, ended by any work that arrived since this step began (`_poke`): a
        request added or a tree filed while the step awaited the model thread is not missed."""
        if self._wake is None:
            await asyncio.sleep(seconds)
            return
        # not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that meets an
        # already-set event, and the loop's task then never ends
        if self._wake.is_set():       # waiting on a set event would not yield: let the others in first
            await asyncio.sleep(0)
            return
        timer = asyncio.get_running_loop().call_later(seconds, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()
