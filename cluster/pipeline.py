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
  requests are served; requests on other pipelines are unaffected.

`run_async_generate(args)` is `specflash generate --mode async`.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import AsyncIterator

import ray

from cluster.actors import PipelineSettings, remote_classes
from speculation.stats import SpecStats
from speculation.requests import GenerationChunk, GenerationRequest
from models.eagle import refuse_in_pipeline

log = logging.getLogger("specflash.cluster")
RETRYABLE = "retryable: "
VERIFIER_DIED = "the verifier serving this request died"


@dataclass
class Pipeline:
    verifier: object                   # ActorHandle of VerifierActor
    drafters: list = field(default_factory=list)
    placement_group: object = None
    active: int = 0                    # requests in flight (routing)
    spawn_drafter: object = None       # index -> a new DrafterActor of this pipeline (drafter autoscaling)
    drafter_indices: list = field(default_factory=list)   # the verifier's id of each of `drafters`


class PipelineEngine:
    """Implements `speculation.requests.Engine`."""

    def __init__(self, pipelines: list[Pipeline], settings: PipelineSettings,
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
        index = min(range(len(self.pipelines)), key=lambda i: self.pipelines[i].active)
        pipe = self.pipelines[index]
        self.routes[rid] = index
        pipe.active += 1
        finished = started = False
        args = (rid, list(request.prompt_token_ids), asdict(request.sampling), asdict(request.speculation))
        give_up = time.monotonic() + self.restart_wait_s
        try:
            stream = pipe.verifier.generate.options(num_returns="streaming").remote(*args)
            while not finished:
                chunk = await self._next_chunk(stream, pipe, rid)
                if chunk is None:
                    return
                if not started and VERIFIER_DIED in (chunk.error or "") and time.monotonic() < give_up:
                    # nothing streamed yet: wait for Ray to restart the verifier and submit again
                    await self._abort_on(pipe, rid)
                    await asyncio.sleep(0.5)
                    stream = pipe.verifier.generate.options(num_returns="streaming").remote(*args)
                    continue
                started = True
                finished = chunk.finished
                yield chunk
        finally:
            pipe.active -= 1
            self.routes.pop(rid, None)
            if not finished:
                await self._abort_on(pipe, rid)

    async def abort(self, request_id: str) -> None:
        index = self.routes.get(request_id)
        if index is not None:
            await self._abort_on(self.pipelines[index], request_id)

    async def health(self) -> dict:
        """{"ok", "speculation", "speculation_reason" (None while speculating), "pipelines"}."""
        reports = await asyncio.gather(*(self._health_of(p) for p in self.pipelines))
        speculation = any(r.get("speculation") for r in reports)
        reason = None
        if not speculation:
            reasons = sorted({r.get("speculation_reason") or r.get("error") or "unknown" for r in reports})
            reason = "; ".join(reasons)
        return {"ok": all(r["ok"] for r in reports), "speculation": speculation,
                "speculation_reason": reason, "pipelines": reports}

    async def stats(self) -> dict:
        total = SpecStats()
        drafters = []
        costs = []
        alive, gc_s, gc_full = 0, 0.0, 0
        planner = {}          # the first pipeline's step models (`VerifierActor.get_stats`)
        for p in self.pipelines:
            try:
                raw = await _timed(p.verifier.get_stats.remote(), 5)
            except Exception:    # a dead verifier contributes nothing
                continue
            total = total.merge(SpecStats.from_dict(raw))
            gc_s += raw.get("gc_s", 0.0)
            gc_full += raw.get("gc_full_collections", 0)
            if not planner:
                planner = {f"planner_{k}": v for k, v in raw.items() if k.endswith("_rows_s")}
            costs.append({k: raw[k] for k in ("verify_cost_a_s", "verify_cost_b_s", "draft_level_s",
                                              "lockstep_draft_level_s") if k in raw})
            costs[-1]["forward_ms_by_rows"] = raw.get("forward_ms_by_rows", {})
            costs[-1]["borrowed_forward_ms_by_rows"] = raw.get("borrowed_forward_ms_by_rows", {})
            costs[-1]["cuda_graphs"] = raw.get("cuda_graphs")
            costs[-1]["warm_up_s"] = raw.get("warm_up_s")
            live = raw.get("drafters_live", [])
            alive += len(live)
            ids = getattr(p, "drafter_indices", None) or list(range(len(p.drafters)))
            for i in live:       # a drafter the verifier has not heard from would only time out
                try:
                    drafters.append(await _timed(p.drafters[ids.index(i)].info.remote(), 5))
                except Exception:
                    pass
        out = total.as_dict()
        out["costs"] = costs
        out["drafters"] = drafters
        out["drafters_alive"] = alive
        out["verifier_gc_s"] = gc_s
        out["verifier_gc_full_collections"] = gc_full
        out.update(planner)
        out["speculation_enabled"] = int(alive > 0)
        out["drafter_rollbacks"] = out["rollbacks"] = sum(d["rollbacks"] for d in drafters)
        out["drafter_tokens_wasted"] = total.drafter_tokens_wasted + sum(d["wasted_nodes"] for d in drafters)
        return out

    # -- helpers ---------------------------------------------------------------------
    async def _next_chunk(self, stream, pipe: Pipeline, rid: str) -> GenerationChunk | None:
        """The next chunk, or a final error chunk when the verifier failed."""
        try:
            ref = await asyncio.wait_for(stream.__anext__(), self.chunk_timeout_s)
            return await asyncio.wait_for(ref, self.chunk_timeout_s)
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError:
            return _error_chunk(rid, f"{RETRYABLE}no progress from the verifier in {self.chunk_timeout_s:.0f} s")
        except ray.exceptions.RayActorError as e:
            return _error_chunk(rid, f"{RETRYABLE}{VERIFIER_DIED} ({_first_line(e)})")
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, ValueError):
                return _error_chunk(rid, str(cause.args[0] if cause.args else cause))
            return _error_chunk(rid, f"verifier error: {_first_line(e)}")
        except ray.exceptions.RayError as e:     # the stream's objects lost with a node, ...
            return _error_chunk(rid, f"{RETRYABLE}the verifier's output was lost ({_first_line(e)})")

    async def _abort_on(self, pipe: Pipeline, rid: str) -> None:
        try:
            await _timed(pipe.verifier.abort.remote(rid), 5)
        except Exception:       # the verifier is gone: nothing left to free
            pass

    async def _health_of(self, p: Pipeline) -> dict:
        try:
            report = await _timed(p.verifier.health.remote(), 5)
        except Exception as e:
            return {"ok": False, "error": f"verifier unreachable: {_first_line(e)}", "speculation": False}
        return report

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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _error_chunk(rid: str, message: str) -> GenerationChunk:
    return GenerationChunk(rid, [], True, "error", error=message)


# ---------------------------------------------------------------- building
def settings_from_config(config, **overrides) -> PipelineSettings:
    """PipelineSettings from an AppArgs' / ClusterConfig's `speculation`, `models` and `placement` blocks."""
    spec = config.speculation
    gpu = config.placement.verifier.num_gpus > 0
    base = PipelineSettings(mode=spec.mode, spec_len=spec.spec_len, tree_width=spec.tree_width,
                            proposer=spec.proposer, ring_slots=spec.ring_slots,
                            lockstep_alone=spec.lockstep_alone,
                            lockstep_shared_gpu=spec.lockstep_shared_gpu,
                            max_batch_size=spec.max_batch_size, lookup=spec.lookup,
                            bridge_depth=spec.bridge_depth, restart_depth=spec.restart_depth,
                            dtype=config.models.dtype,
                            device="cuda" if gpu else "cpu")
    return replace(base, **overrides)


def build_pipeline_engine(config=None, *, target_dir: str | None = None, draft_dir: str | None = None,
                          num_pipelines: int = 1, drafter_max_restarts: int = 10,
                          verifier_max_restarts: int = 10, chunk_timeout_s: float = 300.0, ready_timeout_s: float = 300.0,
                          **overrides) -> PipelineEngine:
    """Start `num_pipelines` pipelines on the running Ray cluster and wait until they serve.

    `config`: a `cluster.config.AppArgs` (or a `ClusterConfig`, which extends it);
    None = the local defaults. `overrides`: PipelineSettings fields (num_blocks, ...).
    """
    from cluster.config import AppArgs

    config = config or AppArgs()
    target_dir, draft_dir = _model_dirs(config, target_dir, draft_dir)
    refuse_in_pipeline(draft_dir)
    settings = settings_from_config(config, **overrides)
    if draft_dir is None:            # prompt lookup drafts: no draft model to bridge with
        settings = replace(settings, bridge_depth=0)
    drafter_cls, verifier_cls = remote_classes(drafter_max_restarts, verifier_max_restarts)
    placement = config.placement
    pipelines = []
    for _ in range(num_pipelines):
        pg, v_opts, d_opts = _placement(config)
        v_settings = replace(settings, num_cpus=placement.verifier.num_cpus)
        d_settings = replace(settings, num_cpus=placement.drafter.num_cpus,
                             device="cuda" if placement.drafter.num_gpus > 0 else "cpu")
        # drafters find their verifier by name: an actor handle among a restartable actor's
        # constructor arguments lives in the object store, where Ray cannot yet guarantee it
        # survives for a restart (ray-project/ray#53727); two strings travel inline
        name = (f"specflash-verifier-{uuid.uuid4().hex[:12]}", ray.get_runtime_context().namespace)
        verifier = verifier_cls.options(name=name[0], namespace=name[1], **v_opts).remote(
            target_dir, asdict(v_settings), draft_dir)
        def spawn(j: int, name=name, d_opts=d_opts, d_settings=d_settings):
            return drafter_cls.options(**d_opts[j % len(d_opts)]).remote(
                j, name, draft_dir, target_dir, asdict(d_settings))

        n = config.drafters_per_verifier
        pipelines.append(Pipeline(verifier, [spawn(j) for j in range(n)], pg, spawn_drafter=spawn,
                                  drafter_indices=list(range(n))))
    engine = PipelineEngine(pipelines, settings, chunk_timeout_s)
    try:
        ray.get([p.verifier.ready.remote() for p in pipelines], timeout=ready_timeout_s)
        ray.get([d.ready.remote(ready_timeout_s) for p in pipelines for d in p.drafters],
                timeout=ready_timeout_s)
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
    # a placement group reserves room for the most drafters drafter autoscaling may run
    n = max(config.drafters_per_verifier, config.drafter_scaling.max_per_verifier)
    if placement.strategy == "NONE":
        return None, placement.verifier.ray_options(), [placement.drafter.ray_options()] * n
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group(placement.bundles(n), strategy=placement.strategy)
    ray.get(pg.ready(), timeout=120)

    def opts(actor, bundle: int) -> dict:
        return {**actor.ray_options(), "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle)}

    return pg, opts(placement.verifier, 0), [opts(placement.drafter, 1 + j) for j in range(n)]



# ---------------------------------------------------------------- specflash generate --mode async
def run_async_generate(args) -> int:
    """`specflash generate --mode async`: a local Ray, one pipeline, one request; same flags and
    JSON as the in-process modes (issue 2 item 5). Raises ValueError / OSError on bad input."""
    import json
    import sys
    import time

    from speculation.requests import SpeculationOptions
    from models.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    proposer = getattr(args, "proposer", "model")
    spec = SpeculationOptions(mode="tree" if args.tree_width > 1 else "chain", spec_len=args.spec_len,
                              tree_width=args.tree_width, proposer=proposer)
    target_dir, draft_dir = _cli_model_dirs(args, proposer)
    from models import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    prompt_ids = _cli_prompt_ids(tokenizer, args.prompt, getattr(args, "chat", False))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    engine = None
    try:
        engine = build_pipeline_engine(None, target_dir=target_dir, draft_dir=draft_dir,
                                       spec_len=args.spec_len, tree_width=args.tree_width, proposer=proposer)
        start = time.perf_counter()
        tokens, last = asyncio.run(_collect(engine, GenerationRequest("cli", prompt_ids, params, spec)))
        seconds = time.perf_counter() - start
        if last is not None and last.finish_reason == "error":
            raise RuntimeError(last.error)
        stats = asyncio.run(engine.stats())
    finally:
        if engine is not None:
            engine.kill_pipeline_actors()
        ray.shutdown()
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    drafted, accepted = last.num_drafted, last.num_accepted
    out_stats = {"drafted": drafted, "accepted": accepted,
                 "acceptance_rate": accepted / drafted if drafted else 0.0,
                 "mean_accepted_len": stats["mean_accepted_len"],
                 "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0,
                 "verifier_idle_fraction": stats["verifier_idle_fraction"]}
    if args.json:
        print(json.dumps({"text": text, "token_ids": tokens, "target": target_dir, "draft": draft_dir,
                          "stats": out_stats}))
    else:
        print(text)
        print(f"[{len(tokens)} tokens, {out_stats['tokens_per_s']:.1f} tokens/s, mode async, acceptance "
              f"{out_stats['acceptance_rate']:.2f}, verifier idle {out_stats['verifier_idle_fraction']:.2f}, "
              f"finish: {last.finish_reason}]", file=sys.stderr)
    return 0


async def _collect(engine, request: GenerationRequest):
    tokens, last = [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        last = chunk
    return tokens, last


def _cli_model_dirs(args, proposer: str) -> tuple[str, str | None]:
    if args.target is None and args.draft is not None:
        raise ValueError("--draft needs --target (the draft must match a named target)")
    if args.target is not None:
        if proposer == "model" and args.draft is None:
            raise ValueError("--mode async with the model proposer needs --draft; or use --proposer ngram")
        if proposer == "model":
            refuse_in_pipeline(args.draft)
        return str(args.target), None if args.draft is None else str(args.draft)
    from models import embedded

    target, draft = embedded.default_pair()
    return str(target), str(draft)


def _cli_prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
