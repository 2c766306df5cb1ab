"""The rendered PodMonitor, PrometheusRule and Grafana dashboard (cluster/monitoring.py): their
shape, and every query parsed by promtool (a real Prometheus runs them: test_prometheus.py)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster import monitoring
from cluster.config import ClusterConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "manifests" / "cluster.example.yaml"


def need_promtool() -> str:
    """promtool, installed by scripts/install_prometheus.sh where missing; skip saying why it cannot be."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install_prometheus.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"Debian's prometheus package cannot be installed here: {proc.stderr.strip()}")
    return "promtool"


def check_rules(groups: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return subprocess.run([need_promtool(), "check", "rules", str(path)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def cfg() -> ClusterConfig:
    return ClusterConfig.from_yaml(EXAMPLE)


def test_podmonitor_scrapes_every_ray_pod_of_this_cluster(cfg):
    pm = yaml.safe_load((REPO / "manifests" / "podmonitor.yaml").read_text())
    assert pm == monitoring.pod_monitor(cfg)
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    svc = yaml.safe_load((REPO / "manifests" / "rayservice.yaml").read_text())
    spec = svc["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    selector = pm["spec"]["selector"]["matchLabels"]
    for pod in pods:   # head, drafter and verifier groups alike
        assert selector.items() <= pod["metadata"]["labels"].items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["interval"] == "15s"
    assert set(endpoint) <= {"port", "interval", "metricRelabelings"}
    assert pm["metadata"]["labels"]["release"] == "prometheus"


def test_prometheus_rule_has_the_alerts_an_operator_wants_and_promtool_accepts_it(cfg, tmp_path):
    rule = yaml.safe_load((REPO / "manifests" / "prometheusrule.yaml").read_text())
    assert rule == monitoring.prometheus_rule(cfg)
    names = [r["alert"] for r in rule["spec"]["groups"][0]["rules"]]
    assert names == ["SpecflashSpeculationOffClusterWide", "SpecflashNoDrafterAlive", "SpecflashVerifierRestarted",
                     "SpecflashAcceptanceCollapsed", "SpecflashQueueBackedUp", "SpecflashHighErrorRate"]
    backlog = next(r for r in rule["spec"]["groups"][0]["rules"] if r["alert"] == "SpecflashQueueBackedUp")
    assert backlog["expr"].endswith(f"> {0.8 * cfg.serving.max_queue:g}")      # from the config
    proc = check_rules(rule["spec"]["groups"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 rules found" in proc.stdout


def test_every_dashboard_query_parses(cfg, tmp_path):
    rules = [{"record": f"specflash:check_{i}", "expr": e} for i, e in enumerate(monitoring.queries(cfg))]
    proc = check_rules([{"name": "dashboard", "rules": rules}], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # mutation control: promtool does catch a broken expression
    broken = check_rules([{"name": "bad", "rules": [{"record": "x:y", "expr": "sum(rate(specflash_x[1m]"}]}], tmp_path)
    assert broken.returncode != 0


def test_dashboard_json_draws_every_panel_query(cfg):
    dash = json.loads((REPO / "manifests" / "grafana-dashboard.json").read_text())
    assert dash == json.loads(monitoring.dashboard_json(cfg, description=dash["description"]))
    drawn = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert drawn == [e for _, qs in monitoring.PANELS.values() for _, e in qs]
    cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dash["panels"]}
    assert len(cells) == len(dash["panels"])                                 # no two panels overlap
    titles = " ".join(p["title"] for p in dash["panels"])
    for needed in ("Requests", "Errors", "Time to first token", "Inter-token latency", "Queue depth",
                   "Acceptance rate", "Mean accepted length", "Acceptance per depth", "Verifier idle",
                   "Speculation on / off", "Drafters alive", "KV cache and ring"):
        assert needed in titles, needed
