"""`AppArgs` (what the running Serve app reads) and `ClusterConfig` (plus what deployment needs).

The package docstring (`cluster/config/__init__.py`) says how the pieces fit.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from cluster.config.base import MAX_DRAFTERS_PER_VERIFIER, _check_dns_1035, _Model
from cluster.config.errors import ConfigError, explain
from cluster.config.front import ServingConfig
from cluster.config.monitoring import MonitoringConfig
from cluster.config.placement import ActorPlacement, NodeType, PlacementConfig
from cluster.config.scaling import AutoscalerOptions, DrafterScaling, ReplicaScaling
from speculation.settings import KVCacheSettings, SpeculationSettings


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
    monitoring: MonitoringConfig = Field(
        default_factory=MonitoringConfig, description="The PodMonitor, PrometheusRule and Grafana dashboard.")

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
    def from_yaml(cls, path: str | Path, *, layered: bool = False) -> ClusterConfig:
        """The config in a YAML file; a `ConfigError` (one sentence per wrong field) if it is wrong.

        `layered`: the file may be partial: each top-level block it leaves out (`image`, `head`,
        `serving`, ...) comes from `local_default()`, so a file with only a `serving:` block is a
        local server with those settings (`specflash serve --config`). A block the file gives is
        taken whole, as written, with the model's own defaults for what it leaves out. Without
        `layered` every required field must be in the file (what the cluster manifests need)."""
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if data is None and layered:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(str(path), ["expected a mapping of settings at the top level, got "
                                          f"{type(data).__name__}"])
        if layered:
            data = cls.local_default().model_dump(mode="json", exclude_unset=True) | data
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise explain(e, cls, str(path)) from None

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
        """Everything on this machine: one drafter, one verifier, no custom resources, no workers.
        The head is this machine (its CPUs and GPUs), so a layered config asking for more fails
        validation with the reason instead of waiting for resources that never come."""
        local = NodeType(name="local", cpus=os.cpu_count() or 1, memory="8Gi", gpus=_local_gpus())
        return cls(
            name="specflash-local",
            image="specflash:local",
            ray_version=importlib.metadata.version("ray"),
            serving=ServingConfig(),
            head=local,
            drafter_nodes=NodeType(name="drafter", cpus=1, memory="4Gi", max_workers=0),
            verifier_nodes=NodeType(name="verifier", cpus=1, memory="4Gi", max_workers=0),
        )


def _local_gpus() -> int:
    """CUDA devices on this machine (0 without torch's CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
