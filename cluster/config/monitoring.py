"""What the rendered Prometheus objects (PodMonitor, PrometheusRule) and the Grafana dashboard need."""
from __future__ import annotations

from pydantic import Field

from cluster.config.base import _Model


class MonitoringConfig(_Model):
    scrape_interval_s: int = Field(15, ge=1, le=300, description="How often Prometheus scrapes each Ray pod.")
    metrics_port: str = Field("metrics", description="Name of the Ray containers' metrics port (KubeRay "
                              "adds `metrics`, 8080, where Ray's metrics agent exports every replica's series).")
    selector_labels: dict[str, str] = Field(
        default_factory=lambda: {"release": "prometheus"},
        description="Labels the PodMonitor and PrometheusRule carry so the Prometheus operator picks them "
        "up (kube-prometheus-stack selects `release: <its release name>`).")
    acceptance_floor: float = Field(
        0.2, gt=0, lt=1, description="Alert when the cluster's acceptance rate stays below this for 15 minutes.")
    queue_fraction: float = Field(
        0.8, gt=0, le=1, description="Alert when a replica's queue stays fuller than this share of "
        "serving.max_queue for 5 minutes.")
    error_ratio: float = Field(
        0.05, gt=0, lt=1, description="Alert when more than this share of requests end in a 5xx for 5 minutes.")
