"""`PipelineEngine`: the Engine protocol (speculation/requests.py) over Ray actors.

One *pipeline* is a `VerifierActor` and the `DrafterActor`s feeding it
(DESIGN.md §3, §7); an engine spreads requests over one or more pipelines
(least-loaded). `build_pipeline_engine` places them from the one
`ClusterConfig`: Ray resources per actor (`placement.verifier` /
`placement.drafter`), or one placement group per pipeline with the configured
strategy (`STRICT_SPREAD` puts the verifier and each drafter on different
nodes).

Failure semantics, as the serving layer sees them (docs/internals.md,
"Failure handling"):
- a drafter that dies is restarted by Ray; requests continue, exact, decoding
  alone meanwhile; `health()` says `speculation: false` with a reason while no
  drafter is live (a drafter node lost for good), and `stats()` exports
  `speculation_enabled` / `drafters_alive`;
- a verifier that dies ends each of its requests with one chunk
  `finish_reason="error"` whose message starts with "retryable: ", as soon as
  Ray reports the death (and at worst after `chunk_timeout_s` without a chunk);
  Ray restarts it (`verifier_max_restarts`), its drafters reattach, and new
  requests are served; requests on other pipelines are unaffected;
- a verifier whose node is lost for good is the same fault: its requests fail as above and Ray
  restarts it on a live node that offers its resources (the dead one has left the cluster);
  each pipeline's `VerifierWatch` notices the move, and `health()` says `ok: false` with the
  lost node while the verifier is down, then what happened ("lost node A at T, restarted on
  node B at T2") once it answers again; `down_for_s` tells Serve's health check
  (cluster/serve_app.py) how long it has been waiting; a new request that finds it silent for
  longer than `restart_wait_s` ends at once with a retryable error instead of waiting.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator

import ray

from cluster.actors import node_alive, node_id, remote_classes, settings_dict
from cluster.outputs import OutputClient, OutputLost
from cluster.transport import first_line
from models.kv_cache import prefix_report
from models.presets import is_eagle_spec
from speculation.requests import GenerationChunk, GenerationRequest, error_chunk, resolve_speculation
from speculation.settings import EngineSettings
from speculation.stats import SpecStats

log = logging.getLogger("specflash.cluster")
RETRYABLE = "retryable: "
# Torch's OpenMP threads spin after each parallel region. A drafter that spins steals the core
# its verifier's turn runs on, so drafters wait passively. A lone stream's turns are drafted in the
# verifier's own process, where waking passive threads for every op costs what it costs the
# in-process engine: the verifier keeps libgomp's default, a bounded spin (docs/bench-history.md,
# "the OpenMP wait policy per actor role": embedded pair 32.7 against 21.5 tokens/s with a passive
# verifier; on the micro pair the pipeline's ratio to sync moved within noise). Each role's policy:
# SPECFLASH_<ROLE>_OMP_WAIT_POLICY, else OMP_WAIT_POLICY, else this; "" leaves libgomp's default.
ACTOR_WAIT_POLICY = {"verifier": "", "drafter": "PASSIVE"}
VERIFIER_DIED = "the verifier serving this request died"
OUTPUT_RETRY_S = 60.0      # a consumer that could not connect to a verifier's output socket streams through Ray this long


def _when(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


@dataclass
class VerifierWatch:
    """What the engine last saw of one pipeline's verifier: where it answered from, since when it
    has not, and the last time it came back (from its `health` answers and its requests' failures)."""
    node: str = ""                     # Ray node id of its last answer ("" before the first)
    incarnation: str = ""              # its incarnation id then (a new one = restarted)
    down_since: float | None = None    # wall clock (time.time()) of the first failure since then; None = up
    event: str | None = None           # the last restart, e.g. "lost node A at T, restarted on node B at T2"
    answered_at: float = 0.0           # wall clock of its last chunk or health answer

    def down(self) -> None:
        if self.down_since is None:
            self.down_since = time.time()

    async def gone(self, error: str) -> dict:
        """The pipeline's health while its verifier does not answer."""
        self.down()
        lost = bool(self.node) and not await asyncio.to_thread(node_alive, self.node)
        why = (f"verifier: lost node {self.node} at {_when(self.down_since)}; Ray restarts it on a live node "
               f"that offers its resources" if lost else f"verifier unreachable: {error}")
        return {"ok": False, "error": why, "speculation": False, "lost_node": self.node if lost else None,
                "down_for_s": round(time.time() - self.down_since, 1), "verifier_event": self.event}

    async def answered(self, report: dict) -> dict:
        """The pipeline's health from its verifier's own report; records a restart."""
        node, incarnation = report.get("node_id", ""), report.get("incarnation", "")
        if self.incarnation and incarnation != self.incarnation:
            since = _when(self.down_since or time.time())
            if node != self.node and not await asyncio.to_thread(node_alive, self.node):
                self.event = f"lost node {self.node} at {since}, restarted on node {node} at {_when(time.time())}"
            else:
                self.event = f"restarted on node {node} at {_when(time.time())} (down since {since})"
            log.warning("verifier %s", self.event)
        self.node, self.incarnation, self.down_since, self.answered_at = node, incarnation, None, time.time()
        return {**report, "down_for_s": 0.0, "verifier_event": self.event}


@dataclass
class Pipeline:
    verifier: object                   # ActorHandle of VerifierActor
    drafters: list = field(default_factory=list)
    placement_group: object = None
    active: int = 0                    # requests in flight (routing)
    spawn_drafter: object = None       # index -> a new DrafterActor of this pipeline (drafter autoscaling)
    drafter_indices: list = field(default_factory=list)   # the verifier's id of each of `drafters`
    watch: VerifierWatch = field(default_factory=VerifierWatch)   # health(): where the verifier is, restarts
    output: OutputClient | None = None  # this process's connection for the verifier's chunks (cluster/outputs.py)
    output_retry_at: float = 0.0        # monotonic time before which a failed connection is not tried again
    output_lock: tuple | None = None    # (asyncio.Lock, its event loop) around making `output`


class PipelineEngine:
    """Implements `speculation.requests.Engine`."""

    def __init__(self, pipelines: list[Pipeline], settings: EngineSettings,
                 chunk_timeout_s: float = 300.0, restart_wait_s: float = 30.0) -> None:
        if not pipelines:
            raise ValueError("a PipelineEngine needs at least one pipeline")
        self.pipelines = pipelines
        self.settings = settings
        self.chunk_timeout_s = chunk_timeout_s
        self.restart_wait_s = restart_wait_s     # a request that found its verifier restarting waits
        self.routes: dict[str, int] = {}        # request_id -> pipeline index

    # -- Engine protocol -------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        rid = request.request_id
        if rid in self.routes:
            raise ValueError(f"request id {rid!r} is already running")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        resolve_speculation(request.speculation, self.settings, self.settings.proposers)   # InvalidRequest
        index = min(range(len(self.pipelines)), key=lambda i: self.pipelines[i].active)
        pipe = self.pipelines[index]
        self.routes[rid] = index
        pipe.active += 1
        finished = started = False
        give_up = time.monotonic() + self.restart_wait_s
        stream = None
        try:
            down = await self._down_too_long(pipe)
            if down:              # its node lost, say, and no other taken it yet: retry elsewhere
                finished = True
                yield error_chunk(rid, f"{RETRYABLE}{down}")
                return
            stream = await self._open(pipe, request)
            while not finished:
                chunk = await self._next_chunk(stream, pipe, rid)
                if chunk is None:
                    return
                if not started and VERIFIER_DIED in (chunk.error or "") and time.monotonic() < give_up:
                    # nothing streamed yet: wait for Ray to restart the verifier and submit again
                    await self._abort_on(pipe, rid)
                    await asyncio.sleep(0.5)
                    stream.close()
                    stream = await self._open(pipe, request)
                    continue
                started = True
                finished = chunk.finished
                if not chunk.error:
                    pipe.watch.answered_at = time.time()
                yield chunk
        finally:
            if stream is not None:
                stream.close()
            pipe.active -= 1
            self.routes.pop(rid, None)
            if not finished:
                await self._abort_on(pipe, rid)

    async def abort(self, request_id: str) -> None:
        index = self.routes.get(request_id)
        if index is not None:
            await self._abort_on(self.pipelines[index], request_id)

    async def health(self) -> dict:
        """{"ok", "speculation", "speculation_reason" (None while speculating), "verifier" (what a
        verifier down or restarted says, None when nothing did), "down_for_s" (the longest a
        verifier has not answered, 0 when all do), "pipelines"}."""
        reports = await asyncio.gather(*(self._health_of(p) for p in self.pipelines))
        speculation = any(r.get("speculation") for r in reports)
        reason = None
        if not speculation:
            reasons = sorted({r.get("speculation_reason") or r.get("error") or "unknown" for r in reports})
            reason = "; ".join(reasons)
        said = [r["error"] if r.get("down_for_s") else r.get("verifier_event") for r in reports]
        return {"ok": all(r["ok"] for r in reports), "speculation": speculation,
                "speculation_reason": reason, "verifier": "; ".join(s for s in said if s) or None,
                "down_for_s": max(r.get("down_for_s", 0.0) for r in reports), "pipelines": reports}

    async def stats(self) -> dict:
        """The verifiers' and their drafters' stats added up (`speculation.stats.SpecStats`), with
        the first pipeline's step models and every pipeline's costs."""
        total = SpecStats()
        drafters, locals_, costs, planner = [], [], [], {}
        alive, gc_s, gc_full, raws = 0, 0.0, 0, []
        for p in self.pipelines:
            try:
                raw = await _timed(p.verifier.get_stats.remote(), 5)
            except Exception:    # a dead verifier contributes nothing
                continue
            total = total.merge(SpecStats.from_dict(raw))
            raws.append(raw)
            if raw.get("local_drafter"):        # the verifier's stand-in drafter (cluster/actors.py)
                locals_.append(raw["local_drafter"])
            gc_s += raw.get("gc_s", 0.0)
            gc_full += raw.get("gc_full_collections", 0)
            if not planner:
                planner = {f"planner_{k}": v for k, v in raw.items() if k.endswith("_rows_s")}
            costs.append({k: raw.get(k) for k in ("verify_cost_a_s", "verify_cost_b_s", "draft_level_s",
                                                  "lockstep_draft_level_s", "lockstep_draft_fixed_s",
                                                  "overlap_wait_s", "forward_ms_by_rows",
                                                  "borrowed_forward_ms_by_rows", "cuda_graphs", "warm_up_s",
                                                  "regime", "ms_per_token_by_regime", "planner_verify_ms_by_rows",
                                                  "pool_gamma", "pool_probe_gap")})
            live = raw.get("drafters_live", [])
            alive += len(live)
            ids = getattr(p, "drafter_indices", None) or list(range(len(p.drafters)))
            for i in live:       # a drafter the verifier has not heard from would only time out
                try:
                    drafters.append(await _timed(p.drafters[ids.index(i)].info.remote(), 5))
                except Exception:
                    pass
        drafted = SpecStats()
        for d in drafters + locals_:
            drafted = drafted.merge(SpecStats.from_dict(d))
        out = total.as_dict()
        out.update(costs=costs, drafters=drafters, local_drafters=locals_, drafters_alive=alive, verifier_gc_s=gc_s,
                   verifier_gc_full_collections=gc_full, speculation_enabled=int(alive > 0), **planner)
        # what the drafters did: rollbacks are theirs; wasted nodes, theirs and the ring's drops
        out["drafter_rollbacks"] = out["rollbacks"] = drafted.rollbacks
        out["drafter_tokens_wasted"] = total.drafter_tokens_wasted + drafted.drafter_tokens_wasted
        out.update(prefix_report([d["prefix_cache"] for d in drafters if d.get("prefix_cache")], "draft_"))
        out["prefix_cached_blocks"] = sum(r.get("prefix_cached_blocks", 0) for r in raws)
        out["prefix_evictions"] = sum(r.get("prefix_evictions", 0) for r in raws)
        return out

    # -- helpers ---------------------------------------------------------------------
    async def _open(self, pipe: Pipeline, request: GenerationRequest):
        """Submit a request; its chunks: over this process's connection to the verifier
        (`output_socket`), else a Ray stream; either has `next(timeout)` and `close()`."""
        client = await self._output_client(pipe)
        if client is not None:
            return await client.submit(request)
        return _RayChunks(pipe.verifier.generate.options(num_returns="streaming").remote(
            request.request_id, list(request.prompt_token_ids), asdict(request.sampling),
            asdict(request.speculation), request.prefix_cache))

    async def _output_client(self, pipe: Pipeline) -> OutputClient | None:
        """The pipeline's output connection on the running loop: the one made before while it
        is usable, else a new one; None (Ray streams) when off or it cannot connect."""
        if not self.settings.output_socket or time.monotonic() < pipe.output_retry_at:
            return None
        loop = asyncio.get_running_loop()
        if pipe.output_lock is None or pipe.output_lock[1] is not loop:
            pipe.output_lock = (asyncio.Lock(), loop)
        async with pipe.output_lock[0]:          # requests arriving together share one connection
            return await self._connect_output(pipe)

    async def _connect_output(self, pipe: Pipeline) -> OutputClient | None:
        client = pipe.output
        if client is not None and client.usable():
            return client
        if client is not None:
            client.abandon()
            pipe.output = None
        try:
            client = OutputClient(await _timed(pipe.verifier.output_address.remote(), 10))
        except Exception:                # a dead verifier: the Ray stream's call says so
            return None
        try:
            await client.connect(node_id())
        except Exception as e:           # a port the network refuses: Ray streams for a while
            log.warning("chunks through Ray's streams for %.0f s: no output connection to the verifier (%s)",
                        OUTPUT_RETRY_S, first_line(e))
            pipe.output_retry_at = time.monotonic() + OUTPUT_RETRY_S
            return None
        pipe.output = client
        return client

    async def _next_chunk(self, stream, pipe: Pipeline, rid: str) -> GenerationChunk | None:
        """The next chunk, or a final error chunk when the verifier failed."""
        try:
            return await stream.next(self.chunk_timeout_s)
        except OutputLost as e:
            pipe.watch.down()
            return error_chunk(rid, f"{RETRYABLE}{VERIFIER_DIED} ({e})")
        except asyncio.TimeoutError:
            return error_chunk(rid, f"{RETRYABLE}no progress from the verifier in {self.chunk_timeout_s:.0f} s")
        except ray.exceptions.RayActorError as e:
            pipe.watch.down()
            return error_chunk(rid, f"{RETRYABLE}{VERIFIER_DIED} ({first_line(e)})")
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, ValueError):
                return error_chunk(rid, str(cause.args[0] if cause.args else cause))
            return error_chunk(rid, f"verifier error: {first_line(e)}")
        except ray.exceptions.RayError as e:     # the stream's objects lost with a node, ...
            return error_chunk(rid, f"{RETRYABLE}the verifier's output was lost ({first_line(e)})")

    async def _down_too_long(self, pipe: Pipeline) -> str | None:
        """Why a request should not wait for this pipeline's verifier: it has not answered for
        longer than `restart_wait_s` and still does not (asked again now). A call to an actor Ray
        cannot place would wait for `chunk_timeout_s`."""
        w = pipe.watch
        if w.down_since is None or w.answered_at > w.down_since or time.time() - w.down_since <= self.restart_wait_s:
            return None
        report = await self._health_of(pipe)
        return f"{report['error']} (down {report['down_for_s']:.0f} s)" if report.get("down_for_s") else None

    async def _abort_on(self, pipe: Pipeline, rid: str) -> None:
        """Over the output connection while it is usable (behind the request it may have
        carried, which it cannot overtake; a connection lost aborts its requests anyway), else
        by actor call."""
        client = pipe.output
        try:
            if client is not None and client.usable():
                await client.abort(rid)
            else:
                await _timed(pipe.verifier.abort.remote(rid), 5)
        except Exception:       # the verifier is gone: nothing left to free
            pass

    async def _health_of(self, p: Pipeline) -> dict:
        try:
            report = await _timed(p.verifier.health.remote(), 5)
        except Exception as e:
            return await p.watch.gone(first_line(e))
        return await p.watch.answered(report)

    def kill_pipeline_actors(self) -> None:
        for p in self.pipelines:
            for actor in [p.verifier, *p.drafters]:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass
            if p.placement_group is not None:
                ray.util.remove_placement_group(p.placement_group)

    shutdown = kill_pipeline_actors


async def _timed(ref, seconds: float):
    return await asyncio.wait_for(ref, seconds)


class _RayChunks:
    """A request's chunks as Ray streams them from `VerifierActor.generate`."""

    def __init__(self, stream) -> None:
        self.stream = stream

    async def next(self, timeout: float) -> GenerationChunk | None:
        try:
            ref = await asyncio.wait_for(self.stream.__anext__(), timeout)
        except StopAsyncIteration:
            return None
        return await asyncio.wait_for(ref, timeout)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- building
def settings_from_config(config, **overrides) -> EngineSettings:
    """EngineSettings from an AppArgs' / ClusterConfig's `speculation`, `kv_cache`, `models`,
    `placement` and `serving` blocks."""
    gpu = config.placement.verifier.num_gpus > 0
    base = EngineSettings(**config.speculation.model_dump(), **config.kv_cache.model_dump(),
                          dtype=config.models.dtype, device="cuda" if gpu else "cpu",
                          stream_interval=config.serving.stream_interval)
    return base.model_copy(update=overrides)


def build_pipeline_engine(config=None, *, target_dir: str | None = None, draft_dir: str | None = None,
                          num_pipelines: int = 1, drafter_max_restarts: int = 10,
                          verifier_max_restarts: int = 10, chunk_timeout_s: float = 300.0, ready_timeout_s: float = 300.0,
                          wrap_proposer=None, **overrides) -> PipelineEngine:
    """Start `num_pipelines` pipelines on the running Ray cluster and wait until they serve.

    `config`: a `cluster.config.AppArgs` (or a `ClusterConfig`, which extends it);
    None = the local defaults. `overrides`: EngineSettings fields (num_blocks, ...);
    `wrap_proposer`: a benchmark's instrument around each drafter's draft proposer
    (bench/replay.py).
    """
    from cluster.config import AppArgs

    config = config or AppArgs()
    target_dir, draft_dir = _model_dirs(config, target_dir, draft_dir)
    settings = settings_from_config(config, **overrides)
    if draft_dir is None:            # prompt lookup drafts: no draft model to bridge with
        settings = settings.model_copy(update=dict(bridge_depth=0, proposers=("ngram",)))
    if settings.bridge_depth > 0 and is_eagle_spec(draft_dir):
        raise ValueError("bridge_depth > 0 drafts bridge chains on the verifier, which an EAGLE draft head "
                         "cannot do without the target's features; set speculation.bridge_depth 0")
    drafter_cls, verifier_cls = remote_classes(drafter_max_restarts, verifier_max_restarts)
    placement = config.placement
    pipelines = []
    for _ in range(num_pipelines):
        pg, v_opts, d_opts = _placement(config)
        v_settings = settings_dict(settings, num_cpus=placement.verifier.num_cpus)
        d_settings = settings_dict(settings, num_cpus=placement.drafter.num_cpus,
                                   device="cuda" if placement.drafter.num_gpus > 0 else "cpu")
        # drafters find their verifier by name: an actor handle among a restartable actor's
        # constructor arguments lives in the object store, where Ray cannot yet guarantee it
        # survives for a restart (ray-project/ray#53727); two strings travel inline
        name = (f"specflash-verifier-{uuid.uuid4().hex[:12]}", ray.get_runtime_context().namespace)
        verifier = verifier_cls.options(name=name[0], namespace=name[1], **v_opts).remote(
            target_dir, v_settings, draft_dir)

        def spawn(j: int, name=name, d_opts=d_opts, d_settings=d_settings):
            return drafter_cls.options(**d_opts[j % len(d_opts)]).remote(
                j, name, draft_dir, target_dir, d_settings, wrap_proposer)

        n = config.drafters_per_verifier
        pipelines.append(Pipeline(verifier, [spawn(j) for j in range(n)], pg, spawn_drafter=spawn,
                                  drafter_indices=list(range(n))))
    engine = PipelineEngine(pipelines, settings, chunk_timeout_s)
    try:
        ray.get([p.verifier.ready.remote() for p in pipelines], timeout=ready_timeout_s)
        ray.get([d.ready.remote(ready_timeout_s) for p in pipelines for d in p.drafters],
                timeout=ready_timeout_s)
        for p, h in zip(pipelines, ray.get([p.verifier.health.remote() for p in pipelines], timeout=60)):
            p.watch.node, p.watch.incarnation = h["node_id"], h["incarnation"]     # where each one starts
    except BaseException:
        engine.kill_pipeline_actors()
        raise
    return engine


def _model_dirs(config, target_dir, draft_dir) -> tuple[str, str | None]:
    target_dir = target_dir or config.models.target
    draft_dir = draft_dir or config.models.draft
    if target_dir is None:
        from models import embedded

        target, draft = embedded.default_pair()
        return str(target), str(draft)
    return str(target_dir), None if draft_dir is None else str(draft_dir)


def _placement(config) -> tuple[object, dict, list[dict]]:
    """(placement group or None, verifier options, options of each drafter)."""
    placement = config.placement
    env = {role: actor_env(role) for role in ACTOR_WAIT_POLICY}
    # a placement group reserves room for the most drafters drafter autoscaling may run
    n = max(config.drafters_per_verifier, config.drafter_scaling.max_per_verifier)
    if placement.strategy == "NONE":
        return (None, {**placement.verifier.ray_options(), **env["verifier"]},
                [{**placement.drafter.ray_options(), **env["drafter"]}] * n)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group(placement.bundles(n), strategy=placement.strategy)
    ray.get(pg.ready(), timeout=120)

    def opts(actor, role: str, bundle: int) -> dict:
        return {**actor.ray_options(), **env[role], "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle)}

    return pg, opts(placement.verifier, "verifier", 0), [opts(placement.drafter, "drafter", 1 + j) for j in range(n)]


def actor_env(role: str) -> dict:
    """Ray options giving a `role` actor ("verifier", "drafter") its OpenMP wait policy
    (ACTOR_WAIT_POLICY and the variables that override it) and the step log of the process that
    creates it (`speculation.step_log`, where set); {} for libgomp's default and no log."""
    import os

    from speculation.step_log import ENV as STEP_LOG

    policy = os.environ.get(f"SPECFLASH_{role.upper()}_OMP_WAIT_POLICY",
                            os.environ.get("OMP_WAIT_POLICY", ACTOR_WAIT_POLICY[role]))
    env = {"OMP_WAIT_POLICY": policy} if policy else {}
    if os.environ.get(STEP_LOG):
        env[STEP_LOG] = os.environ[STEP_LOG]
    return {"runtime_env": {"env_vars": env}} if env else {}
