"""The HTTP / gRPC front's settings: ports, queue, timeouts, API keys, drain."""
from __future__ import annotations

import re

from pydantic import Field, model_validator

from cluster.config.base import _Model

# Ray Serve's router that hashes a request's session id (the proxy reads it from the
# `x-session-id` header, or RAY_SERVE_SESSION_ID_HEADER_KEY's) onto a ring of the replicas
SESSION_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


class ServingConfig(_Model):
    host: str = Field("127.0.0.1", description="HTTP bind address (0.0.0.0 in a cluster).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port (OpenAI-compatible API).")
    grpc_port: int = Field(9000, ge=1, le=65535, description="gRPC port (Generate / GenerateStream).")
    max_queue: int = Field(256, ge=1, description="Requests waiting per ingress replica before 429/503.")
    request_timeout_s: float = Field(600.0, gt=0, description="A request running longer is aborted.")
    api_key_env: str | None = Field(
        None,
        description="Environment variable holding the API key(s) clients must send as `Authorization: "
        "Bearer <key>`, one per line; None = no key. On Kubernetes it is set from the Secret "
        "`<name>-api-key`, key `api-key`.",
    )
    api_key_file: str | None = Field(
        None,
        description="File holding the API key(s), one per line (instead of api_key_env). On Kubernetes the "
        "Secret `<name>-api-key` (key `api-key`) is mounted read-only at this path.",
    )
    auth_health: bool = Field(False, description="/health needs the API key too (default open, for probes).")
    auth_metrics: bool = Field(False, description="/metrics needs the API key too (default open, for scrapers).")
    max_concurrent_per_key: int | None = Field(
        None, ge=1, description="Generations one API key may have admitted at once (429 above); None = only "
        "max_queue. Without a configured key there is no per-key limit.",
    )
    stream_interval: int = Field(
        1, ge=1, description="Tokens a streamed chunk of a request carries at least (its first and last go at "
        "once); larger values cost the engine fewer chunks (`speculation.settings.EngineSettings`).",
    )
    max_request_bytes: int = Field(4 << 20, ge=1024, description="Larger request bodies get 413.")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On shutdown, how long in-flight requests may still run before they are "
        "failed with a clear error; new requests get 503 meanwhile.",
    )
    session_affinity: bool = Field(
        False, description="Route every request carrying the same `X-Session-Id` header (gRPC: `session_id` "
        "metadata) to the same ingress replica, whose prefix cache holds that conversation (Ray Serve's "
        "consistent-hash router; a replica that is full passes it to the next one on the ring). Requests "
        "without one spread uniformly. False: Serve's default router (power of two choices by load).",
    )
    grpc_servicer_functions: list[str] = Field(
        default_factory=list,
        description="Import paths of the `add_*Servicer_to_server` functions Serve's gRPC proxy serves; "
        "empty = no gRPC proxy.",
    )

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServingConfig:
        if self.port == self.grpc_port:
            raise ValueError(f"HTTP and gRPC need different ports, both are {self.port}")
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give api_key_env or api_key_file, not both")
        if self.api_key_file is not None and not re.fullmatch(r"(/[^/]+)+/[^/]+", self.api_key_file):
            raise ValueError(f"api_key_file must be an absolute path inside a folder of its own (the "
                             f"Secret is mounted over that folder), got {self.api_key_file!r}")
        if (self.auth_health or self.auth_metrics) and self.api_key_env is None and self.api_key_file is None:
            raise ValueError("auth_health / auth_metrics need an API key (api_key_env or api_key_file)")
        return self

    def routing_options(self) -> dict:
        """Serve's deployment options for `session_affinity` ({} = Serve's default router)."""
        if not self.session_affinity:
            return {}
        return {"request_router_config": {"request_router_class": SESSION_ROUTER}}

    def graceful_shutdown_options(self) -> dict[str, float]:
        """Serve's replica shutdown settings. Serve stops routing to a stopping replica, waits for its
        in-flight requests, and kills it after `graceful_shutdown_timeout_s`; every request ends by
        `request_timeout_s` (with a clear error if it must), so waiting that long plus a margin for the
        last events to flush never cuts a stream."""
        return {"graceful_shutdown_wait_loop_s": 1.0,
                "graceful_shutdown_timeout_s": self.request_timeout_s + 15.0}
