"""The Ray Serve application: `build_app(args)` wires the ingress deployment, nothing more.

    serve run cluster.serve_app:build_app            # the embedded pair, local defaults
    serve build cluster.serve_app:build_app -o serve-config.yaml

`args` is a `cluster.config.AppArgs` (models, placement, speculation, serving,
`engine`, `model_name`). `engine` picks what runs behind the ingress: "pipeline"
(the Ray drafter/verifier pipeline, `cluster.pipeline.PipelineEngine`), "local"
(the in-process engine, `cluster.local.LocalEngine`),
"fake" (the scripted `serving.testing.FakeEngine`, no model) or a
`module:factory` import path; "auto" (default) is the pipeline where it can be
built, else local. `model_name` is the id clients send as `model`.

The one deployment, `SpecflashIngress`, holds the engine and serves the
OpenAI-compatible HTTP routes (`serving.openai_api`) and the gRPC methods
`Generate` / `GenerateStream` (`serving.grpc_service`) that Serve's gRPC proxy
routes to it. The pipeline's actors are placed by `PipelineEngine` from
`placement` (Ray resources or a placement group).

Each replica hosts one verifier pipeline, so Serve scales verifiers by scaling
the deployment (`verifier_scaling`, policy `cluster.autoscaling.PipelineLoadPolicy`
fed by `record_autoscaling_stats`); inside a replica a `DrafterAutoscaler` adjusts
that verifier's drafters (`drafter_scaling`).
"""
from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

from ray import serve

from cluster.autoscaling import SignalWindow, replica_signals, start_drafter_autoscaler
from cluster.config import INGRESS_DEPLOYMENT, AppArgs
from cluster.metrics import mirror_forever

log = logging.getLogger("specflash.serve")


def split_args(args: dict | None) -> tuple[AppArgs, dict]:
    """(AppArgs, {"engine", "model_name"}) from a Serve `args` mapping."""
    app_args = AppArgs.model_validate(dict(args or {}))
    return app_args, {"engine": app_args.engine, "model_name": app_args.model_name}


def model_dirs(app_args: AppArgs) -> tuple[str, str | None]:
    """The target and draft directories: as configured, or the embedded pair."""
    m = app_args.models
    if m.target is not None:
        return m.target, m.draft
    from models import embedded

    target, draft = embedded.default_pair()
    return str(target), str(draft)


def make_engine(kind: str, app_args: AppArgs):
    """(engine, tokenizer, max_context): blocking; call it off the event loop."""
    from models import load_tokenizer
    from models.loader import load_config

    if kind == "fake":
        from serving.testing import FakeEngine, tiny_byte_tokenizer

        tokenizer = tiny_byte_tokenizer()
        return FakeEngine(tokenizer=tokenizer, delay_s=0.01), tokenizer, 2048
    if ":" in kind:
        module, _, attr = kind.partition(":")
        return getattr(importlib.import_module(module), attr)(app_args)
    target, draft = model_dirs(app_args)
    max_context = load_config(target).max_position_embeddings
    if kind in ("auto", "pipeline"):
        try:
            from cluster.pipeline import build_pipeline_engine
        except ImportError:
            if kind == "pipeline":
                raise
        else:
            engine = build_pipeline_engine(app_args, target_dir=target, draft_dir=draft)
            return WithKVUsage(engine), load_tokenizer(target), max_context
    from cluster.local import build_local_engine
    from cluster.pipeline import settings_from_config

    engine, tokenizer = build_local_engine(target, draft, settings_from_config(app_args))
    return engine, tokenizer, max_context


# A verifier that does not answer is being restarted by Ray: a process crash costs seconds, its
# node lost for good the node's death noticed (~15-30 s) and the model loaded again on another
# node. The replica waits this long for it before it declares itself unhealthy so that Serve
# replaces it (a verifier that cannot be placed again, or has exhausted `verifier_max_restarts`).
VERIFIER_RESTART_GRACE_S = 180.0


def replace_replica(health: dict, grace_s: float = VERIFIER_RESTART_GRACE_S) -> str | None:
    """Why Serve should replace this replica, from its engine's `health()`; None to keep it: the
    engine serves, or only waits (less than `grace_s`) for Ray to restart a verifier."""
    if health.get("ok"):
        return None
    down_for = health.get("down_for_s", 0.0)
    if 0 < down_for < grace_s and all(p.get("ok") or p.get("down_for_s") for p in health.get("pipelines", [])):
        return None
    if down_for >= grace_s:
        return f"a verifier has not come back in {down_for:.0f} s: {health.get('verifier')}"
    return f"engine unhealthy: {health}"


class WithKVUsage:
    """A PipelineEngine whose `stats()` also reports its verifiers' KV-cache blocks
    (`kv_blocks_free`, `kv_blocks_total`: what /metrics exports and the tests watch)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def stats(self) -> dict:
        out = dict(await self.engine.stats())
        if "kv_blocks_free" in out:
            return out
        free = total = 0
        for p in getattr(self.engine, "pipelines", []):
            try:
                usage = await asyncio.wait_for(p.verifier.kv_usage.remote(), 5)
            except Exception:  # a verifier down: its blocks are not counted
                continue
            free, total = free + usage["free"], total + usage["total"]
        out.update(kv_blocks_free=free, kv_blocks_total=total)
        return out


@serve.ingress()
class SpecflashIngress:
    """HTTP (FastAPI, built per replica) and gRPC front over one injected engine."""

    async def __init__(self, app_args: dict) -> None:
        from serving.access import load_api_keys
        from serving.grpc_service import GrpcService
        from serving.openai_api import OpenAIServer, ServerSettings

        args, extra = split_args(app_args)
        load_api_keys(args.serving.api_key_env, args.serving.api_key_file)  # fail before loading models
        self.engine, tokenizer, max_context = await asyncio.to_thread(make_engine, extra["engine"], args)
        settings = ServerSettings.from_config(args.serving, extra["model_name"], max_context)
        self.server = OpenAIServer(self.engine, tokenizer, settings)
        self.grpc = GrpcService(self.server)
        self.signals = SignalWindow()
        self.drafter_scaler = start_drafter_autoscaler(self.engine, args)
        # this replica's metrics, labelled deployment/replica, through Ray's metrics agents
        self.metrics_mirror = asyncio.get_running_loop().create_task(mirror_forever(self.server))

    def __serve_build_asgi_app__(self):
        from serving.openai_routes import build_fastapi_app

        return build_fastapi_app(self.server)

    # Serve's gRPC proxy calls these by the RPC's name; `grpc_context` (a
    # RayServegRPCContext) carries the status code of an error back to the client.
    async def Generate(self, request, grpc_context=None):  # noqa: N802
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(self, request, grpc_context=None):  # noqa: N802
        async for msg in self.grpc.generate_stream(request, grpc_context):
            yield msg

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook: this replica's load for `cluster.autoscaling.PipelineLoadPolicy`."""
        try:
            stats = await self.engine.stats()
        except Exception:   # an engine that cannot answer: report only what the ingress knows
            stats = {}
        return replica_signals(self.signals, stats, self.server.outstanding)

    async def drain(self, timeout_s: float | None = None) -> dict:
        """Stop admitting (503, /health "draining"), let in-flight requests finish within
        `timeout_s` (default serving.drain_timeout_s), fail the rest with a clear error.
        `specflash serve` calls it on every replica on SIGTERM, before Serve stops them."""
        report = await self.server.drain(timeout_s)
        log.info("specflash ingress drained: %s", report)
        return {**report, "replica": serve.get_replica_context().replica_tag}

    async def check_health(self) -> None:
        """Serve's replica health check (`replace_replica`)."""
        why = replace_replica(await self.engine.health())
        if why:
            raise RuntimeError(why)

    def __del__(self):
        mirror = getattr(self, "metrics_mirror", None)
        if mirror is not None:
            mirror.cancel()
        server = getattr(self, "server", None)
        if server is not None:
            server.begin_shutdown()
        shutdown = getattr(getattr(self, "engine", None), "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:
                pass


def build_app(args: dict[str, Any] | None = None):
    """The Serve application for `serve run` / `serve build` / a Serve config file."""
    app_args, _ = split_args(args)
    s = app_args.serving
    deployment = serve.deployment(
        SpecflashIngress, name=INGRESS_DEPLOYMENT,
        # Serve must not queue in front of the ingress: admission (429) happens inside.
        max_ongoing_requests=s.max_queue + 16,
        # one verifier pipeline per replica: the verifier count is this deployment's replica count
        autoscaling_config=app_args.verifier_scaling.autoscaling_config(),
        ray_actor_options=app_args.placement.ingress.ray_options(),
        health_check_period_s=10, health_check_timeout_s=30,
        **s.graceful_shutdown_options(),  # never kills a replica with a request still running
        **s.routing_options(),            # session affinity: a conversation stays where its cache is
    )
    return deployment.bind(app_args.model_dump(mode="json"))


# An Application object for tools that want one rather than a builder (`serve build
# cluster.serve_app:app`); binding is cheap and starts nothing.
app = build_app({})
