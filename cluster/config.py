"""The one cluster scaling config: models, placement, speculation defaults, replicas, node types.

Everything that deploys specflash is generated from or checked against this model, so the
pieces cannot drift (DESIGN.md §7): the Ray pipeline reads `placement` and `speculation`,
the Serve app reads `serving` and the scaling blocks, and `cluster.manifests` renders the
KubeRay RayService / RayCluster / RayJob, the Serve config file and the `ray up` config from
it. `manifests/cluster.example.yaml` is an instance of `ClusterConfig`; `specflash serve`
without `--config` uses `ClusterConfig.local_default()`.
"""
from __future__ import annotations

import importlib.metadata
import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from speculation.settings import KVCacheSettings, SpeculationSettings

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
# Name of the Serve ingress deployment the app builds (`cluster.serve_app:build_app`); the Serve
# config's per-deployment settings (autoscaling_config, ray_actor_options) are addressed by it.
# The drafter and verifier are Ray actors of the pipeline, placed and counted from AppArgs.
INGRESS_DEPLOYMENT = "SpecflashIngress"
# Ray's built-in resources are requested through num_cpus / num_gpus, never as custom names.
RAY_BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}
DEFAULT_VERIFIER_POLICY = "cluster.autoscaling:PipelineLoadPolicy"
MAX_DRAFTERS_PER_VERIFIER = 8


class _Model(BaseModel):
    """Base: unknown keys are errors (a typo in YAML must not pass silently)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_custom_resources(resources: dict[str, float]) -> dict[str, float]:
    for name, amount in resources.items():
        if name in RAY_BUILTIN_RESOURCES:
            raise ValueError(f"{name!r} is a Ray built-in resource; use num_cpus / num_gpus / cpus / gpus")
        if amount <= 0:
            raise ValueError(f"custom resource {name!r} must be positive, got {amount}")
    return resources


def _check_dns_1035(name: str) -> str:
    if len(name) > 63 or not DNS_1035.match(name):
        raise ValueError(f"{name!r} is not a DNS-1035 label (lower-case letters, digits, '-', starts with a letter)")
    return name


class ModelPairConfig(_Model):
    target: str | None = Field(
        None,
        description="Target checkpoint: a Hugging Face checkpoint directory present on every node "
        "(see `model_volume`); None = the embedded default pair.",
    )
    draft: str | None = Field(
        None, description="Draft checkpoint (same tokenizer as the target); None with no target = the embedded draft."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weight and activation dtype of both models."
    )

    @model_validator(mode="after")
    def _draft_needs_target(self) -> ModelPairConfig:
        if self.draft is not None and self.target is None:
            raise ValueError("a draft model needs its target: name `target` too (the embedded pair is all-or-nothing)")
        return self


class ActorPlacement(_Model):
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs the actor reserves.")
    num_gpus: float = Field(
        0.0, ge=0, description="Ray GPUs the actor reserves; a fraction shares a GPU, above 1 must be whole."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources the actor asks for, e.g. {specflash_drafter: 1}; "
        "only nodes offering them can host it.",
    )

    @field_validator("num_gpus")
    @classmethod
    def _whole_gpus_above_one(cls, v: float) -> float:
        if v > 1 and v != int(v):
            raise ValueError(f"num_gpus above 1 must be a whole number, got {v}")
        return v

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_custom_resources(v)

    def ray_options(self) -> dict[str, Any]:
        """Keyword arguments for `ActorClass.options(...)` / Serve `ray_actor_options`."""
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts

    def bundle(self) -> dict[str, float]:
        """This actor's placement-group bundle (Ray resource names)."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in bundle.items() if v > 0}


class PlacementConfig(_Model):
    drafter: ActorPlacement = Field(default_factory=ActorPlacement, description="Resources of one drafter actor.")
    verifier: ActorPlacement = Field(default_factory=ActorPlacement, description="Resources of one verifier actor.")
    ingress: ActorPlacement = Field(
        default_factory=lambda: ActorPlacement(num_cpus=0.0),
        description="Resources of one Serve ingress replica (HTTP/gRPC front, runs no model).",
    )
    strategy: Literal["NONE", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "NONE",
        description="Placement group over one verifier and its drafters; NONE = no placement group, "
        "the resources above decide; STRICT_SPREAD = each on a different node.",
    )

    def bundles(self, drafters_per_verifier: int) -> list[dict[str, float]]:
        """Placement-group bundles of one pipeline: the verifier first, then its drafters."""
        return [self.verifier.bundle()] + [self.drafter.bundle() for _ in range(drafters_per_verifier)]


class ReplicaScaling(_Model):
    """Verifier replicas: each replica of the Serve ingress deployment hosts one verifier pipeline, so
    this is the deployment's `autoscaling_config` (cluster.autoscaling.PipelineLoadPolicy by default)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas the Serve autoscaler keeps.")
    max_replicas: int = Field(1, ge=1, description="Most replicas the Serve autoscaler starts.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time; None = min_replicas.")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Ongoing requests per replica the autoscaler aims for."
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="Load must stay high this long before scaling up.")
    downscale_delay_s: float = Field(600.0, ge=0, description="Load must stay low this long before scaling down.")
    policy: str | None = Field(
        DEFAULT_VERIFIER_POLICY,
        description="Serve autoscaling policy as `module:function` or `module:Class`. The default scales on "
        "ongoing requests and on the verifiers' busy fraction, which each replica reports through "
        "`record_autoscaling_stats`; None = Serve's built-in policy, on ongoing requests only.",
    )
    policy_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of `policy`.")

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaScaling:
        initial = self.min_replicas if self.initial_replicas is None else self.initial_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"need min_replicas <= initial_replicas <= max_replicas, got "
                f"{self.min_replicas} <= {initial} <= {self.max_replicas}"
            )
        if self.policy_kwargs and self.policy is None:
            raise ValueError("policy_kwargs given without a policy")
        if self.policy is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.policy):
            raise ValueError(f"policy must be an import path `module:function`, got {self.policy!r}")
        return self

    def autoscaling_config(self) -> dict[str, Any]:
        """Serve's `autoscaling_config` for this deployment."""
        cfg: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "initial_replicas": self.min_replicas if self.initial_replicas is None else self.initial_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }
        if self.policy is not None:
            cfg["policy"] = {"policy_function": self.policy, "policy_kwargs": dict(self.policy_kwargs)}
        return cfg


class DrafterScaling(_Model):
    """Drafters per verifier, adjusted inside each replica by `cluster.autoscaling.DrafterAutoscaler`
    from that verifier's own signals; `drafters_per_verifier` is the starting count."""

    min_per_verifier: int = Field(1, ge=1, le=MAX_DRAFTERS_PER_VERIFIER, description="Fewest drafters feeding one verifier.")
    max_per_verifier: int = Field(1, ge=1, le=MAX_DRAFTERS_PER_VERIFIER, description="Most drafters feeding one verifier.")
    starved_idle_fraction: float = Field(
        0.2, gt=0, lt=1, description="Add a drafter while the verifier spends more than this fraction of its "
        "time waiting for trees with requests pending (drafting is the bottleneck).")
    full_ring_occupancy: float = Field(
        0.9, gt=0, le=1, description="Remove a drafter while the rings stay fuller than this on average and the "
        "verifier is not starved (drafters wait on backpressure: one fewer keeps up).")
    period_s: float = Field(10.0, gt=0, description="How often each replica reads its verifier's signals.")
    upscale_delay_s: float = Field(30.0, ge=0, description="A starved verifier must stay starved this long.")
    downscale_delay_s: float = Field(300.0, ge=0, description="Full rings must stay full this long.")

    @model_validator(mode="after")
    def _ordered(self) -> DrafterScaling:
        if self.min_per_verifier > self.max_per_verifier:
            raise ValueError(f"need min_per_verifier <= max_per_verifier, got "
                             f"{self.min_per_verifier} > {self.max_per_verifier}")
        return self

    @property
    def enabled(self) -> bool:
        return self.max_per_verifier > self.min_per_verifier


class Toleration(_Model):
    key: str | None = Field(None, description="Taint key; None with operator Exists tolerates every taint.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Kubernetes toleration operator.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; None = every effect."
    )


class NodeType(_Model):
    name: str = Field(description="Node type / KubeRay group name (DNS-1035 label).")
    cpus: int = Field(gt=0, description="CPUs of one node (pod request and limit; Ray's num-cpus on workers).")
    memory: str = Field(description="Memory of one node as a Kubernetes quantity, e.g. 32Gi.")
    gpus: int = Field(0, ge=0, description="GPUs of one node (a `gpu_resource` limit on Kubernetes).")
    gpu_resource: str = Field("nvidia.com/gpu", description="Kubernetes extended resource name of the GPUs.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources the node offers (rayStartParams `resources`)."
    )
    min_workers: int = Field(0, ge=0, description="Fewest nodes of this type (KubeRay minReplicas).")
    max_workers: int = Field(1, ge=0, description="Most nodes of this type (KubeRay maxReplicas).")
    replicas: int | None = Field(None, ge=0, description="Nodes at creation; None = min_workers.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Kubernetes nodeSelector of the pods.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Kubernetes tolerations of the pods.")
    image: str | None = Field(None, description="Container image override; None = the cluster image.")
    instance_type: str | None = Field(None, description="VM instance type for the `ray up` launcher config.")

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_custom_resources(v)

    @field_validator("name")
    @classmethod
    def _dns_1035(cls, v: str) -> str:
        return _check_dns_1035(v)

    @field_validator("memory")
    @classmethod
    def _quantity(cls, v: str) -> str:
        if not K8S_QUANTITY.match(v):
            raise ValueError(f"memory {v!r} is not a Kubernetes quantity such as 32Gi or 64G")
        return v

    @model_validator(mode="after")
    def _replicas_in_range(self) -> NodeType:
        if not self.min_workers <= self.initial_workers <= self.max_workers:
            raise ValueError(
                f"node type {self.name}: need min_workers <= replicas <= max_workers, got "
                f"{self.min_workers} <= {self.initial_workers} <= {self.max_workers}"
            )
        return self

    @property
    def initial_workers(self) -> int:
        return self.min_workers if self.replicas is None else self.replicas

    def actors_per_node(self, actor: ActorPlacement) -> int:
        """How many such actors one node of this type can hold (0 = none fits)."""
        offered = {"CPU": self.cpus, "GPU": float(self.gpus), **self.resources}
        wanted = {"CPU": actor.num_cpus, "GPU": actor.num_gpus, **actor.resources}
        fits = [math.floor(offered.get(k, 0.0) / v + 1e-9) for k, v in wanted.items() if v > 0]
        return min(fits) if fits else 1 << 30

    def missing_for(self, actor: ActorPlacement) -> list[str]:
        """The resources this node type lacks to host one such actor, as readable strings."""
        offered = {"CPU": self.cpus, "GPU": float(self.gpus), **self.resources}
        wanted = {"CPU": actor.num_cpus, "GPU": actor.num_gpus, **actor.resources}
        return [f"{k}={v:g} (offers {offered.get(k, 0):g})" for k, v in wanted.items() if offered.get(k, 0.0) < v]


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
    max_request_bytes: int = Field(4 << 20, ge=1024, description="Larger request bodies get 413.")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On shutdown, how long in-flight requests may still run before they are "
        "failed with a clear error; new requests get 503 meanwhile.",
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

    def graceful_shutdown_options(self) -> dict[str, float]:
        """Serve's replica shutdown settings. Serve stops routing to a stopping replica, waits for its
        in-flight requests, and kills it after `graceful_shutdown_timeout_s`; every request ends by
        `request_timeout_s` (with a clear error if it must), so waiting that long plus a margin for the
        last events to flush never cuts a stream."""
        return {"graceful_shutdown_wait_loop_s": 1.0,
                "graceful_shutdown_timeout_s": self.request_timeout_s + 15.0}


class AutoscalerOptions(_Model):
    idle_timeout_s: int = Field(60, ge=0, description="A worker node idle this long is removed.")
    upscaling_mode: Literal["Default", "Aggressive", "Conservative"] = Field(
        "Default", description="KubeRay upscalingMode: Conservative adds nodes gradually, Aggressive at once."
    )
    version: Literal["v1", "v2"] = Field("v2", description="Ray autoscaler version KubeRay runs.")


class LauncherConfig(_Model):
    provider: Literal["aws"] = Field("aws", description="Cloud of the `ray up` config.")
    region: str = Field("us-west-2", description="Cloud region.")
    ssh_user: str = Field("ubuntu", description="SSH user of the node image.")


class ModelVolume(_Model):
    claim_name: str = Field(description="PersistentVolumeClaim holding the checkpoints (ReadOnlyMany or ReadWriteMany).")
    mount_path: str = Field("/models", description="Where every Ray pod mounts it; `models.target` / `draft` live below.")

    @field_validator("claim_name")
    @classmethod
    def _dns_1123(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", v) or len(v) > 253:
            raise ValueError(f"{v!r} is not a Kubernetes object name")
        return v

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"mount_path must be absolute, got {v!r}")
        return v


class BenchmarkJob(_Model):
    entrypoint: str = Field(
        "python bench/e2e.py --no-hf --methods off async",
        description="Benchmark command the RayJob runs; the config's model pair, spec_len and tree_width "
        "are appended as --target/--draft/--spec-len/--tree-width.",
    )
    working_dir: str = Field("/opt/specflash", description="Checkout of the repository inside the image.")
    ttl_seconds_after_finished: int = Field(600, ge=0, description="Delete the job's cluster this long after.")


class AppArgs(_Model):
    """The `args` of `cluster.serve_app:build_app`: the part of ClusterConfig the running app reads.

    `AppArgs.model_validate(args)` in the builder; `{}` gives the local defaults.
    """

    engine: str = Field(
        "auto",
        description="What runs behind the ingress: pipeline (the Ray drafter/verifier actors), local (the "
        "in-process engine), fake (serving.testing.FakeEngine, no model), auto (pipeline where it can be "
        "built, else local), or a `module:factory` import path.",
    )
    model_name: str = Field("specflash", min_length=1, description="The model id clients send as `model`.")
    models: ModelPairConfig = Field(default_factory=ModelPairConfig, description="The model pair.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Actor resources.")
    speculation: SpeculationSettings = Field(default_factory=SpeculationSettings, description="Server defaults.")
    kv_cache: KVCacheSettings = Field(default_factory=KVCacheSettings, description="KV caches of the engines.")
    drafters_per_verifier: int = Field(1, ge=1, le=MAX_DRAFTERS_PER_VERIFIER, description="Drafter actors feeding one verifier at start.")
    verifier_scaling: ReplicaScaling = Field(
        default_factory=ReplicaScaling, description="Verifier replicas = replicas of the Serve deployment.")
    drafter_scaling: DrafterScaling = Field(default_factory=DrafterScaling, description="Drafters per verifier.")
    serving: ServingConfig = Field(default_factory=ServingConfig, description="HTTP / gRPC front.")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if v not in ("auto", "pipeline", "local", "fake") and not re.fullmatch(r"[\w.]+:[\w.]+", v):
            raise ValueError(f"engine must be auto, pipeline, local, fake or a module:factory path, got {v!r}")
        return v

    @model_validator(mode="after")
    def _app_consistent(self) -> AppArgs:
        if self.models.target is not None and self.models.draft is None:
            if self.speculation.proposer == "model" and self.speculation.mode != "off":
                raise ValueError("a target without a draft model needs speculation proposer 'ngram' or mode 'off'")
        if self.verifier_scaling.min_replicas < 1:
            raise ValueError("verifier_scaling.min_replicas must be >= 1: nothing serves without a verifier")
        self._check_ratio()
        return self

    def _check_ratio(self) -> None:
        n, d = self.drafters_per_verifier, self.drafter_scaling
        if not d.min_per_verifier <= n <= d.max_per_verifier:
            raise ValueError(
                f"drafters_per_verifier={n} is outside drafter_scaling [min_per_verifier={d.min_per_verifier}, "
                f"max_per_verifier={d.max_per_verifier}]"
            )


class ClusterConfig(AppArgs):
    """AppArgs plus what only deployment needs: names, image, node types, autoscaler, jobs."""

    name: str = Field("specflash", max_length=40, description="Name of the RayService / cluster (DNS-1035).")
    image: str = Field(description="Container image with specflash installed (same Ray version).")
    ray_version: str = Field(description="Ray version of the image, e.g. 2.60.0.")
    import_path: str = Field("cluster.serve_app:build_app", description="The Serve app builder.")
    head: NodeType = Field(
        description="The head node: GCS, Serve controller and proxy; runs no model in a cluster "
        "(its worker counts are ignored)."
    )
    drafter_nodes: NodeType = Field(description="Worker node type hosting drafters.")
    verifier_nodes: NodeType = Field(description="Worker node type hosting verifiers.")
    autoscaler: AutoscalerOptions = Field(default_factory=AutoscalerOptions, description="Ray node autoscaler.")
    model_volume: ModelVolume | None = Field(
        None, description="Kubernetes volume with the checkpoints, mounted in every Ray pod; None = baked into the image."
    )
    launcher: LauncherConfig = Field(default_factory=LauncherConfig, description="`ray up` provider settings.")
    benchmark: BenchmarkJob = Field(default_factory=BenchmarkJob, description="The RayJob's benchmark run.")

    @field_validator("name")
    @classmethod
    def _dns_1035(cls, v: str) -> str:
        return _check_dns_1035(v)

    @model_validator(mode="before")
    @classmethod
    def _no_ingress_scaling(cls, data: Any) -> Any:
        if isinstance(data, dict) and "ingress_scaling" in data:
            raise ValueError("ingress_scaling is gone: each ingress replica hosts one verifier pipeline, so "
                             "verifier_scaling is the Serve deployment's autoscaling; move its settings there")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        names = [self.head.name, self.drafter_nodes.name, self.verifier_nodes.name]
        if len(set(names)) != 3:
            raise ValueError(f"head, drafter_nodes and verifier_nodes need distinct names, got {names}")
        if self.model_volume is not None:
            root = self.model_volume.mount_path.rstrip("/") + "/"
            for path in (self.models.target, self.models.draft):
                if path is not None and not path.startswith(root):
                    raise ValueError(f"model {path!r} is not under model_volume.mount_path {root!r}")
        for side in ("verifier", "drafter"):
            self._check_fit(side)
        return self

    def host_of(self, side: Literal["drafter", "verifier"]) -> NodeType:
        """The node type an actor of `side` runs on: its worker type, or the head when that has no workers."""
        nodes: NodeType = getattr(self, f"{side}_nodes")
        return nodes if nodes.max_workers > 0 else self.head

    def _check_fit(self, side: Literal["drafter", "verifier"]) -> None:
        actor: ActorPlacement = getattr(self.placement, side)
        most = self.verifier_scaling.max_replicas
        if side == "drafter":
            most *= self.drafter_scaling.max_per_verifier
        host = self.host_of(side)
        missing = host.missing_for(actor)
        if missing:
            raise ValueError(f"a {side} actor does not fit on node type {host.name!r}: needs {', '.join(missing)}")
        if host is self.head:
            return
        for name in actor.resources:
            if name in self.head.resources:
                raise ValueError(f"the head offers {side} resource {name!r}: the head must run no model")
        capacity = host.actors_per_node(actor) * host.max_workers
        if most > capacity:
            what = ("verifier_scaling.max_replicas" if side == "verifier" else
                    "verifier_scaling.max_replicas x drafter_scaling.max_per_verifier")
            raise ValueError(f"{what}={most} {side}s exceed what {host.max_workers} {host.name!r} nodes hold "
                             f"({capacity})")

    def app_args(self) -> dict[str, Any]:
        """The Serve app's `args` (an `AppArgs` as JSON-compatible data)."""
        return self.model_dump(mode="json", include=set(AppArgs.model_fields))

    # ---- YAML ------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        return cls.model_validate(data)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The config as YAML (every field, defaults included); written to `path` when given."""
        data = self.model_dump(mode="json")
        first = ["name", "image", "ray_version", "import_path"]  # identity first, as in the example file
        data = {k: data[k] for k in first} | {k: v for k, v in data.items() if k not in first}
        text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def local_default(cls) -> ClusterConfig:
        """Everything on this machine: one drafter, one verifier, no custom resources, no workers."""
        local = NodeType(name="local", cpus=2, memory="8Gi")
        return cls(
            name="specflash-local",
            image="specflash:local",
            ray_version=importlib.metadata.version("ray"),
            serving=ServingConfig(),
            head=local,
            drafter_nodes=NodeType(name="drafter", cpus=1, memory="4Gi", max_workers=0),
            verifier_nodes=NodeType(name="verifier", cpus=1, memory="4Gi", max_workers=0),
        )
