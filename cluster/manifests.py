"""Render every deployment file from the one cluster scaling config (`cluster.config.ClusterConfig`).

Outputs (DESIGN.md §7), all plain YAML so `kubectl apply -f` / `serve deploy` / `ray up` take them as is:

- `rayservice.yaml`: KubeRay RayService; `serveConfigV2` is the Serve config below, the Ray cluster has
  a head that runs no model, a drafter and a verifier worker group, and in-tree autoscaling.
- `raycluster.yaml`: the same cluster as a bare RayCluster, for development (`serve run`, `ray job submit`).
- `rayjob-benchmark.yaml`: a RayJob that runs the benchmark on its own copy of the cluster.
- `serve-config.yaml`: the Ray Serve config file (`serve deploy`), deployments with `autoscaling_config`.
- `ray-cluster-launcher.yaml`: the `ray up` config with the same node types, for VMs.
- `podmonitor.yaml`, `prometheusrule.yaml`, `grafana-dashboard.json`: scraping every replica, the
  alerts, the dashboard (`cluster.monitoring`).

KubeRay conventions followed: rayStartParams values are strings; custom resources go in rayStartParams
`resources` as a quoted JSON string (the form Ray's docs give for KubeRay); GPUs come from the
container's GPU limit (no `num-gpus` beside it); autoscaler v2 pods use `restartPolicy: Never`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from cluster import monitoring
from cluster.config import INGRESS_DEPLOYMENT, ClusterConfig, NodeType

API_VERSION = "ray.io/v1"
APP_NAME = "specflash"
# Ports of the Ray head container; KubeRay's head / serve Services pick them up by name.
HEAD_PORTS = [("gcs-server", 6379), ("dashboard", 8265), ("client", 10001)]
UPSCALING_SPEED = {"Conservative": 0.5, "Default": 1.0, "Aggressive": 100.0}  # `ray up` upscaling_speed
FILES = {
    "rayservice.yaml": "KubeRay RayService: the served application and its autoscaling Ray cluster",
    "raycluster.yaml": "KubeRay RayCluster for development (serve run / ray job submit against it)",
    "rayjob-benchmark.yaml": "KubeRay RayJob running the benchmark on its own cluster",
    "serve-config.yaml": "Ray Serve config file: serve deploy serve-config.yaml",
    "ray-cluster-launcher.yaml": "Ray cluster launcher config for VMs: ray up ray-cluster-launcher.yaml",
    "podmonitor.yaml": "Prometheus-operator PodMonitor scraping every Ray pod's metrics agent (all replicas)",
    "prometheusrule.yaml": "Prometheus-operator PrometheusRule: the specflash alerts",
    "grafana-dashboard.json": "Grafana dashboard of the specflash metrics (import it, pick the Prometheus)",
}


# ---- Serve -------------------------------------------------------------------------------------
def serve_config(cfg: ClusterConfig) -> dict[str, Any]:
    """The Serve config (`ray.serve.schema.ServeDeploySchema`): one application built by `cfg.import_path`.

    The ingress is the Serve deployment; each of its replicas hosts one verifier pipeline, so Serve
    autoscales it by `verifier_scaling` (cluster.autoscaling.PipelineLoadPolicy: ongoing requests and the
    verifiers' busy fraction). The drafters of each pipeline are placed from `args` (AppArgs) and
    counted inside the replica by `drafter_scaling`.
    """
    s = cfg.serving
    # max_ongoing_requests is left to the app (its own queue bound answers 429/503)
    ingress = {
        "name": INGRESS_DEPLOYMENT,
        "autoscaling_config": cfg.verifier_scaling.autoscaling_config(),
        "ray_actor_options": cfg.placement.ingress.ray_options(),
    }
    grpc: dict[str, Any] = {"port": s.grpc_port, "grpc_servicer_functions": list(s.grpc_servicer_functions)}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": s.port, "request_timeout_s": s.request_timeout_s},
        "grpc_options": grpc,
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": cfg.import_path,
                "args": cfg.app_args(),
                "deployments": [ingress],
            }
        ],
    }


# ---- Kubernetes pieces -------------------------------------------------------------------------
def _cpu(n: int) -> str:
    return str(n)


def _labels(cfg: ClusterConfig, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "specflash",
        "app.kubernetes.io/instance": cfg.name,
        "app.kubernetes.io/component": component,
    }


def api_key_secret(cfg: ClusterConfig) -> str:
    """The Kubernetes Secret holding the API key(s), under the key `api-key` (created by the operator:
    `kubectl create secret generic <name>-api-key --from-literal=api-key=...`)."""
    return f"{cfg.name}-api-key"


def _env(cfg: ClusterConfig) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": "/home/ray/.cache/huggingface"}]
    if cfg.serving.api_key_env:
        secret = {"name": api_key_secret(cfg), "key": "api-key"}
        env.append({"name": cfg.serving.api_key_env, "valueFrom": {"secretKeyRef": secret}})
    return env


def _secret_volume(cfg: ClusterConfig) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, mount) putting the Secret's `api-key` at `serving.api_key_file`, read-only; None if unset."""
    path = cfg.serving.api_key_file
    if path is None:
        return None
    folder, _, name = path.rpartition("/")
    volume = {"name": "api-key", "secret": {"secretName": api_key_secret(cfg), "defaultMode": 0o440,
                                             "items": [{"key": "api-key", "path": name}]}}
    return volume, {"name": "api-key", "mountPath": folder or "/", "readOnly": True}


def _container(cfg: ClusterConfig, node: NodeType, name: str, ports: list[tuple[str, int]]) -> dict[str, Any]:
    limits: dict[str, Any] = {"cpu": _cpu(node.cpus), "memory": node.memory}
    if node.gpus:
        limits[node.gpu_resource] = node.gpus
    container: dict[str, Any] = {
        "name": name,
        "image": node.image or cfg.image,
        "resources": {"limits": limits, "requests": dict(limits)},  # requests == limits: Guaranteed QoS
        "env": _env(cfg),
    }
    if ports:
        container["ports"] = [{"name": n, "containerPort": p} for n, p in ports]
    if cfg.model_volume is not None:
        mount = {"name": "models", "mountPath": cfg.model_volume.mount_path, "readOnly": True}
        container["volumeMounts"] = [mount]
    if (secret := _secret_volume(cfg)) is not None:
        container.setdefault("volumeMounts", []).append(secret[1])
    return container


def _pod_template(cfg: ClusterConfig, node: NodeType, container: dict[str, Any], component: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [container]}
    if cfg.model_volume is not None:
        claim = {"claimName": cfg.model_volume.claim_name, "readOnly": True}
        spec["volumes"] = [{"name": "models", "persistentVolumeClaim": claim}]
    if (secret := _secret_volume(cfg)) is not None:
        spec.setdefault("volumes", []).append(secret[0])
    if node.node_selector:
        spec["nodeSelector"] = dict(node.node_selector)
    if node.tolerations:
        spec["tolerations"] = [t.model_dump(exclude_none=True) for t in node.tolerations]
    if cfg.autoscaler.version == "v2":
        spec["restartPolicy"] = "Never"  # a Ray node is never reused after it dies (autoscaler v2)
    return {"metadata": {"labels": _labels(cfg, component)}, "spec": spec}


def _ray_resources(resources: dict[str, float]) -> str:
    """rayStartParams `resources`: a JSON object, itself quoted as a JSON string for the shell."""
    compact = {k: (int(v) if float(v).is_integer() else v) for k, v in sorted(resources.items())}
    return json.dumps(json.dumps(compact))


def _head_group(cfg: ClusterConfig) -> dict[str, Any]:
    ports = HEAD_PORTS + [("serve", cfg.serving.port), ("grpc", cfg.serving.grpc_port)]
    return {
        # The head runs the GCS, the Serve controller and the HTTP/gRPC proxy, never a model:
        # zero Ray CPUs and GPUs keep every actor off it.
        "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
        "template": _pod_template(cfg, cfg.head, _container(cfg, cfg.head, "ray-head", ports), "head"),
    }


def _worker_group(cfg: ClusterConfig, node: NodeType, *, min_workers: int | None = None) -> dict[str, Any]:
    params = {"num-cpus": _cpu(node.cpus)}  # GPUs: KubeRay reads them from the container's GPU limit
    if node.resources:
        params["resources"] = _ray_resources(node.resources)
    lo, start = (node.min_workers, node.initial_workers) if min_workers is None else (min_workers, min_workers)
    return {
        "groupName": node.name,
        "replicas": start,
        "minReplicas": lo,
        "maxReplicas": node.max_workers,
        "rayStartParams": params,
        "template": _pod_template(cfg, node, _container(cfg, node, "ray-worker", []), node.name),
    }


def _check_deployable(cfg: ClusterConfig) -> None:
    for side in ("drafter", "verifier"):
        node: NodeType = getattr(cfg, f"{side}_nodes")
        if node.max_workers < 1:
            raise ValueError(
                f"{side}_nodes.max_workers is 0: on a cluster the head runs no model, so the {side} "
                f"needs worker nodes (local configs are for `specflash serve`, not for manifests)"
            )


def ray_cluster_spec(cfg: ClusterConfig, *, dev: bool = False) -> dict[str, Any]:
    """The RayCluster spec shared by the RayService, the dev RayCluster and the RayJob.

    `dev`: worker groups may scale to zero when idle (minReplicas 0, nothing started up front).
    """
    _check_deployable(cfg)
    a = cfg.autoscaler
    floor = 0 if dev else None
    return {
        "rayVersion": cfg.ray_version,
        "enableInTreeAutoscaling": True,
        "autoscalerOptions": {
            "version": a.version,
            "upscalingMode": a.upscaling_mode,
            "idleTimeoutSeconds": a.idle_timeout_s,
            "resources": {
                "limits": {"cpu": "500m", "memory": "512Mi"},
                "requests": {"cpu": "500m", "memory": "512Mi"},
            },
        },
        "headGroupSpec": _head_group(cfg),
        "workerGroupSpecs": [
            _worker_group(cfg, cfg.drafter_nodes, min_workers=floor),
            _worker_group(cfg, cfg.verifier_nodes, min_workers=floor),
        ],
    }


def _object(kind: str, name: str, cfg: ClusterConfig, spec: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": name, "labels": _labels(cfg, kind.lower())}
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": meta, "spec": spec}


def ray_service(cfg: ClusterConfig) -> dict[str, Any]:
    spec = {
        # NewCluster: an upgrade of rayClusterConfig starts a new cluster, moves traffic once its
        # Serve app is healthy, then deletes the old one (zero downtime). serveConfigV2-only
        # changes are applied in place.
        "upgradeStrategy": {"type": "NewCluster"},
        "serveConfigV2": yaml.safe_dump(serve_config(cfg), sort_keys=False),
        "rayClusterConfig": ray_cluster_spec(cfg),
    }
    return _object("RayService", cfg.name, cfg, spec)


def ray_cluster(cfg: ClusterConfig) -> dict[str, Any]:
    return _object("RayCluster", f"{cfg.name}-dev", cfg, ray_cluster_spec(cfg, dev=True))


def ray_job(cfg: ClusterConfig) -> dict[str, Any]:
    job, m, sp = cfg.benchmark, cfg.models, cfg.speculation
    flags = [f"--spec-len {sp.spec_len}", f"--tree-width {sp.tree_width}"]
    flags += [f"--{k} {v}" for k, v in (("target", m.target), ("draft", m.draft)) if v is not None]
    spec = {
        "entrypoint": f"cd {job.working_dir} && {job.entrypoint} {' '.join(flags)}",
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": job.ttl_seconds_after_finished,
        "backoffLimit": 0,
        "rayClusterSpec": ray_cluster_spec(cfg),
    }
    return _object("RayJob", f"{cfg.name}-benchmark", cfg, spec)


# ---- ray up ------------------------------------------------------------------------------------
def _launcher_node(node: NodeType, *, head: bool) -> dict[str, Any]:
    resources: dict[str, Any] = {"CPU": 0, "GPU": 0} if head else {"CPU": node.cpus, "GPU": node.gpus}
    if not head:
        resources.update({k: (int(v) if float(v).is_integer() else v) for k, v in sorted(node.resources.items())})
    entry: dict[str, Any] = {"resources": resources, "node_config": {}}
    if node.instance_type:
        entry["node_config"]["InstanceType"] = node.instance_type
    if not head:
        entry.update(min_workers=node.min_workers, max_workers=node.max_workers)
    return entry


def launcher_config(cfg: ClusterConfig) -> dict[str, Any]:
    """`ray up` config: the same three node types as Ray node types; the head runs no model."""
    _check_deployable(cfg)
    a, l = cfg.autoscaler, cfg.launcher
    return {
        "cluster_name": cfg.name,
        "max_workers": cfg.drafter_nodes.max_workers + cfg.verifier_nodes.max_workers,
        "upscaling_speed": UPSCALING_SPEED[a.upscaling_mode],
        "idle_timeout_minutes": round(a.idle_timeout_s / 60, 2),
        "docker": {"image": cfg.image, "container_name": "ray_container", "pull_before_run": True},
        "provider": {"type": l.provider, "region": l.region, "cache_stopped_nodes": False},
        "auth": {"ssh_user": l.ssh_user},
        "available_node_types": {
            cfg.head.name: _launcher_node(cfg.head, head=True),
            cfg.drafter_nodes.name: _launcher_node(cfg.drafter_nodes, head=False),
            cfg.verifier_nodes.name: _launcher_node(cfg.verifier_nodes, head=False),
        },
        "head_node_type": cfg.head.name,
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as literal blocks, so the embedded YAML stays readable."""


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=4096)  # no folded lines


# ---- all files ---------------------------------------------------------------------------------
def render(cfg: ClusterConfig, source: str = "cluster.example.yaml") -> dict[str, str]:
    """File name -> YAML text of every manifest; `source` is named in each file's header."""
    objects = {
        "rayservice.yaml": ray_service(cfg),
        "raycluster.yaml": ray_cluster(cfg),
        "rayjob-benchmark.yaml": ray_job(cfg),
        "serve-config.yaml": serve_config(cfg),
        "ray-cluster-launcher.yaml": launcher_config(cfg),
        "podmonitor.yaml": monitoring.pod_monitor(cfg),
        "prometheusrule.yaml": monitoring.prometheus_rule(cfg),
    }
    note = f"Rendered from {source} by `specflash manifests render`; edit that file, not this one."
    out = {name: f"# {FILES[name]}.\n# {note}\n" + to_yaml(obj) for name, obj in objects.items()}
    out["grafana-dashboard.json"] = monitoring.dashboard_json(cfg, description=f"{FILES['grafana-dashboard.json']}. {note}")
    return out


def write(cfg: ClusterConfig, out_dir: str | Path, source: str = "cluster.example.yaml") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render(cfg, source).items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths
