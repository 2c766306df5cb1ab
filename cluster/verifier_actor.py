"""The verifier as a Ray actor: its half of the asynchronous protocol (DESIGN.md §3).

`VerifierActor` (an asyncio actor) owns the target model, its KV cache, the
ring (verifier/ring.py) and every request's output stream. Its loop takes, for
every active sequence, the first valid tree in its ring (or a tree of zero
nodes when speculation is off, the drafter is dead, or its tree is late),
verifies them all in **one** target forward (continuous batching: sequences
join and leave between steps), commits, streams the tokens to the client at
once, and queues an accept / rollback signal for the sequence's drafter. The
forward runs on the actor's model thread, so drafters' `exchange` calls (puts and
signal pick-up) are served while it runs. The drafter half is in
cluster/actors.py.

Exactness never rests on the drafter: only a tree whose claimed prefix equals
the committed one is verified (verifier/ring.py); a sequence whose tree is
missing or late decodes alone (a tree of zero nodes). A drafter that
reattaches with a new incarnation id (Ray restarted it) is resynchronised from
the committed prefixes; streams of a dead drafter move to a live one.

On a CPU node, a plain step or a prompt prefill taken while no drafter has
work runs on the idle drafters' cores too (`_step_threads`, `backends.plain_step_threads`): with
speculation switched off the pipeline then decodes as fast as the target alone.

The verifier itself may be restarted by Ray (`max_restarts`, cluster/pipeline.py):
it comes back empty under a new incarnation id, its old requests having failed
with a retryable error on the caller's side, and it tells every drafter that
attaches to drop what it held ("reset", speculation/wire.py). A malformed or
version-mismatched frame is logged, counted (`frames_rejected`) and refused;
the actor keeps serving.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
import uuid
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import ray
import torch

from speculation.planner import AdaptiveSpeculation, CostModel, VerifyCosts, one_off_costs, plan_lookups
from cluster.backends import (MAX_BRIDGE_DEPTH, BridgeDraft, PipelineSettings, TargetSide, bridge_chain_depth,
                              eos_ids_of, gpu_ids, in_lockstep, plain_step_threads, restart_tree_depth, rss_bytes,
                              set_threads, threads_of)
from speculation.stats import SpecStats
from speculation.requests import GenerationChunk
from verifier.ring import Ring, RingEntry
from drafter.streams import VerifyStream
from speculation.wire import Signal, TreeHeader, WireError, decode_tree, encode_signals, unpack_header
from drafter.ngram import NgramIndex
from models.sampling import SamplingParams
from models.transformer import few_row_limit

log = logging.getLogger("specflash.cluster")


# Python's garbage collector in this process: seconds paused and full collections (a pause on
# the model thread lengthens a forward, one on the event loop delays a step); `_time_gc`
# installs the timer once per process
_GC = {"s": 0.0, "full": 0, "since": None}


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["since"] = time.perf_counter()
    elif _GC["since"] is not None:
        _GC["s"] += time.perf_counter() - _GC["since"]
        _GC["full"] += int(info.get("generation") == 2)
        _GC["since"] = None


def _time_gc() -> None:
    if _gc_timer not in gc.callbacks:
        gc.callbacks.append(_gc_timer)


# how long a batch's recent size is remembered when planning (`VerifierActor._refilling`)
REFILL_MEMORY_S = 1.0


def _gives_a_tree(sig: Signal) -> bool:
    """Whether a signal gives its drafter a tree to draft (a budget of depth > 0)."""
    return bool(sig.budget) and sig.budget[0] > 0


def _sampling_dict(p: SamplingParams) -> dict:
    return asdict(p)


class VerifierActor:
    def __init__(self, target_dir: str, settings: dict, draft_dir: str | None = None) -> None:
        """`draft_dir`: the draft model, for bridge chains (`bridge_depth` > 0; unused otherwise)."""
        self.settings = PipelineSettings(**settings)
        chains = self.settings.bridge_depth > 0 and self.settings.proposer == "model"
        if chains and draft_dir is None:
            raise ValueError("bridge_depth > 0 needs the draft model on the verifier (draft_dir)")
        set_threads(self.settings.num_cpus)
        self.threads = threads_of(self.settings.num_cpus)
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self.gpu_ids = gpu_ids(self.settings.device)   # None on a CPU
        self.incarnation = uuid.uuid4().hex
        self.side = TargetSide(target_dir, self.settings.num_blocks, self.settings.block_size,
                               self.settings.device, self.settings.dtype)
        self.warm_up_s = self.side.warm_up(self.settings.spec_len)    # GPU: compile and capture now
        self.eos_ids = set(eos_ids_of(target_dir))
        self.bridge_draft = None      # our copy of the draft, for bridge chains (drafter/streams.py)
        if chains:
            self.bridge_draft = BridgeDraft(draft_dir, target_dir, self.settings)
            self.warm_up_s += self.bridge_draft.warm_up(min(self.settings.bridge_depth, MAX_BRIDGE_DEPTH))
        self._announced: dict[str, list[int] | None] = {}   # this step's bridge chains: their outcomes
        self.ring = Ring(self.settings.ring_slots)
        self.adaptive = AdaptiveSpeculation(max_spec_len=16)
        # Step costs, one model per way of stepping (a lockstep step on a CPU runs on the
        # drafter's cores too, an overlapped one on ours: one fit of both would misprice each).
        # Overlapped: verify (+ idle waits) beside drafting, the larger of the two counts.
        # Lockstep: the forward, plus the wait for the trees as the draft's cost per level.
        self.overlap_costs = self.adaptive.costs
        self.lockstep_costs = CostModel(overlap=False)
        # the planner's (bridges, costs), set again before each plan: `_plan_overlap`
        self.adaptive.bridges = self.settings.ring_slots > 1
        self.adaptive.restart_depth = self.settings.restart_depth
        if self.settings.ring_slots == 1:
            self.adaptive.costs = self.lockstep_costs
        self.plain_costs = CostModel()   # plain steps (on borrowed cores; on a GPU all): a + b * rows
        for model in (self.overlap_costs, self.lockstep_costs, self.plain_costs):
            model.one_off = one_off_costs(self.side.verifier.model)
        self.lookup = AdaptiveSpeculation(max_spec_len=16, overlap=False)   # γ of prompt lookup
        self._ngrams: dict[str, NgramIndex] = {}     # each lookup sequence's n-gram index
        self._recent_rows: deque = deque()           # (time, sequences planned for) (`_refilling`)
        self.adaptive.row_limit = self.lookup.row_limit = few_row_limit(self.side.verifier.model)
        self.stats = SpecStats()
        self.streams: dict[str, VerifyStream] = {}
        self.queues: dict[str, asyncio.Queue] = {}
        self.joins: deque[str] = deque()
        self.outbox: dict[int, list[Signal]] = defaultdict(list)
        self.drafters: dict[int, dict] = {}          # index -> {incarnation, last_seen, tree_s, node, cpus}
        self._to_free: list[str] = []
        self._reserved_blocks: dict[str, int] = {}
        self._wake: asyncio.Event | None = None
        self._mail: dict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self._task: asyncio.Task | None = None
        self._error: str | None = None
        self._idle_carry = 0.0                       # idle seconds since the last verify step
        # every forward and prefill runs on this one thread, so one OpenMP thread team serves
        # them all (asyncio's pool would spread them over threads, each with a team of its own)
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-model")
        self._forward_by_rows: dict[int, list[float]] = {}   # rows -> [count, seconds] of target forwards
        self._borrowed_by_rows: dict[int, list[float]] = {}  # the same, for steps on borrowed cores
        _time_gc()

    # -- public methods (called through Ray) ------------------------------------------
    async def ready(self) -> bool:
        self._ensure_loop()
        return True

    async def generate(self, request_id: str, prompt: list[int], sampling: dict, speculation: dict):
        """Async generator of GenerationChunk; Ray streams each one to the caller."""
        self._ensure_loop()
        s = self._new_stream(request_id, prompt, SamplingParams(**sampling), speculation)
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id], self.queues[request_id] = s, queue
        self.joins.append(request_id)
        self._wake.set()
        try:
            while True:
                chunk = await queue.get()
                yield chunk
                if chunk.finished:
                    return
        finally:
            if request_id in self.streams:
                self._finish(self.streams[request_id], "abort", notify=False)

    async def abort(self, request_id: str) -> bool:
        s = self.streams.get(request_id)
        if s is None:
            return False
        self._finish(s, "abort")
        return True

    async def exchange(self, drafter: int, incarnation: str, puts: list, wait_s: float,
                       draft_s: float = 0.0, draft_levels: int = 0, resync: list | tuple = (),
                       node: str = "", cpus: float = 0.0, gpus: list | None = None,
                       idle: bool | None = None) -> bytes:
        """Drafter -> verifier: file its trees in the ring; return the signals queued for it.
        `node` / `cpus`: where the drafter runs and the CPUs it reserved (cores a plain step
        may borrow while it has nothing to draft, `plain_step_threads`); `gpus`: the GPUs Ray
        gave it (None on a CPU; one of ours: lockstep, `_lockstep`). `idle`: after this call it
        has nothing to draft until a signal comes (None: so if it delivers no trees); only an
        idle drafter lends its cores, until we signal it again."""
        self._ensure_loop()
        headers = self._unpack_puts(drafter, puts)     # refuses the whole call on a bad frame
        now = time.monotonic()
        info = self.drafters.get(drafter)
        if info is None or info["incarnation"] != incarnation:
            self._attach(drafter, incarnation)
            info = self.drafters[drafter]
        info["last_seen"] = now
        info["node"], info["cpus"], info["gpus"] = node, cpus, None if gpus is None else [str(g) for g in gpus]
        # idle unless signals giving it a tree to draft wait for it here (this reply carries them)
        info["idle"] = (((not puts) if idle is None else bool(idle))
                        and not any(map(_gives_a_tree, self.outbox.get(drafter, ()))))
        if draft_levels:
            if not self._lockstep(drafter):   # in lockstep `_step` prices the wait for its trees instead
                self.overlap_costs.observe_draft(draft_levels, draft_s)
            info["tree_s"] = 0.7 * info["tree_s"] + 0.3 * draft_s
        for header, (_, refs) in zip(headers, puts):
            self._put(drafter, header, refs[0])
        for stream in resync:            # the drafter lost its state for these streams
            s = self.streams.get(stream)
            if s is not None and s.admitted and s.drafter == drafter:
                self._resync(s)
        self._wake.set()
        mail = self._mail[drafter]
        if not self.outbox.get(drafter) and wait_s > 0:
            mail.clear()
            try:
                await asyncio.wait_for(mail.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return encode_signals(self.outbox.pop(drafter, []))

    async def health(self) -> dict:
        live = [i for i in self.drafters if self._live(i)]
        reason = None
        if not live:
            reason = ("drafter unavailable: none has attached" if not self.drafters else
                      f"drafter unavailable: none heard from in {self.settings.drafter_timeout_s:g} s")
        return {"ok": self._error is None, "error": self._error, "active": len(self.streams),
                "drafters_live": live, "speculation": bool(live), "speculation_reason": reason,
                "incarnation": self.incarnation, "node_id": ray.get_runtime_context().get_node_id(),
                "cpus": self.settings.num_cpus, "gpus": self.gpu_ids}

    async def get_stats(self) -> dict:
        a, b = self.adaptive.costs.coefficients
        pa, pb = self.plain_costs.coefficients if self.plain_costs.observed else (None, None)
        return {**self.stats.as_dict(), "verify_cost_a_s": a, "verify_cost_b_s": b,
                "plain_cost_a_s": pa, "plain_cost_b_s": pb,     # steps on borrowed cores
                "draft_level_s": self.adaptive.costs.d,        # of the model the planner uses now
                "lockstep_draft_level_s": self.lockstep_costs.d,   # the wait for a tree per level, in lockstep
                # mean target forward (ms) per batch shape: what a verification costs in here
                "forward_ms_by_rows": {r: 1e3 * t / n for r, (n, t) in sorted(self._forward_by_rows.items())},
                "borrowed_forward_ms_by_rows": {r: 1e3 * t / n for r, (n, t)
                                                in sorted(self._borrowed_by_rows.items())},
                "drafters_live": [i for i in self.drafters if self._live(i)],
                # CUDA graphs of the target's small forwards (None off a GPU): captures, replays, eager
                "cuda_graphs": None if self.side.graphs is None else self.side.graphs.stats(),
                "warm_up_s": self.warm_up_s,
                "gc_s": _GC["s"], "gc_full_collections": _GC["full"],
                # the planner's step models: seconds predicted for a step of 1 and 16 rows
                **{f"{name}_step_{rows}_rows_s": model.step_time(rows, 0)
                   for name, model in (("overlap", self.overlap_costs), ("lockstep", self.lockstep_costs),
                                       ("plain", self.plain_costs)) for rows in (1, 16)}}

    async def kv_usage(self) -> dict:
        """KV blocks, ring slots and the other per-request state (all 0 / free when idle)."""
        cache = self.side.cache
        return {"free": cache.num_free_blocks, "total": cache.num_blocks, "ring": self.ring.total(),
                "streams": len(self.streams), "queues": len(self.queues), "joins": len(self.joins),
                "reserved_blocks": sum(self._reserved_blocks.values()), "to_free": len(self._to_free),
                "rss_bytes": rss_bytes(), "incarnation": self.incarnation}

    # -- streams ------------------------------------------------------------------------
    def _new_stream(self, request_id: str, prompt: list[int], params: SamplingParams,
                    spec: dict) -> VerifyStream:
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt:
            raise ValueError("the prompt is empty: it must hold at least one token")
        ctx, vocab = self.side.max_context, self.side.vocab_size
        if len(prompt) >= ctx:
            raise ValueError(f"the prompt is {len(prompt)} tokens long; the target's context is {ctx}")
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        st = self.settings
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        mode = spec.get("mode") or st.mode
        width = 1 if mode == "chain" else (spec.get("tree_width") or st.tree_width)
        s = VerifyStream(request_id, list(prompt), params, torch.Generator().manual_seed(seed), stop,
                         mode, spec.get("spec_len") or st.spec_len, width, ctx,
                         committed=list(prompt))
        s.seed = seed
        return s

    def _finish(self, s: VerifyStream, reason: str, notify: bool = True, error: str | None = None) -> None:
        """Take the stream out: ring slots now, KV blocks at the loop's next reap."""
        if s.request_id not in self.streams:
            return
        s.finish_reason = s.finish_reason or reason
        del self.streams[s.request_id]
        if s.request_id in self.joins:
            self.joins.remove(s.request_id)
        dropped = self.ring.remove_stream(s.request_id)
        self._drop(dropped)
        self.adaptive.remove(s.request_id)
        self.lookup.remove(s.request_id)
        self._ngrams.pop(s.request_id, None)
        self._reserved_blocks.pop(s.request_id, None)
        if s.prefilled:
            self._to_free.append(s.request_id)
        if s.drafter is not None:
            self._send(s.drafter, Signal("leave", s.request_id))
        queue = self.queues.pop(s.request_id, None)
        if notify and queue is not None and reason in ("abort", "error"):
            queue.put_nowait(self._chunk(s, [], error=error))
        if self._wake:
            self._wake.set()

    def _chunk(self, s: VerifyStream, tokens: list[int], error: str | None = None) -> GenerationChunk:
        return GenerationChunk(s.request_id, tokens, s.finish_reason is not None, s.finish_reason,
                               s.num_drafted, s.num_accepted, error)

    # -- drafters -------------------------------------------------------------------------
    def _live(self, drafter: int | None) -> bool:
        d = self.drafters.get(drafter) if drafter is not None else None
        return d is not None and time.monotonic() - d["last_seen"] < self.settings.drafter_timeout_s

    def _attach(self, drafter: int, incarnation: str) -> None:
        """A new or restarted drafter (or we restarted): it drops whatever it held ("reset"),
        then is resynchronised on the streams it feeds and adopts orphans."""
        if drafter in self.drafters:
            log.warning("drafter %d restarted (incarnation %s)", drafter, incarnation[:8])
        self.drafters[drafter] = {"incarnation": incarnation, "last_seen": time.monotonic(),
                                  "tree_s": 0.02}
        self.outbox.pop(drafter, None)
        self._send(drafter, Signal("reset", ""))
        for s in self.streams.values():
            if s.admitted and (s.drafter == drafter or s.drafter is None or not self._live(s.drafter)):
                self._assign(s, drafter)

    def _assign(self, s: VerifyStream, drafter: int) -> None:
        if s.drafter is not None and s.drafter != drafter:
            self._send(s.drafter, Signal("leave", s.request_id))
        s.drafter = drafter
        self._resync(s)

    def _resync(self, s: VerifyStream) -> None:
        s.first_tree = True
        ring = self.ring.stream(s.request_id)
        self._drop(ring.bump(ring.epoch + 1))
        params = _sampling_dict(s.params)
        params["seed"] = s.seed + 1   # the drafter's own stream of randomness
        s.unsent, s.sent_budget = [], s.budget
        self._send(s.drafter, Signal("resync", s.request_id, ring.epoch, -1, len(s.committed),
                                     list(s.committed), s.budget, params))

    def _rebalance(self) -> None:
        """Streams of a dead drafter move to a live one, if any (else they decode alone)."""
        live = [i for i in self.drafters if self._live(i)]
        if not live:
            return
        for s in self.streams.values():
            if s.admitted and s.mode != "off" and not self._live(s.drafter):
                load = {i: 0 for i in live}
                for t in self.streams.values():
                    if t.drafter in load:
                        load[t.drafter] += 1
                self._assign(s, min(live, key=load.get))

    def _send(self, drafter: int, sig: Signal) -> None:
        self.outbox[drafter].append(sig)
        self._mail[drafter].set()
        if drafter in self.drafters and _gives_a_tree(sig):
            self.drafters[drafter]["idle"] = False     # a tree to draft: its cores are its own again

    def _unpack_puts(self, drafter: int, puts: list) -> list[TreeHeader]:
        """The headers of a drafter's puts; a malformed one refuses the whole call (WireError)."""
        try:
            if not isinstance(puts, (list, tuple)):
                raise WireError(f"puts must be a list, got {type(puts).__name__}")
            headers = []
            for put in puts:
                if not (isinstance(put, (list, tuple)) and len(put) == 2 and isinstance(put[1], (list, tuple))
                        and len(put[1]) == 1 and isinstance(put[1][0], ray.ObjectRef)):
                    raise WireError("a put is (header bytes, [ObjectRef])")
                headers.append(unpack_header(put[0]))
            return headers
        except WireError as e:
            self.stats.observe_rejected_frame()
            log.error("verifier: rejected a frame from drafter %s: %s", drafter, e)
            raise

    def _put(self, drafter: int, header: TreeHeader, ref) -> None:
        s = self.streams.get(header.stream)
        entry = RingEntry(header, ref)
        if s is None or s.drafter != drafter:
            self._drop([entry])
            return
        ok, dropped = self.ring.put(entry)
        self._drop([e for e in dropped if e is not entry])
        if ok:
            asyncio.get_running_loop().create_task(self._fetch(entry))
        elif entry.header.epoch >= self.ring.stream(s.request_id).epoch:
            self.stats.observe_dropped(1, header.num_nodes)
            self._resync(s)        # the drafter's count of slots disagrees with the ring

    async def _fetch(self, entry: RingEntry) -> None:
        """Pull the tree's tensors from the object store while the target runs."""
        try:
            frame = decode_tree(await entry.ref)
            if frame.header != entry.header:
                raise ValueError("tree frame header differs from its ring entry")
            entry.frame = frame
        except WireError as e:
            self.stats.observe_rejected_frame()
            log.error("verifier: rejected the tree frame of %s: %s", entry.header.stream, e)
            entry.error = f"WireError: {e}"
        except Exception as e:          # owner died, object lost
            entry.error = f"{type(e).__name__}: {e}"
        entry.ref = None
        if self._wake:
            self._wake.set()

    def _drop(self, entries: list[RingEntry]) -> None:
        if entries:
            self.stats.observe_dropped(len(entries), sum(e.header.num_nodes for e in entries))

    # -- the loop ------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except Exception as e:     # a bug: fail the running requests, keep serving
                log.exception("verifier step failed")
                self._error = f"{type(e).__name__}: {e}"
                for s in list(self.streams.values()):
                    self._finish(s, "error", error=f"verifier step failed: {self._error}")
                await asyncio.sleep(0.01)

    async def _step(self) -> None:
        start = time.monotonic()
        await self._reap_and_admit()
        admitted = time.monotonic()        # prefills are not a verification step's cost
        active = [s for s in self.streams.values() if s.prefilled]
        if not active:
            self._wake.clear()
            await self._sleep(self.settings.poll_s)
            return
        self._rebalance()
        batch, deadline = self._collect(active, start)
        if not batch:                      # every sequence waits for its tree: verifier idle
            self._wake.clear()
            await self._sleep(max(0.0, deadline - time.monotonic()))
            waited = time.monotonic() - start
            self.stats.observe_idle(waited)
            self.stats.observe_wall(waited)
            self._idle_carry += waited
            return
        from verifier import VerifyRequest

        drafted = self._drafted(batch)
        threads = self._step_threads(batch, drafted)
        if self._announced:           # bridge chains, drafted on the model thread before the forward
            await self._on_model_thread(self._bridge_chains, batch, threads)
        requests = [VerifyRequest(s.request_id, s.committed[-1], tree, s.params, s.generator)
                    for s, tree, _ in batch]
        borrowed = threads != self.threads
        results, seconds = await self._on_model_thread(self.side.verify, requests, threads)
        self.stats.observe_batch(seconds)
        if borrowed:
            self.stats.observe_borrowed_step()
        rows = sum(1 + t.num_nodes for _, t, _ in batch)
        shapes = self._borrowed_by_rows if borrowed else self._forward_by_rows
        shape = shapes.setdefault(rows, [0, 0.0])
        shape[0] += 1
        shape[1] += seconds
        self._publish(batch, results)
        end = time.monotonic()
        self.stats.observe_wall(end - start)
        # the planner pays what a step really costs: its wall time plus the idle waits before it;
        # plain steps on borrowed cores have their own model (the baseline a plan must beat)
        if drafted and all(self._lockstep(s.drafter) for s, _ in drafted):
            # the drafters drafted these trees while we waited (lockstep): that wait is the
            # draft's cost per level, the forward alone the verification's (a sum, not a max)
            self.lockstep_costs.observe_verify(rows, end - admitted)
            if self._idle_carry > 0:
                levels = max(int(tree.depths.max()) for _, tree in drafted)
                self.lockstep_costs.observe_draft(levels, self._idle_carry)
        else:
            costs = self.plain_costs if borrowed and not drafted else self.overlap_costs
            costs.observe_verify(rows, end - admitted + self._idle_carry)
            if not drafted and not borrowed and self.settings.device != "cpu":
                # on a GPU a one-row forward runs another kernel than a few-row one (fp32 8B on an
                # H200: 12 ms against 19-21 ms for 2-5 rows), which a + b·rows fitted over
                # speculating steps cannot see: plain steps get their own model, the baseline
                self.plain_costs.observe_verify(rows, end - admitted + self._idle_carry)
        self._idle_carry = 0.0

    async def _on_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _reap_and_admit(self) -> None:
        """Free finished sequences' KV and prefill new ones (between forwards, never during)."""
        to_free, self._to_free = self._to_free, []
        joins = []
        budget = self.side.cache.num_blocks - sum(self._reserved_blocks.values())
        running = sum(1 for s in self.streams.values() if s.prefilled)
        while self.joins and running + len(joins) < self.settings.max_batch_size:
            s = self.streams[self.joins[0]]
            need = -(-(len(s.prompt) + s.params.max_tokens + 16 * s.tree_width + 2) // self.settings.block_size)
            if need > self.side.cache.num_blocks:
                self.joins.popleft()
                self._finish(s, "error", error=f"request needs {need} KV blocks; the verifier has "
                             f"{self.side.cache.num_blocks}")
                continue
            if need > budget:
                break                        # wait for running sequences to finish
            budget -= need
            self._reserved_blocks[s.request_id] = need
            joins.append(self.joins.popleft())
        if not to_free and not joins:
            return
        beside = [t.budget for t in self.streams.values() if t.prefilled]
        for rid in joins:
            s = self.streams[rid]
            self.adaptive.add(rid, s.mode, s.spec_len, s.tree_width)
            if s.mode == "auto" and self.settings.lookup:
                self.lookup.add(rid, "auto", s.spec_len, 1)
                self._ngrams[rid] = NgramIndex(3, 2)
        # first budgets planned with the running batch (a tree that a large batch's plan would
        # never allow would also take its steps off the borrowed cores)
        self._plan_overlap()
        extra = self._refilling(len(beside) + len(joins))
        first = self.adaptive.plan_joining(joins, beside + [(0, 0)] * extra,
                                           self._plain_step_s(len(beside) + len(joins) + extra))
        for rid in joins:
            # the drafter hears of the sequence now, so that its prefill and first tree run
            # while the target prefills: the first tree is then waiting, not waited for
            s = self.streams[rid]
            s.admitted = True
            self.ring.add_stream(rid)
            s.budget = self._budget_of(s, first[rid])
            self.stats.observe_join(s.budget[0] > 0)
            live = [i for i in self.drafters if self._live(i)]
            if s.mode != "off" and live:
                load = {i: sum(t.drafter == i for t in self.streams.values()) for i in live}
                self._assign(s, min(live, key=load.get))
        # a prefill, like a plain step, may run on the idle drafters' cores
        threads = self._lendable_threads() if self._drafters_idle() else self.threads
        await self._on_model_thread(self._free_and_prefill, to_free, joins, threads)
        for rid in joins:
            s = self.streams.get(rid)
            if s is None:                    # aborted during its prefill
                self._to_free.append(rid)
                continue
            s.prefilled = True

    def _free_and_prefill(self, to_free: list[str], joins: list[str], threads: int) -> None:
        torch.set_num_threads(threads)           # per call: the step before may have run on lent cores
        for rid in to_free:
            self.side.release(rid)
            if self.bridge_draft is not None:
                self.bridge_draft.release(rid)
        for rid in joins:
            self.side.prefill(rid, self.streams[rid].prompt if rid in self.streams else [0])

    def _collect(self, active: list[VerifyStream], now: float) -> tuple[list, float]:
        """The batch of (stream, tree) to verify now, and when to look again if it is empty."""
        from models.tree import TokenTree

        batch, deadline, alone = [], now + self.settings.poll_s, []
        for s in active[: self.settings.max_batch_size]:
            ring = self.ring.stream(s.request_id)
            entry, dropped = ring.head_valid(s.committed)
            self._drop(dropped)
            if entry is not None and entry.frame is not None:
                ring.pop()
                batch.append((s, self._tree_of(entry), entry.header))
                s.waiting_since, s.first_tree = None, False
                continue
            planned = s.budget[0] > 0 and not s.bridge
            wants = planned and self._live(s.drafter)
            if planned and not wants:      # its drafter is dead, restarting or stuck: decode alone
                self.stats.observe_drafter_absent()
            if wants:
                s.waiting_since = s.waiting_since or now
                late = s.waiting_since + self._patience(s)
                if now < late:
                    deadline = min(deadline, late)
                    continue
                self.stats.observe_fallback()
            s.waiting_since = None
            if not (wants or s.bridge):
                alone.append(len(batch))
            elif s.bridge and self.bridge_draft is not None and \
                    bridge_chain_depth(self.settings, s.params, s.budget[0]) > 0:
                self._announced[s.request_id] = None     # a bridge chain: drafted in `_step`
            s.bridge = False
            batch.append((s, TokenTree.empty(len(s.committed)), None))
        if alone:
            self._lookup_trees(batch, alone)
        return batch, deadline

    def _bridge_chains(self, batch: list, threads: int) -> None:
        """Replace the empty trees of the batch's bridging sequences (`self._announced`) by the
        draft's greedy chains, drafted in one pass; note the outcome each announces. Runs on
        the model thread, on the step's `threads`."""
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        at = {s.request_id: i for i, (s, _, _) in enumerate(batch) if s.request_id in self._announced}
        items = [(rid, batch[i][0].committed, batch[i][0].params, batch[i][0].generator,
                  bridge_chain_depth(self.settings, batch[i][0].params, batch[i][0].budget[0]))
                 for rid, i in at.items()]
        for (rid, *_), (chain, announced) in zip(items, self.bridge_draft.chains(items)):
            batch[at[rid]] = (batch[at[rid]][0], chain, None)
            self._announced[rid] = announced

    def _lookup_trees(self, batch: list, alone: list[int]) -> None:
        """Prompt-lookup chains drafted here (`speculation.planner.plan_lookups`) for sequences of
        `batch` (indices `alone`) that decode alone by plan (not bridging, no tree late), where
        `self.lookup` (γ of these chains per sequence; the step costs of plain steps, on
        borrowed cores where they run there) finds they beat decoding alone. Only in steps
        without a drafter's tree, which run on the cores a plain step would (a mixed batch is
        priced by the drafter's plan instead)."""
        if len(alone) < len(batch) or not self._drafters_idle():
            return
        candidates = [(s.request_id, s.committed, min(s.spec_len, s.max_depth()), s.params.greedy)
                      for s in (batch[i][0] for i in alone) if s.request_id in self.lookup.seqs]
        if not candidates:
            return
        self.lookup.costs = VerifyCosts(self.plain_costs if self._borrowing_measured() else self.overlap_costs)
        chains = plan_lookups(self.lookup, candidates, len(batch) - len(candidates), self.side.vocab_size,
                              self._ngrams)
        for i in alone:
            s = batch[i][0]
            if s.request_id in chains:
                batch[i] = (s, chains[s.request_id], None)

    @staticmethod
    def _drafted(batch: list) -> list:
        """(stream, tree) of the batch's trees drafted by a drafter (not prompt-lookup ones)."""
        return [(s, tree) for s, tree, header in batch if header is not None and tree.num_nodes]

    def _step_threads(self, batch: list, drafted: list | None = None) -> int:
        """The verifier's own threads, or more for a step while no drafter has work: no
        drafter's tree in the batch (prompt-lookup ones may be) and every sequence at budget 0,
        its drafter told so; or, in lockstep, every drafted sequence's one tree in this batch
        (its drafter waits for the step's signal). `drafted`: `_drafted(batch)`, if known."""
        if drafted is None:
            drafted = self._drafted(batch)
        if drafted:
            return self._lendable_threads() if self._drafters_blocked(batch) else self.threads
        return self._lendable_threads() if self._drafters_idle() else self.threads

    def _drafters_blocked(self, batch: list) -> bool:
        """Every stream a drafter serves either has its tree in `batch` and that drafter in
        lockstep (`_lockstep`: one tree in flight), or no work for it: the drafters wait for
        this step's signals."""
        verifying = {s.request_id for s, tree, header in batch if header is not None}
        for s in self.streams.values():
            if not s.admitted or s.drafter is None:
                continue
            if s.request_id in verifying:
                if not self._lockstep(s.drafter):
                    return False
            elif s.budget[0] or s.sent_budget[0] or s.bridge:
                return False
        return True

    def _lockstep(self, drafter: int) -> bool:
        """Whether `drafter` runs in lockstep (one tree in flight, nothing assumed;
        `backends.in_lockstep` from our view: on our GPU, overlapping two processes' forwards
        gains nothing; as a lone stream's CPU drafter on this node with at least our CPUs,
        lending them at least doubles a verification's threads). cluster/actors.py decides
        the same from its side; a stream joining or leaving can leave the two views a step
        apart, which costs speed, never exactness: outcomes and bridges follow the trees'
        own headers."""
        d = self.drafters.get(drafter)
        if d is None:
            return self.settings.ring_slots == 1
        streams = sum(1 for t in self.streams.values() if t.drafter == drafter)
        return in_lockstep(self.settings, streams, self.settings.device == "cpu",
                           d.get("node") or "", d.get("cpus") or 0.0, d.get("gpus"),
                           self.node_id, self.settings.num_cpus, self.gpu_ids)

    def _plan_bridges(self) -> bool:
        """Whether the planner counts bridge steps: not while every drafter runs in lockstep."""
        if self.settings.ring_slots == 1:
            return False
        drafters = {s.drafter for s in self.streams.values() if s.drafter is not None}
        return not drafters or not all(self._lockstep(i) for i in drafters)

    def _plan_overlap(self) -> None:
        """Before a plan: while every drafter runs in lockstep, a step costs the wait for its
        trees plus the forward (`lockstep_costs`, `CostModel.overlap` off) and no bridges
        follow; else drafting runs beside verification and contradicted outcomes bridge
        (`overlap_costs`)."""
        overlapped = self._plan_bridges()
        self.adaptive.bridges = overlapped
        self.adaptive.costs = self.overlap_costs if overlapped else self.lockstep_costs
        if overlapped and not self.overlap_costs.observed and self._borrowing_measured():
            # No step on our own threads measured yet (plain ones run on the drafters' cores
            # too): a speculating step, which gives those cores back, is priced as the
            # measured plain step on our threads alone (ideal scaling), not as the model's
            # prior (52 ms for 16 rows; one thread of this project's CPU took ~210 ms).
            a, b = self.plain_costs.coefficients
            scale = self._lendable_threads(now=False) / self.threads
            self.overlap_costs.prior = (a * scale, b * scale)

    def _refilling(self, rows: int) -> int:
        """Sequences a plan should assume besides the `rows` running now: while plain steps
        borrow the drafters' cores, as many as the batch has lost within the last
        `REFILL_MEMORY_S` (under steady load, sequences that finished are replaced within
        a fraction of a second; a tree given now keeps its drafter busy, and so every step
        on our own threads, while they join). 0 elsewhere."""
        now = time.monotonic()
        recent = self._recent_rows
        recent.append((now, rows))
        while recent and recent[0][0] < now - REFILL_MEMORY_S:
            recent.popleft()
        if not self._borrowing_measured():
            return 0
        return max(0, max(n for _, n in recent) - rows)

    def _drafters_idle(self) -> bool:
        """No stream has work for a drafter: every budget 0, the drafter told so, no bridge."""
        return not any(s.budget[0] or s.sent_budget[0] or s.bridge for s in self.streams.values()
                       if s.admitted and s.drafter is not None)

    def _lendable_threads(self, now: bool = True) -> int:
        """Threads a plain step would run on now: its own plus those of the live drafters that
        have nothing to draft (said so at their last exchange, and signalled nothing since: a
        drafter still finishing a tree would share its cores with the forward, which on two
        cores slows every one of its steps). `now=False`: once the drafters are idle, as they
        will be if every sequence decodes alone (what a plan is weighed against)."""
        live = [d for i, d in self.drafters.items() if self._live(i) and (d.get("idle") or not now)]
        return plain_step_threads(self.settings.plain_threads, self.threads, self.settings.device,
                                  self.node_id, live)

    def _plain_step_s(self, rows: int) -> float | None:
        """What a step of `rows` sequences all decoding alone costs: on borrowed cores, when it
        would borrow now and such steps have been measured; on a GPU, as plain steps measured;
        else None (the planner's own model)."""
        if self._borrowing_measured() or (self.settings.device != "cpu" and self.plain_costs.observed):
            return self.plain_costs.step_time(rows, 0)
        return None

    def _borrowing_measured(self) -> bool:
        """Plain steps would run on borrowed cores (once the drafters are idle: a drafter busy
        with a tree now does not make decoding alone dearer), and such steps have been measured."""
        return self.plain_costs.observed and self._lendable_threads(now=False) != self.threads

    def _patience(self, s: VerifyStream) -> float:
        """How long a sequence may wait for its drafter's tree: a few of its tree times, or
        `max_tree_wait_s` for the first tree after a (re)sync (the drafter prefills first)."""
        if s.first_tree:
            return self.settings.max_tree_wait_s
        tree_s = self.drafters[s.drafter]["tree_s"]
        return min(self.settings.max_tree_wait_s, 3.0 * tree_s + 0.02)

    @staticmethod
    def _tree_of(entry: RingEntry):
        import warnings

        from models.tree import TokenTree

        f = entry.frame
        with warnings.catch_warnings():   # object-store buffers are read-only; nothing writes them
            warnings.simplefilter("ignore", UserWarning)
            probs = None if f.draft_probs is None else torch.from_numpy(f.draft_probs)
            return TokenTree(torch.from_numpy(f.token_ids), torch.from_numpy(f.parent_ids),
                             torch.from_numpy(f.depths), probs, f.header.prefix_len, f.header.epoch)

    def _publish(self, batch: list, results: list) -> None:
        """Commit, stream the tokens out, plan the next budgets, signal the drafters."""
        steps = []
        for (s, tree, header), res in zip(batch, results):
            if s.request_id not in self.streams:     # aborted while the target ran
                continue
            tree_id = -1 if header is None else header.tree_id
            # the drafter announced what it assumed; a contradiction makes it bridge, so do we
            # (after a bridge chain, which announced the draft's path: drafter/streams.py)
            chained = s.request_id in self._announced
            announced = self._announced.pop(s.request_id, None) if chained else \
                (None if header is None else header.outcome)
            s.bridge = announced is not None and announced != res.token_ids
            kept = s.commit(res.token_ids)
            s.num_drafted += tree.num_nodes
            s.num_accepted += res.num_accepted
            depth = int(tree.depths.max()) if tree.num_nodes else 0
            self.stats.observe_verification(tree.num_nodes, res.num_accepted, depth, res.num_accepted)
            if s.restarting and header is not None:
                self.stats.observe_restart_tree(tree.num_nodes, res.num_accepted)
            s.restarting = False
            if chained:
                self.stats.observe_bridge_chain(tree.num_nodes, res.num_accepted)
                self.adaptive.observe(s.request_id, depth, res.num_accepted)   # the draft's own γ
            elif header is None and tree.num_nodes:       # the verifier's own prompt-lookup chain
                self.lookup.observe(s.request_id, depth, res.num_accepted)
                self.stats.observe_lookup(tree.num_nodes, res.num_accepted)
            else:
                self.adaptive.observe(s.request_id, depth, res.num_accepted)
            self.queues[s.request_id].put_nowait(self._chunk(s, kept))
            if s.finish_reason:
                self._finish(s, s.finish_reason, notify=False)
            else:
                steps.append((s, tree_id, kept))
        live = [s for s, _, _ in steps]
        self._plan_overlap()
        extra = self._refilling(len(live))
        plan = self.adaptive.plan([s.request_id for s in live], alone=extra,
                                  plain_step_s=self._plain_step_s(len(live) + extra)) if live else {}
        for s, tree_id, kept in steps:
            s.budget = self._budget_of(s, plan[s.request_id])
            self.stats.observe_speculation(s.budget[0] > 0)
            if s.bridge and restart_tree_depth(self.settings, s.budget[0]):
                # no bridge: the drafter drafts a short restart tree after the committed
                # prefix (this step's signal tells it) and the sequence waits for it
                s.bridge, s.restarting = False, True
                self.stats.observe_restart()
            if s.drafter is None:
                continue
            if s.budget == s.sent_budget == (0, 0) and tree_id == -1:
                # the drafter has nothing to draft and knows it: it hears of these tokens with
                # the next signal it needs instead of once per step (no wake-ups, no calls)
                s.unsent.extend(kept)
                continue
            ring = self.ring.stream(s.request_id)
            self._send(s.drafter, Signal("step", s.request_id, ring.epoch, tree_id,
                                         len(s.committed), s.unsent + kept, s.budget))
            s.unsent, s.sent_budget = [], s.budget
        self.stats.observe_ring(self.ring.total(), self.ring.capacity())
        self._announced.clear()       # a chain's outcome counts for its own step only

    @staticmethod
    def _budget_of(s: VerifyStream, planned: tuple[int, int]) -> tuple[int, int]:
        k, w = planned
        k = min(k, s.max_depth())
        return (k, w) if k > 0 else (0, 0)

