"""Prometheus objects and a Grafana dashboard rendered from the cluster config (issue 26).

- `podmonitor.yaml`: a Prometheus-operator PodMonitor over every Ray pod of the cluster (head,
  drafter and verifier groups), scraping Ray's metrics agent (`metrics` port), where each
  Serve replica's series arrive labelled `deployment`, `replica`, `application`
  (`cluster.metrics`). Its metricRelabelings strip Ray's `ray_` prefix from `ray_specflash_*`,
  so the names are those of a single-process `specflash serve`'s `/metrics`.
- `prometheusrule.yaml`: the alerts an operator wants on day one (ALERTS).
- `grafana-dashboard.json`: the panels of PANELS, one query per line drawn.

PANELS and ALERTS are the one list of queries: the dashboard, the rules and the test that runs
every one of them against a real Prometheus (tests/cluster/test_prometheus.py) read them here.
"""
from __future__ import annotations

import json
from typing import Any

from cluster.config import ClusterConfig


def _rate(name: str, window: str = "1m", by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({name}[{window}]))"


def _quantile(q: float, name: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({name}_bucket[1m])))"


# title -> (unit, [(legend, PromQL)])
PANELS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "Requests by status": ("reqps", [("{{status}}", _rate("specflash_requests_total", by="status"))]),
    "Errors (4xx, 5xx) and rejections": ("reqps", [
        ("errors", 'sum (rate(specflash_requests_total{status=~"[45].."}[1m]))'),
        ("rejected {{reason}}", _rate("specflash_requests_rejected_total", by="reason"))]),
    "Time to first token": ("s", [("p50", _quantile(0.5, "specflash_time_to_first_token_seconds")),
                                  ("p99", _quantile(0.99, "specflash_time_to_first_token_seconds"))]),
    "Inter-token latency": ("s", [("p50", _quantile(0.5, "specflash_inter_token_latency_seconds")),
                                  ("p99", _quantile(0.99, "specflash_inter_token_latency_seconds"))]),
    "Queue depth and running, per replica": ("short", [
        ("queued {{replica}}", "sum by (replica) (specflash_queue_depth)"),
        ("running {{replica}}", "sum by (replica) (specflash_requests_running)")]),
    "Tokens per second": ("short", [("generated", _rate("specflash_generation_tokens_total")),
                                    ("prompt", _rate("specflash_prompt_tokens_total"))]),
    "Acceptance rate": ("percentunit", [
        ("cluster", f'{_rate("specflash_engine_num_accepted_total", "5m")} / '
                    f'{_rate("specflash_engine_num_drafted_total", "5m")}'),
        ("{{replica}}", "max by (replica) (specflash_spec_acceptance_rate)")]),
    "Mean accepted length (bonus included)": ("short", [
        ("{{replica}}", "max by (replica) (specflash_spec_mean_accepted_length)")]),
    "Acceptance per depth": ("percentunit", [
        ("depth {{depth}}", f'{_rate("specflash_engine_depth_accepts_total", "5m", "depth")} / '
                            f'{_rate("specflash_engine_depth_attempts_total", "5m", "depth")}')]),
    "Verifier idle fraction": ("percentunit", [
        ("cluster", f'{_rate("specflash_engine_verifier_idle_s_total")} / '
                    f'{_rate("specflash_engine_verifier_wall_s_total")}'),
        ("{{replica}}", "max by (replica) (specflash_spec_verifier_idle_fraction)")]),
    "Speculation on / off decisions": ("short", [
        ("on", _rate("specflash_engine_spec_on_decisions_total")),
        ("off", _rate("specflash_engine_spec_off_decisions_total")),
        ("speculating {{replica}}", "max by (replica) (specflash_spec_speculation_enabled)")]),
    "Drafters alive": ("short", [("{{replica}}", "sum by (replica) (specflash_spec_drafters_alive)")]),
    "KV cache and ring occupancy": ("percentunit", [
        ("KV {{replica}}", "1 - sum by (replica) (specflash_engine_kv_blocks_free) / "
                           "sum by (replica) (specflash_engine_kv_blocks_total)"),
        ("ring", f'{_rate("specflash_engine_ring_occupancy_sum_total")} / '
                 f'{_rate("specflash_engine_ring_samples_total")}')]),
}


def alerts(cfg: ClusterConfig) -> list[dict[str, Any]]:
    """The PrometheusRule's alerts, thresholds from `cfg.monitoring` and `cfg.serving`."""
    m = cfg.monitoring
    backlog = m.queue_fraction * cfg.serving.max_queue
    drafted = _rate("specflash_engine_num_drafted_total", "10m")
    rules = [
        ("SpecflashSpeculationOffClusterWide", "max (specflash_spec_speculation_enabled) == 0", "10m", "warning",
         "No verifier replica is speculating: every request decodes with the target alone (drafters dead or "
         "speculation turned off)."),
        ("SpecflashNoDrafterAlive", "max by (replica) (specflash_spec_drafters_alive) == 0", "5m", "warning",
         "Verifier replica {{ $labels.replica }} has heard from no drafter for 5 minutes."),
        ("SpecflashVerifierRestarted", "sum by (replica) (increase(specflash_drafter_resets_total[15m])) > 0", "0m",
         "warning", "The verifier of replica {{ $labels.replica }} restarted (its drafters obeyed a reset)."),
        ("SpecflashAcceptanceCollapsed",
         f'({_rate("specflash_engine_num_accepted_total", "10m")} / {drafted}) < {m.acceptance_floor:g} '
         f'and {drafted} > 0', "15m", "warning",
         f"The cluster accepts under {m.acceptance_floor:.0%} of drafted tokens: the draft model no longer "
         "matches the traffic; speculation costs more than it saves."),
        ("SpecflashQueueBackedUp", f"max by (replica) (specflash_queue_depth) > {backlog:g}", "5m", "critical",
         f"Replica {{{{ $labels.replica }}}} holds over {backlog:g} waiting requests "
         f"({m.queue_fraction:.0%} of serving.max_queue): scale out or shed load."),
        ("SpecflashHighErrorRate",
         f'(sum (rate(specflash_requests_total{{status=~"5.."}}[5m])) or vector(0)) '   # no 5xx yet: 0, not no data
         f'/ sum (rate(specflash_requests_total[5m])) > {m.error_ratio:g}', "5m", "critical",
         f"More than {m.error_ratio:.0%} of requests end in a 5xx."),
    ]
    return [{"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
             "annotations": {"summary": summary}} for name, expr, for_, severity, summary in rules]


def _meta(cfg: ClusterConfig, name: str, component: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "specflash", "app.kubernetes.io/instance": cfg.name,
              "app.kubernetes.io/component": component, **cfg.monitoring.selector_labels}
    return {"name": name, "labels": labels}


def pod_monitor(cfg: ClusterConfig) -> dict[str, Any]:
    """Every Ray pod of the cluster (its pods carry `app.kubernetes.io/instance: <name>`)."""
    endpoint = {
        "port": cfg.monitoring.metrics_port,
        "interval": f"{cfg.monitoring.scrape_interval_s}s",
        "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "ray_(specflash_.*)",
                               "targetLabel": "__name__", "replacement": "$1", "action": "replace"}],
    }
    spec = {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "specflash", "app.kubernetes.io/instance": cfg.name}},
        "podMetricsEndpoints": [endpoint],
    }
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": _meta(cfg, cfg.name, "podmonitor"), "spec": spec}


def prometheus_rule(cfg: ClusterConfig) -> dict[str, Any]:
    spec = {"groups": [{"name": f"{cfg.name}.rules", "rules": alerts(cfg)}]}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": _meta(cfg, cfg.name, "prometheusrule"), "spec": spec}


def grafana_dashboard(cfg: ClusterConfig, description: str = "") -> dict[str, Any]:
    """A Grafana dashboard (schema 39) of PANELS over a `datasource` variable, two panels a row."""
    panels = []
    for i, (title, (unit, queries)) in enumerate(PANELS.items()):
        targets = [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                   for j, (legend, expr) in enumerate(queries)]
        panels.append({"id": i + 1, "type": "timeseries", "title": title,
                       "datasource": {"type": "prometheus", "uid": "${datasource}"},
                       "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                       "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "targets": targets})
    variable = {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
    return {"title": f"specflash ({cfg.name})", "uid": f"specflash-{cfg.name}"[:40], "description": description,
            "schemaVersion": 39,
            "version": 1, "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
            "tags": ["specflash", "speculative-decoding"], "templating": {"list": [variable]}, "panels": panels}


def dashboard_json(cfg: ClusterConfig, description: str = "") -> str:
    return json.dumps(grafana_dashboard(cfg, description), indent=2) + "\n"


def queries(cfg: ClusterConfig) -> list[str]:
    """Every PromQL expression the dashboard and the rules evaluate."""
    return [expr for _, qs in PANELS.values() for _, expr in qs] + [a["expr"] for a in alerts(cfg)]
