"""The one cluster scaling config: models, placement, speculation defaults, replicas, node types.

Everything that deploys specflash is generated from or checked against this model, so the
pieces cannot drift (DESIGN.md §7): the Ray pipeline reads `placement` and `speculation`,
the Serve app reads `serving` and the scaling blocks, and `cluster.manifests` renders the
KubeRay RayService / RayCluster / RayJob, the Serve config file and the `ray up` config from
it. `manifests/cluster.example.yaml` is an instance of `ClusterConfig`; `specflash serve`
without `--config` uses `ClusterConfig.local_default()`, and with one layers the file over it
(`ClusterConfig.from_yaml(path, layered=True)`), so a file with only a `serving:` block works.

    base.py       the strict base model, names, resource checks
    placement.py  ActorPlacement, PlacementConfig, NodeType, Toleration
    scaling.py    ReplicaScaling, DrafterScaling, AutoscalerOptions
    front.py      ServingConfig (HTTP / gRPC front)
    monitoring.py MonitoringConfig (PodMonitor, PrometheusRule, dashboard)
    app.py        ModelPairConfig, AppArgs, ClusterConfig and the deployment-only blocks
    errors.py     ConfigError: one plain sentence per wrong field
"""
from cluster.config.app import (AppArgs, BenchmarkJob, ClusterConfig, LauncherConfig, ModelPairConfig,
                                ModelVolume)
from cluster.config.base import (DEFAULT_VERIFIER_POLICY, INGRESS_DEPLOYMENT, MAX_DRAFTERS_PER_VERIFIER,
                                 RAY_BUILTIN_RESOURCES)
from cluster.config.errors import ConfigError, explain
from cluster.config.front import ServingConfig
from cluster.config.monitoring import MonitoringConfig
from cluster.config.placement import ActorPlacement, NodeType, PlacementConfig, Toleration
from cluster.config.scaling import AutoscalerOptions, DrafterScaling, ReplicaScaling

__all__ = [
    "ActorPlacement", "AppArgs", "AutoscalerOptions", "BenchmarkJob", "ClusterConfig", "ConfigError",
    "DEFAULT_VERIFIER_POLICY", "DrafterScaling", "INGRESS_DEPLOYMENT", "LauncherConfig",
    "MAX_DRAFTERS_PER_VERIFIER", "ModelPairConfig", "MonitoringConfig", "ModelVolume", "NodeType", "PlacementConfig",
    "RAY_BUILTIN_RESOURCES", "ReplicaScaling", "ServingConfig", "Toleration", "explain",
]
