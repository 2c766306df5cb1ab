"""The scheduler's loop on an asyncio event loop, and the thread that runs it with its models.

`EngineLoop` is what every engine runs: the Ray verifier actor (cluster/actors.py) and the
in-process engine (cluster/local.py) differ only in where their drafters live. Requests come
in through `generate` (an async generator of chunks); each `step` admits and prefills new
requests, lets in-process drafters draft (`pump`), collects the batch, runs the speculative
step (`speculation.step.speculative_step`) and publishes.

Both shells run the loop `inline` on an `EngineThread`: a thread with an event loop of its
own, which builds the models, warms them up and runs every forward between its steps, while
the callers (Ray's event loop in the actor, the server's in the local engine) only hand it
requests, drafters' exchanges and aborts and take its chunks (`EngineThread.stream`). With
forwards of a millisecond, the two hand-offs a step to a separate model thread and the event
loop's wake-ups contending for the GIL cost more than the forwards (bench/README.md, "micro
pair"). Without `inline` each forward runs on a model thread of the loop's own
(`model_thread`: the blocking tests' harness).

One thread runs a process's torch work, its models' building and warm-up included. libgomp
gives each thread that opens a parallel region an OpenMP team of its own, and once two
threads have, there are more OpenMP threads than cores and every team's idle threads sleep
between regions instead of spinning. On this 2-core CPU a micro-pair forward took 0.74 ms on
the one thread that built the model and 2.15 ms, on either thread, once the other had opened
a region too (bench/README.md, "`specflash generate` in every mode": one OpenMP team per
process).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from speculation.requests import GenerationChunk, SpeculationOptions, merge_chunks
from speculation.step import speculative_step, tree_rows
from speculation.step_log import SequenceStep, StepLog, VerifierStep
from verifier.admission import settle_riders
from verifier.scheduler import Scheduler

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


@dataclass
class _Raised:
    """What `EngineThread.stream` relays when its source raised."""

    error: BaseException


_END = object()     # `EngineThread.stream`'s source is exhausted
HAND_OUT_S = 0.005  # the longest a prefill waits for the drafters' replies to leave (`EngineLoop.admit`)


class EngineThread:
    """A thread with an event loop of its own: it builds an engine's models and runs the
    engine's loop (inline) and every forward; other threads' event loops reach it through
    `run` / `call` / `stream`, and a plain thread through `wait`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def wait(self, coro: Coroutine, timeout: float | None = None):
        """Run `coro` on the engine's loop; block this (other) thread for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def build(self, coro: Coroutine):
        """`wait` for the engine's building (`coro`, which makes its models here); where it
        fails, the thread is stopped and the error raised."""
        try:
            return self.wait(coro)
        except BaseException:
            self.stop()
            raise

    async def run(self, coro: Coroutine):
        """Await `coro`, run on the engine's loop, from another thread's event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def call(self, fn: Callable, *args):
        """`fn(*args)` on the engine's loop (it may read and change the engine's state)."""
        return await self.run(_called(fn, args))

    async def stream(self, source: AsyncIterator) -> AsyncIterator:
        """`source`'s items, iterated on the engine's loop, on the caller's loop as they come;
        its error raised here. Leaving early cancels the source there and waits for its
        cleanup (a request's abort) to have run."""
        caller, items = asyncio.get_running_loop(), asyncio.Queue()

        def put(item) -> None:
            caller.call_soon_threadsafe(items.put_nowait, item)

        async def relay() -> None:
            try:
                async for item in source:
                    put(item)
                put(_END)
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                put(_Raised(e))

        task = await self.call(asyncio.ensure_future, relay())
        ended = False
        try:
            while True:
                item = await items.get()
                if item is _END or isinstance(item, _Raised):
                    ended = True
                    if item is _END:
                        return
                    raise item.error
                yield item
        finally:
            if not ended:
                await self.run(_cancelled(task))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop and join the thread (the engine's tasks should have ended first)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

    def close(self, engine_loop: "EngineLoop", timeout: float = 30.0) -> None:
        """The engine's loop task ended (not left pending for the garbage collector), then the
        thread stopped."""
        try:
            self.wait(engine_loop.aclose(), timeout)
        finally:
            self.stop(timeout)


async def _called(fn: Callable, args: tuple):
    return fn(*args)


async def _cancelled(task: asyncio.Task) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def wait_event(event: asyncio.Event, seconds: float) -> None:
    """Until `event` is set or `seconds` have passed (the timer sets it). Not asyncio.wait_for:
    that wraps the wait in a task of its own, a few more turns of the loop on the way of every
    reply it ends, and on Python 3.11 it can swallow a cancellation that meets an already-set event."""
    if event.is_set():
        return
    timer = asyncio.get_running_loop().call_later(seconds, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()


class EngineLoop:
    def __init__(self, scheduler: Scheduler, pump: Callable[..., Awaitable] | None = None,
                 inline: bool = False) -> None:
        """`pump(scheduler, run)`: in-process drafters, drafting before each collect
        (verifier/inprocess.py); None where drafters live elsewhere. `inline`: run the model's
        work on the calling thread (an `EngineThread`), not on a model thread of the loop's
        own (made when first needed)."""
        self.scheduler = scheduler
        self.pump = pump
        self.inline = inline
        # a shell whose drafters' exchanges it answers (cluster/actors.py): whether replies to them
        # are still on their way (`_hand_out`)
        self.replies_due: Callable[[], bool] | None = None
        self._model_thread: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self.step_log = StepLog()         # SPECFLASH_STEP_LOG: a line per step (speculation/step_log.py)
        scheduler.on_work = self._poke
        gc_report()

    # -- requests ------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: list[int], params, spec: SpeculationOptions | None,
                       prefix_cache: bool = True) -> AsyncIterator[GenerationChunk]:
        """`add` the request (on the first iteration), then its `chunks`."""
        chunks = self.chunks(request_id, self.add(request_id, prompt, params, spec, prefix_cache))
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def add(self, request_id: str, prompt: list[int], params, spec: SpeculationOptions | None,
            prefix_cache: bool = True) -> asyncio.Queue:
        """Take a request now (ValueError: refused); its steps' chunks go to the queue returned,
        for `chunks`."""
        self.ensure_running()
        queue: asyncio.Queue = asyncio.Queue()
        self.scheduler.add(request_id, prompt, params, spec, queue.put_nowait, prefix_cache)
        return queue

    async def chunks(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[GenerationChunk]:
        """A request's chunks as the steps commit them, the first and the last at once and the
        others merged until they carry `stream_interval` tokens; leaving early aborts it."""
        interval, held, first = self.scheduler.settings.stream_interval, None, True
        try:
            while True:
                chunk = await queue.get()
                held = chunk if held is None else merge_chunks(held, chunk)
                if first or held.finished or len(held.token_ids) >= interval:
                    yield held
                    if held.finished:
                        return
                    held, first = None, False
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
            await self._no_streams()
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
        turn = getattr(self.pump, "turn", None)      # the threads the pump's passes ran on, if it chose
        threads = sch.step_threads(batch, turn)
        if sch.announced:           # bridge chains, drafted on the model thread before the forward
            await self.run_model(sch.bridge_chains, batch, threads)
        chunks = sch.riders               # prompts' chunks ride in this forward (chunked prefill)
        outcomes, seconds = await speculative_step(batch, sch.target, self.run_model, threads, chunks)
        sch.publish(outcomes, draft_s, seconds)
        if self.replies_due is not None and self.replies_due():
            # drafters waiting in an exchange get the signals just queued now, not after this
            # step's bookkeeping and the next step's admission (the micro pair's remote turns:
            # a signal reached its drafter 0.59 ms after publishing against 0.72, 62 steps)
            await asyncio.sleep(0)
        if chunks:
            settle_riders(sch, chunks, seconds)
        end = time.monotonic()
        if turn is not None:
            sch.step_kind.trial = self.pump.trying(threads)
            self.pump.observe_step(threads, tree_rows(batch), start, end)
        sch.stats.observe_wall(end - start)
        waited = sch.costs.idle_carry - draft_s       # the waits for trees since the last step
        # the planner pays what a step really costs: its wall time plus the idle waits before it
        sch.observe_step(batch, seconds, threads, end - admitted, chunks)
        if self.step_log.on:
            self._log_step(outcomes, waited, draft_s, seconds, end - start, threads)
        return True

    async def _no_streams(self) -> None:
        """A pass with no stream to verify: in-process drafters hear their streams' "leave"s now,
        not at the next request (their draft KV is freed, and with prefix caching left cached,
        while idle); then wait a poll unless a prompt's next chunk is due."""
        sch = self.scheduler
        if self.pump is not None and any(sch.registry.outbox.get(d.index) for d in getattr(self.pump, "drafters", ())):
            await self.pump(sch, self.run_model, sch.registry.lendable_threads())
        if not sch.target.partial:
            await self._sleep(sch.settings.poll_s)

    def _log_step(self, outcomes, idle_s: float, draft_s: float, forward_s: float, wall_s: float,
                  threads: int) -> None:
        seqs = [SequenceStep(o.item.seq.request_id, o.item.tree.num_nodes, len(o.kept),
                             *((None, None, None) if (h := o.item.header) is None
                               else (h.tree_id, h.epoch, bool(h.assumed))))
                for o in outcomes]
        self.step_log.write(VerifierStep(time.time(), max(0.0, idle_s), draft_s, forward_s, wall_s, threads,
                                         self.scheduler.regime.current, seqs))

    async def admit(self) -> None:
        """Free finished sequences' KV and prefill new ones (between forwards, never during)."""
        sch = self.scheduler
        to_free, joins, threads = sch.plan_admission()
        if not to_free and not joins:
            return
        if joins and self.inline and self.replies_due is not None:
            await self._hand_out(self.replies_due)
        features = await self.run_model(sch.prefill, to_free, joins, threads)
        sch.prefilled(joins, features)

    async def _hand_out(self, due: Callable[[], bool]) -> None:
        """Before a prefill, inline: let the signals just queued (a joining stream's "resync")
        leave for drafters waiting in an exchange, so that they catch up on the prompt while the
        target prefills it. A forward on this thread holds the loop, and the exchange's reply
        also needs the caller's loop (Ray's, on another thread) to run: turns of this loop alone
        left the reply waiting until the prefill had ended. At most `HAND_OUT_S`."""
        deadline = time.monotonic() + HAND_OUT_S
        while due() and time.monotonic() < deadline:
            await asyncio.sleep(0.0002)          # a real wait: the other thread gets the GIL

    async def run_model(self, fn: Callable, *args):
        if self.inline:         # exchanges wait until it ends: their drafters are not silent meanwhile
            began = time.monotonic()
            try:
                return fn(*args)
            finally:
                self.scheduler.registry.excuse(time.monotonic() - began)
        if self._model_thread is None:
            self._model_thread = model_thread()
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    async def _sleep(self, seconds: float) -> None:
        """Up to `seconds`, ended by any work that arrived since this step began (`_poke`): a
        request added or a tree filed while the step awaited the model thread is not missed."""
        if self._wake is None:
            await asyncio.sleep(seconds)
            return
        if self._wake.is_set():       # waiting on a set event would not yield: let the others in first
            await asyncio.sleep(0)
            return
        await wait_event(self._wake, seconds)
