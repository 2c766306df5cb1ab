"""`LocalEngine`: the in-process sync engine (`cluster.engine.Engine`) behind the Engine protocol.

The sync engine runs a list of requests to completion in lockstep. Here it runs
on one background thread that owns the model: requests wait in a queue; the
thread takes every request waiting (up to `max_batch`) as one *wave*, prefills
them and steps the wave (one batched draft pass and one batched target forward
per step), handing each step's committed tokens to the request's asyncio queue
as a `GenerationChunk`. Requests arriving during a wave wait for the next one
(static batching: the engine sizes its KV caches per wave). An abort is
noticed between steps: the sequence is released, its KV blocks freed.

The "verifier idle fraction" reported here is the share of step time spent
drafting, during which the target waits (the synchronous baseline the Ray
pipeline exists to beat).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from speculation.requests import GenerationChunk, GenerationRequest

log = logging.getLogger("specflash.cluster")


@dataclass
class _Job:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue
    aborted: threading.Event = field(default_factory=threading.Event)

    def emit(self, chunk: GenerationChunk) -> None:
        self.loop.call_soon_threadsafe(self.chunks.put_nowait, chunk)


@dataclass
class _Totals:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    requests: int = 0
    aborted: int = 0


class LocalEngine:
    """Implements `speculation.requests.Engine` over `cluster.engine.Engine` on a worker thread."""

    def __init__(self, engine, max_batch: int = 16, speculation: bool | None = None) -> None:
        self.engine = engine                      # cluster.engine.Engine (sync, not thread-safe)
        self.max_batch = max_batch
        self.speculation = engine.draft is not None if speculation is None else speculation
        self._waiting: queue.Queue[_Job | None] = queue.Queue()
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._totals = _Totals()
        self._running = 0
        self._error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="specflash-local-engine", daemon=True)
        self._thread.start()

    # -- Engine protocol ---------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        rid = request.request_id
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if rid in self._jobs:
                raise ValueError(f"request id {rid!r} is already running")
            self._jobs[rid] = job
        self._waiting.put(job)
        finished = False
        try:
            while not finished:
                chunk = await job.chunks.get()
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                job.aborted.set()
            with self._lock:
                self._jobs.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            job = self._jobs.get(request_id)
        if job is not None:
            job.aborted.set()

    async def health(self) -> dict:
        alive = self._thread.is_alive() and self._error is None
        out = {"ok": alive, "speculation": self.speculation, "engine": "local",
               "max_context": self.engine.max_context, "running": self._running,
               "waiting": self._waiting.qsize()}
        if self._error:
            out["error"] = self._error
        return out

    async def stats(self) -> dict:
        t = self._totals
        busy = t.draft_s + t.verify_s
        out = {"acceptance_rate": t.accepted / t.drafted if t.drafted else 0.0,
               "mean_accepted_length": (t.accepted + t.steps) / t.steps if t.steps else 0.0,
               "verifier_idle_fraction": t.draft_s / busy if busy else 0.0,
               "num_steps": t.steps, "num_drafted": t.drafted, "num_accepted": t.accepted,
               "num_generated": t.generated, "num_requests": t.requests, "num_aborted": t.aborted,
               "num_running": self._running, "num_waiting": self._waiting.qsize()}
        cache = getattr(getattr(self.engine, "verifier", None), "cache", None)
        if cache is not None:
            out["kv_blocks_free"] = cache.num_free_blocks
            out["kv_blocks_total"] = cache.num_blocks
        return out

    def shutdown(self) -> None:
        self._waiting.put(None)
        self._thread.join(timeout=30)

    # -- worker thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._waiting.get()
            if job is None:
                return
            wave = [job]
            while len(wave) < self.max_batch:
                try:
                    nxt = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._waiting.put(None)
                    break
                wave.append(nxt)
            try:
                self._run_wave([j for j in wave if not j.aborted.is_set()])
            except Exception as e:  # a bug or OOM: fail this wave's requests, keep serving
                log.exception("local engine wave failed")
                for j in wave:
                    j.emit(GenerationChunk(j.request.request_id, [], True, "error",
                                           error=f"engine error: {e!r}"))

    def _run_wave(self, jobs: list[_Job]) -> None:
        from cluster.engine import EngineError

        eng, ok = self.engine, []
        for j in jobs:
            try:
                eng._check_request(j.request)
                ok.append(j)
            except EngineError as e:
                j.emit(GenerationChunk(j.request.request_id, [], True, "error", error=str(e)))
        if not ok:
            return
        eng._ensure_caches([j.request for j in ok])
        active: list[tuple[_Job, object]] = []
        pending = [j.request.request_id for j in ok]   # to release if prefill fails
        try:
            active = list(zip(ok, eng._prefill([j.request for j in ok])))  # one batched prefill
            pending = []
            self._totals.requests += len(active)
            self._running = len(active)
            while active:
                active = self._drop_aborted(active)
                if not active:
                    break
                sent = [len(s.output) for _, s in active]
                before = [_snapshot(s.stats) for _, s in active]
                eng.step([s for _, s in active])
                still = []
                for (j, s), n, snap in zip(active, sent, before):
                    self._account(s, n, snap)
                    new = s.output[n:]
                    done = s.finish_reason is not None
                    j.emit(GenerationChunk(j.request.request_id, list(new), done, s.finish_reason,
                                           s.stats.num_drafted, s.stats.num_accepted))
                    if done:
                        eng._release(s.seq_id)
                    else:
                        still.append((j, s))
                active = still
                self._running = len(active)
        finally:  # an exception mid-wave: free what is left
            for seq_id in pending + [s.seq_id for _, s in active]:
                try:
                    eng._release(seq_id)
                except Exception:
                    pass
            self._running = 0

    def _drop_aborted(self, active: list) -> list:
        keep = []
        for j, s in active:
            if j.aborted.is_set():
                self.engine._release(s.seq_id)
                self._totals.aborted += 1
                j.emit(GenerationChunk(j.request.request_id, [], True, "abort",
                                       s.stats.num_drafted, s.stats.num_accepted))
            else:
                keep.append((j, s))
        return keep

    def _account(self, s, sent: int, before: tuple) -> None:
        t, now = self._totals, _snapshot(s.stats)
        t.steps += 1
        t.generated += len(s.output) - sent
        t.drafted += now[0] - before[0]
        t.accepted += now[1] - before[1]
        t.draft_s += now[2] - before[2]
        t.verify_s += now[3] - before[3]


def _snapshot(stats) -> tuple:
    return (stats.num_drafted, stats.num_accepted, stats.draft_s, stats.verify_s)


def build_local_engine(target_dir: str, draft_dir: str | None, *, spec_len: int = 4,
                       tree_width: int = 1, max_batch: int = 16):
    """(LocalEngine, tokenizer) for a checkpoint pair, loaded in this process."""
    from cluster.engine import build_engine

    pair = build_engine(target_dir, draft_dir, spec_len=spec_len, tree_width=tree_width,
                        load_draft=draft_dir is not None)
    return LocalEngine(pair.engine, max_batch=max_batch), pair.tokenizer
