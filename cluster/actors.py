"""The drafter and verifier as Ray actors: thin shells over the Ray-free runtimes (DESIGN.md §3, §7).

`VerifierActor` is an asyncio actor whose `verifier.loop.EngineLoop` (over the scheduler,
verifier/scheduler.py) runs inline on an `EngineThread`, the thread that built its models:
Ray's event loop only hands that thread requests, exchanges and aborts and streams its
chunks back. Its `exchange` method is where remote drafters deliver trees and take signals
(long-polling while none are queued: the drafters' backpressure). `DrafterActor` runs the
drafter's loop (drafter/runtime.py) on a thread of its own over a `cluster.transport.RayLink`.

Both may be restarted by Ray (`max_restarts`, `remote_classes`) at any time. A restarted
drafter attaches under a new incarnation id and is resynchronised. A restarted verifier comes
back empty under a new incarnation id, its old requests having failed with a retryable error
on the caller's side (cluster/pipeline.py), and tells every drafter that attaches to drop
what it held ("reset", speculation/wire.py). A malformed or version-mismatched frame is
logged, counted (`frames_rejected`) and refused; the actor keeps serving.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import defaultdict

import ray
import torch

from cluster.exchange_socket import ExchangeAddress, ExchangeServer, SocketLink
from cluster.outputs import OutputAddress, OutputServer
from cluster.transport import RayLink, fetch_tree, unpack_puts
from models.grammar import preload_vocabulary
from speculation.policy import threads_of
from speculation.requests import SpeculationOptions, error_chunk
from speculation.settings import MAX_BRIDGE_DEPTH, EngineSettings
from speculation.transport import Exchange
from speculation.wire import WireError, encode_signals

log = logging.getLogger("specflash.cluster")
LOCAL_DRAFTER = 1 << 20       # the index of a verifier's stand-in drafter (far from the drafter actors')
# a health or KV report the engine's thread has not given in this long (it is in a forward, a
# long prefill on a CPU, say) is answered from its last one: callers give up after 5 s
REPORT_WAIT_S = 1.0


def node_id() -> str:
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def node_alive(node: str) -> bool:
    """Whether Ray counts the node `node` (a node id) among its live ones."""
    return any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())


def gpu_ids(device: str) -> list[str] | None:
    """The GPUs Ray gave this actor (ids as Ray names them), [] where it named none; None off a
    GPU (`device` "cpu")."""
    if device == "cpu":
        return None
    if not ray.is_initialized():
        return []
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class VerifierActor:
    def __init__(self, target_dir: str, settings: dict, draft_dir: str | None = None) -> None:
        """`draft_dir`: the draft model, for bridge chains (`bridge_depth` > 0; unused otherwise).
        The models are built and warmed up on the engine's thread, which then runs them and
        the engine's loop: a second thread's OpenMP team would slow every forward, and a
        hand-off a step to a model thread costs more than a small forward (verifier/loop.py)."""
        from models.presets import is_eagle_spec
        from verifier.loop import EngineThread

        self.settings = st = EngineSettings(**settings)
        chains = st.bridge_depth > 0 and "model" in st.proposers
        if chains and draft_dir is None:
            raise ValueError("bridge_depth > 0 needs the draft model on the verifier (draft_dir)")
        eagle = "model" in st.proposers and is_eagle_spec(draft_dir)     # its drafters read our features
        if chains and eagle:
            raise ValueError("bridge_depth > 0 drafts bridge chains with the draft model, which an EAGLE head "
                             "cannot do without the target's features; set bridge_depth 0")
        self.incarnation = uuid.uuid4().hex
        self.engine = EngineThread("verifier-engine")
        self.engine.build(self._build(target_dir, draft_dir, chains, eagle))
        self.exchanges = ExchangeServer(self.incarnation, node_id(), ray.util.get_node_ip_address(), self._exchange)
        # requests and their chunks over a socket (`output_address`), on the engine's loop
        self.outputs = OutputServer(self.incarnation, node_id(), ray.util.get_node_ip_address(),
                                    self._output_message, self._consumer_gone)
        self._relays: dict[str, dict[str, asyncio.Task]] = defaultdict(dict)   # consumer token -> rid -> relay

    async def _build(self, target_dir: str, draft_dir: str | None, chains: bool, eagle: bool) -> None:
        """The models, the scheduler and its loop (started), on the engine's thread."""
        from verifier.loop import EngineLoop

        self.scheduler, self.local, self.warm_up_s = self._models(target_dir, draft_dir, chains, eagle)
        preload_vocabulary(target_dir)     # a structured request's first mask does not wait for it
        self.scheduler.fetch = self._fetch
        self.loop = EngineLoop(self.scheduler, self.local, inline=True)
        if self.local is not None:
            self.local.attach(self.scheduler)
            self.scheduler.registry.local = LOCAL_DRAFTER
        self._mail: dict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self._polling: set[int] = set()    # drafters waiting in an exchange (a long-poll) now
        self._replying: set[object] = set()   # exchanges answered here, not yet back on Ray's loop
        self.loop.replies_due = self._replies_due
        self.scheduler.registry.on_mail = lambda drafter: self._mail[drafter].set()
        # the last health and KV reports, and when the engine's thread gave them (`_report`)
        self._reports = {"health": self.scheduler.health(), "kv_usage": self.scheduler.kv_usage()}
        self._reported_at = time.monotonic()
        self.loop.ensure_running()

    def _models(self, target_dir: str, draft_dir: str | None, chains: bool, eagle: bool):
        """(scheduler, stand-in drafter or None, warm-up seconds)."""
        from drafter.draft_side import BridgeDraft
        from models.presets import eagle_feature_layers, eos_of
        from verifier.scheduler import Scheduler
        from verifier.target import TargetSide

        st = self.settings
        torch.set_num_threads(threads_of(st.num_cpus))
        side = TargetSide(target_dir, st.num_blocks, st.block_size, st.device, st.dtype, features=eagle,
                          prefix_caching=st.prefix_caching,
                          feature_layers=eagle_feature_layers(draft_dir) if eagle else ())
        # a GPU compiles and captures; a CPU pays its first forwards' one-time costs (the first
        # request's TTFT on the embedded pair: 1.9-2.1 s cold, 0.3 s warmed up)
        warm_up_s = side.warm_up(st.spec_len, width=st.tree_width)
        bridge = None
        if chains:
            bridge = BridgeDraft(draft_dir, target_dir, st)
            warm_up_s += bridge.warm_up(min(st.bridge_depth, MAX_BRIDGE_DEPTH))
        scheduler = Scheduler(side, st, eos_ids=eos_of(target_dir), bridge_draft=bridge,
                              node_id=node_id(), gpu_ids=gpu_ids(st.device))
        local, local_s = self._local_drafter(draft_dir, target_dir)
        return scheduler, local, warm_up_s + local_s

    def _local_drafter(self, draft_dir: str | None, target_dir: str):
        """The stand-in drafter in this process (`lockstep_in_verifier`): a lone stream whose
        drafter shares our cores or GPU takes turns with us either way, so its turns are
        drafted here, by a copy of the draft, without a call between processes. Returns (it or
        None, its warm-up seconds)."""
        st = self.settings
        if not st.lockstep_in_verifier or draft_dir is None or "model" not in st.proposers:
            return None, 0.0
        from drafter.draft_side import DraftSide
        from drafter.runtime import Drafter
        from models.presets import config_of
        from verifier.inprocess import InProcessDrafters

        here = st.model_copy(update=dict(ring_slots=1))
        side = DraftSide.build(draft_dir, config_of(target_dir).vocab_size, here)
        warm_up_s = side.warm_up(st.spec_len)
        drafter = Drafter(LOCAL_DRAFTER, side, here, node_id(), gpu_ids(st.device))
        return InProcessDrafters([drafter], st.num_cpus), warm_up_s

    # -- called through Ray ----------------------------------------------------------------
    async def ready(self) -> bool:
        await self.engine.call(self.loop.ensure_running)
        return True

    async def generate(self, request_id: str, prompt: list[int], sampling: dict, speculation: dict,
                       prefix_cache: bool = True):
        """Async generator of GenerationChunk; Ray streams each one to the caller."""
        from models.sampling import SamplingParams

        chunks = self.loop.generate(request_id, prompt, SamplingParams(**sampling),
                                    SpeculationOptions(**speculation), prefix_cache)
        async for chunk in self.engine.stream(chunks):
            yield chunk

    # -- requests and chunks over a socket (cluster/outputs.py) ------------------------------
    async def output_address(self) -> OutputAddress:
        """Where a consumer connects to send requests and take their chunks, served on the
        engine's loop (listening from the first call)."""
        return await self.engine.run(self.outputs.start())

    def _output_message(self, consumer: str, message: list) -> None:
        """A consumer's message, on the engine's loop: a request, taken now (an abort behind it on
        the connection finds it) and its chunks relayed to the consumer's connection as the
        steps commit them; or an abort. ValueError: neither (the connection is closed)."""
        from models.sampling import SamplingParams

        kind, args = message[0], message[1:]
        if kind == "abort" and len(args) == 1 and isinstance(args[0], str):
            self.scheduler.abort(args[0])
            return
        if not (kind == "submit" and len(args) == 5 and isinstance(args[0], str)):
            raise ValueError(f"not a request or an abort: {kind!r} with {len(args)} fields")
        rid, prompt, sampling, speculation, prefix_cache = args
        chunks = error = None
        try:
            queue = self.loop.add(rid, prompt, SamplingParams(**sampling), SpeculationOptions(**speculation),
                                  bool(prefix_cache))
            chunks = self.loop.chunks(rid, queue)
        except ValueError as e:           # refused (a bad request, an id already running)
            error = str(e.args[0] if e.args else e)
        except Exception as e:            # fields that do not make options (a consumer of another build)
            error = f"verifier error: {type(e).__name__}: {e}"
        task = asyncio.ensure_future(self._relay(consumer, rid, chunks, error))
        self._relays[consumer].setdefault(rid, task)     # a second of one id was refused above

    async def _relay(self, consumer: str, rid: str, chunks, error: str | None) -> None:
        """A request's chunks to its consumer; its refusal or failure as a last error chunk, as the
        consumer reads a Ray stream's (cluster/pipeline.py). A consumer gone cancels this, which
        aborts the request (`EngineLoop.chunks`)."""
        try:
            if chunks is not None:
                async for chunk in chunks:
                    if not await self.outputs.send(consumer, chunk):
                        break
        except Exception as e:
            log.exception("verifier: request %s failed", rid)
            error = f"verifier error: {type(e).__name__}: {e}"
        finally:
            if chunks is not None:
                await chunks.aclose()
            relays = self._relays.get(consumer, {})
            if relays.get(rid) is asyncio.current_task():
                del relays[rid]
        if error is not None:
            await self.outputs.send(consumer, error_chunk(rid, error))

    def _consumer_gone(self, consumer: str) -> None:
        for task in self._relays.pop(consumer, {}).values():
            task.cancel()

    async def abort(self, request_id: str) -> bool:
        return await self.engine.call(self.scheduler.abort, request_id)

    async def exchange(self, *args, **kwargs) -> bytes:
        """Drafter -> verifier: `_exchange`, run on the engine's loop."""
        call = object()              # filed in `_replying` once the engine's loop has answered it
        try:
            return await self.engine.run(self._exchange(*args, answer=call, **kwargs))
        finally:                     # back on Ray's loop: the reply is on its way (or the call failed)
            self._replying.discard(call)

    def _replies_due(self) -> bool:
        """Whether a drafter waiting in an exchange has signals it has not taken yet, or an
        exchange answered on the engine's loop has not reached Ray's loop yet (the loop's
        `replies_due`: it holds a prefill back until they are out)."""
        reg = self.scheduler.registry
        return bool(self._replying) or any(reg.has_mail(d) for d in list(self._polling))

    async def _exchange(self, drafter: int, incarnation: str, puts: list, wait_s: float,
                        draft_s: float = 0.0, draft_levels: int = 0, resync: list | tuple = (),
                        node: str = "", cpus: float = 0.0, gpus: list | None = None,
                        idle: bool | None = None, *, answer: object | None = None) -> bytes:
        """Drafter -> verifier (`speculation.transport.Exchange`, positionally): file its trees
        in the ring; return the signals queued for it, waiting up to `wait_s` for one. `answer`:
        the call's token, kept in `_replying` from here until Ray's loop has the reply."""
        self.loop.ensure_running()
        try:
            trees = unpack_puts(puts, self.scheduler.target.vocab_size)   # refuses the whole call on a bad frame
        except WireError as e:
            self.scheduler.stats.observe_rejected_frame()
            log.error("verifier: rejected a frame from drafter %s: %s", drafter, e)
            raise
        self.scheduler.receive(Exchange(drafter, incarnation, trees, wait_s, draft_s, draft_levels, list(resync),
                                        node, cpus, gpus, idle))
        mail = self._mail[drafter]
        if not self.scheduler.registry.has_mail(drafter) and wait_s > 0:
            from verifier.loop import wait_event
            mail.clear()
            self._polling.add(drafter)
            try:
                await wait_event(mail, wait_s)
            finally:
                self._polling.discard(drafter)
        frame = encode_signals(self.scheduler.signals_for(drafter))
        if answer is not None:
            self._replying.add(answer)
        return frame

    async def exchange_address(self) -> ExchangeAddress:
        """Where a drafter connects for its exchanges (cluster/exchange_socket.py), served on the
        engine's loop (listening from the first call)."""
        return await self.engine.run(self.exchanges.start())

    async def health(self) -> dict:
        return {**await self._report("health", self.scheduler.health), "incarnation": self.incarnation,
                "node_id": node_id(),
                # drafters' exchanges answered over sockets (cluster/exchange_socket.py), connections open
                "socket_exchanges": self.exchanges.served, "exchange_connections": self.exchanges.connections,
                # chunks written to consumers' output connections (cluster/outputs.py), and those open
                "output_chunks": self.outputs.sent, "output_connections": len(self.outputs.consumers)}

    async def _report(self, name: str, fn) -> dict:
        """`fn()` on the engine's thread; where that thread is in a forward for longer than
        REPORT_WAIT_S, its last report with `engine_busy_s` (the seconds since it last gave
        one): a long forward is not a dead verifier."""
        try:
            report = await asyncio.wait_for(self.engine.call(fn), REPORT_WAIT_S)
        except asyncio.TimeoutError:
            return {**self._reports[name], "engine_busy_s": round(time.monotonic() - self._reported_at, 3)}
        self._reports[name], self._reported_at = report, time.monotonic()
        return report

    async def get_stats(self) -> dict:
        return await self.engine.call(self._stats)

    def _stats(self) -> dict:
        from verifier.loop import gc_report

        local = None if self.local is None else {**self.local.drafters[0].stats.as_dict(),
                                                  "ms_per_row_by_threads": self.local.report()}
        return {**self.scheduler.report(), "warm_up_s": self.warm_up_s, "local_drafter": local, **gc_report()}

    async def kv_usage(self) -> dict:
        return {**await self._report("kv_usage", self.scheduler.kv_usage), "rss_bytes": rss_bytes(),
                "incarnation": self.incarnation}

    def shutdown(self) -> None:
        """The exchange and output sockets closed, the engine's loop task ended, then its thread (tests; Ray
        ends an actor's process)."""
        self.engine.loop.call_soon_threadsafe(self.exchanges.close)
        self.engine.loop.call_soon_threadsafe(self.outputs.close)
        self.engine.close(self.loop)

    # -- trees from the object store -------------------------------------------------------
    def _fetch(self, entry) -> None:
        """A remote drafter's tree is in the object store; the stand-in's is the tree itself."""
        if not isinstance(entry.payload, ray.ObjectRef):
            entry.tree = entry.payload
            return
        asyncio.get_running_loop().create_task(self._fetch_and_wake(entry))

    async def _fetch_and_wake(self, entry) -> None:
        await fetch_tree(entry)
        if entry.error and entry.error.startswith("WireError"):
            self.scheduler.stats.observe_rejected_frame()
            log.error("verifier: rejected the tree frame of %s: %s", entry.header.stream, entry.error)
        self.scheduler.on_work()


class DrafterActor:
    def __init__(self, index: int, verifier, draft_dir: str | None, target_dir: str,
                 settings: dict, wrap_proposer=None) -> None:
        """`verifier`: its VerifierActor, as a handle or as the (name, namespace) it was created
        under (what `build_pipeline_engine` passes). `wrap_proposer`: a benchmark's instrument
        around the draft model's proposer (bench/replay.py). The draft is built and warmed up
        on the loop's thread, which then runs it (one OpenMP team: verifier/loop.py)."""
        settings = EngineSettings(**settings)
        self.link = SocketLink(verifier, node_id()) if settings.exchange == "socket" else RayLink(verifier)
        self._stopped, built = threading.Event(), concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(built, index, draft_dir, target_dir, settings,
                                                                  wrap_proposer), name="drafter-loop", daemon=True)
        self._thread.start()
        self.drafter, self.warm_up_s = built.result()

    def _main(self, built, index: int, draft_dir: str | None, target_dir: str, settings: EngineSettings,
              wrap_proposer) -> None:
        """The loop's thread: build the drafter (its result or error to `built`), then run it."""
        from drafter.draft_side import DraftSide
        from drafter.runtime import Drafter
        from models.presets import config_of

        try:
            torch.set_num_threads(threads_of(settings.num_cpus))
            side = DraftSide.build(draft_dir, config_of(target_dir).vocab_size, settings, wrap=wrap_proposer)
            drafter = Drafter(index, side, settings, node_id(), gpu_ids(settings.device))
            warm_up_s = side.warm_up(settings.spec_len)
            preload_vocabulary(target_dir)     # grammars name the target's tokenizer (models/grammar.py)
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result((drafter, warm_up_s))
        drafter.run(self.link, self._stopped)

    def ready(self, timeout_s: float = 60.0) -> bool:
        """True once the drafter has attached to its verifier."""
        return self.drafter.attached.wait(timeout_s)

    def info(self) -> dict:
        d = self.drafter
        cache = d.side.cache
        return {"index": d.index, "incarnation": d.incarnation, "streams": len(d.streams),
                "running": self._thread.is_alive(), "error": d.error, **d.stats.as_dict(),
                "attached": d.attached.is_set(),      # an exchange with the verifier went through
                # exchanges over the socket (cluster/exchange_socket.py), those lost, and whether it
                # exchanges by actor call now (the setting's choice, or a socket that would not connect)
                "socket_exchanges": getattr(self.link, "exchanges", 0),
                "socket_exchanges_lost": getattr(self.link, "lost", 0),
                "exchanges_by_call": getattr(self.link, "by_call", True),
                "node_id": node_id(), "rss_bytes": rss_bytes(),
                "kv_free": None if cache is None else cache.num_free_blocks,
                "kv_total": None if cache is None else cache.num_blocks,
                "prefix_cache": None if cache is None else cache.prefix_stats(),
                "cuda_graphs": None if d.side.graphs is None else d.side.graphs.stats(),
                "warm_up_s": self.warm_up_s}

    def call_proposer(self, method: str, *args):
        """A method of the draft model's proposer (a benchmark's instrument, bench/replay.py)."""
        return getattr(self.drafter.side.model, method)(*args)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self.link.close()


def remote_classes(drafter_max_restarts: int = 10, verifier_max_restarts: int = 10):
    """(`ray.remote(DrafterActor)`, `ray.remote(VerifierActor)`) with their fixed options.

    Both restart on failure (-1 = without limit) and their in-flight calls are not retried:
    a restarted drafter is resynchronised by the verifier; a restarted verifier comes back
    empty, so the requests it was serving fail with a retryable error (cluster/pipeline.py)
    and new ones are served.
    """
    drafter = ray.remote(max_restarts=drafter_max_restarts, max_task_retries=0,
                         max_concurrency=4)(DrafterActor)
    verifier = ray.remote(max_restarts=verifier_max_restarts, max_task_retries=0,
                          max_concurrency=1000)(VerifierActor)
    return drafter, verifier


def settings_dict(settings: EngineSettings, **overrides) -> dict:
    """Settings as an actor's constructor takes them (plain data through Ray)."""
    return settings.model_copy(update=overrides).model_dump()
