"""A real Prometheus (Debian's package) scrapes a two-replica deployment under a short load through
Ray's metrics agent, relabelled as the rendered PodMonitor says (issue 26, item 4): token counters
rate above 0, one series per replica, every dashboard query and alert expression parses and
returns data, and the rendered rules load. Set SPECFLASH_DASHBOARD_PNG=path to also draw the
dashboard from Prometheus's answers (bench/dashboard.py)."""
from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster import monitoring
from cluster.config import ClusterConfig
from tests.cluster.prom_deployment import running
from tests.cluster.test_monitoring import EXAMPLE, need_promtool
from tests.cluster.test_serve_shutdown import _free_port


def prometheus_config(cfg: ClusterConfig, target: str, rules: Path) -> dict:
    """A static scrape of `target` with the PodMonitor's own relabelling, in Prometheus's spelling."""
    (endpoint,) = monitoring.pod_monitor(cfg)["spec"]["podMetricsEndpoints"]
    relabel = [{"source_labels": r["sourceLabels"], "regex": r["regex"], "target_label": r["targetLabel"],
                "replacement": r["replacement"], "action": r["action"]} for r in endpoint["metricRelabelings"]]
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [target]}],
                                "metric_relabel_configs": relabel}]}


def query(prom: str, expr: str) -> list:
    body = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def with_bool(expr: str) -> str:
    """An alert expression with its threshold comparisons made `bool`: a 0/1 series whenever the
    compared quantity has data, firing or not (what 'returns data' means for an alert)."""
    return re.sub(r" (==|!=|>=|<=|>|<) (?=[0-9])", r" \1 bool ", expr)


def load(url: str, seconds: float, stop: threading.Event) -> None:
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline and not stop.is_set():
            try:
                client.post(f"{url}/v1/completions", json={"model": "specflash", "prompt": "hi", "max_tokens": 12})
            except httpx.HTTPError:
                pass


@pytest.fixture
def deployment(tmp_path):
    """Two ingress replicas on a local Ray whose metrics agent listens on a known port, in a child
    process (tests/cluster/prom_deployment.py: the session's shared Ray lives in this one)."""
    with running(tmp_path) as where:
        yield where


@pytest.mark.slow
def test_a_real_prometheus_sees_every_replica_and_every_query_answers(deployment, tmp_path):
    need_promtool()
    url, target = deployment
    cfg = ClusterConfig.from_yaml(EXAMPLE)
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(monitoring.prometheus_rule(cfg)["spec"]))
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(cfg, target, rules)))
    port = _free_port()
    prom = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    loaders = [threading.Thread(target=load, args=(url, 25, stop)) for _ in range(6)]  # > 2 x max_queue: 429s
    server = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for t in loaders:
            t.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                rate = query(prom, "sum(rate(specflash_generation_tokens_total[15s]))")
                replicas = query(prom, "count by (replica) (specflash_spec_drafters_alive)")
                if rate and float(rate[0]["value"][1]) > 0 and len(replicas) == 2:
                    break
            except (httpx.HTTPError, ValueError):   # not up yet (no answer, or 503 "Service Unavailable")
                pass
            assert time.monotonic() < deadline, "Prometheus never saw tokens from both replicas"
            time.sleep(1)
        per_replica = query(prom, "sum by (deployment, replica) (specflash_requests_total)")
        assert len({r["metric"]["replica"] for r in per_replica}) == 2        # distinct per-replica series
        assert {r["metric"].get("deployment") for r in per_replica} == {"SpecflashIngress"}
        stop.set()
        empty = [e for _, qs in monitoring.PANELS.values() for _, e in qs if not query(prom, e)]
        assert empty == [], f"dashboard queries without data: {empty}"
        no_data = [a["alert"] for a in monitoring.alerts(cfg) if not query(prom, with_bool(a["expr"]))]
        assert no_data == [], f"alert expressions without data: {no_data}"
        loaded = httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"][0]["rules"]
        assert len(loaded) == len(monitoring.alerts(cfg)) and all(r["health"] != "err" for r in loaded), loaded
        if os.environ.get("SPECFLASH_DASHBOARD_PNG"):   # a longer run to draw (not in CI)
            from bench.dashboard import draw

            seconds = float(os.environ.get("SPECFLASH_DASHBOARD_SECONDS", "120"))
            more = [threading.Thread(target=load, args=(url, seconds, threading.Event())) for _ in range(6)]
            for t in more:
                t.start()
            for t in more:
                t.join()
            draw(prom, os.environ["SPECFLASH_DASHBOARD_PNG"], minutes=seconds / 60 + 0.5, step_s=1.0)
    finally:
        stop.set()
        for t in loaders:
            t.join(60)
        server.terminate()
        server.wait(30)
