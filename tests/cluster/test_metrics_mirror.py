"""`cluster.metrics.RayMetricsMirror`: a replica's registry pushed into `ray.serve.metrics`
(fakes stand in for Ray's metric classes; the real export is tests/cluster/test_prometheus.py)."""
from __future__ import annotations

import pytest

from cluster.metrics import RayMetricsMirror
from serving.prom import ServingStats


class FakeMetric:
    def __init__(self, name, description="", tag_keys=(), boundaries=None):
        self.name, self.tag_keys, self.boundaries = name, tag_keys, boundaries
        self.total: dict[tuple, float] = {}
        self.observed: list[tuple[float, dict]] = []

    def inc(self, value, tags):
        assert value > 0 and set(tags) == set(self.tag_keys)
        key = tuple(sorted(tags.items()))
        self.total[key] = self.total.get(key, 0.0) + value

    def set(self, value, tags):
        self.total[tuple(sorted(tags.items()))] = value

    def observe(self, value, tags):
        self.observed.append((value, tags))


@pytest.fixture
def fake_ray_metrics(monkeypatch):
    from ray.serve import metrics

    made: dict[str, FakeMetric] = {}

    def factory(*args, **kw):
        m = FakeMetric(*args, **kw)
        made[m.name] = m
        return m

    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, cls, factory)
    return made


def test_counters_gauges_and_histograms_reach_ray_with_their_labels(fake_ray_metrics):
    stats = ServingStats()
    mirror = RayMetricsMirror(stats.registry)
    stats.observe_request("/v1/completions", 200, 0.2)
    stats.observe_request("/v1/completions", 200, 0.2)
    stats.observe_tokens(4, 0.04)                       # four ITL observations of 0.01 s
    stats.observe_engine({"num_drafted": 10, "kv_blocks_free": 7, "speculation_enabled": 1})
    mirror.push()
    made = fake_ray_metrics
    assert made["specflash_requests"].total == {(("endpoint", "/v1/completions"), ("status", "200")): 2.0}
    assert made["specflash_engine_num_drafted"].total == {(): 10.0}
    assert made["specflash_engine_kv_blocks_free"].total == {(): 7.0}
    assert made["specflash_spec_speculation_enabled"].total == {(): 1.0}
    itl = made["specflash_inter_token_latency_seconds"]
    assert [v for v, _ in itl.observed] == [0.01] * 4   # the 0.01 bucket, exactly
    # a second push sends only what is new; a counter that went down (a restarted verifier) restarts
    stats.observe_request("/v1/completions", 200, 0.2)
    stats.observe_engine({"num_drafted": 3, "kv_blocks_free": 5})
    mirror.push()
    assert made["specflash_requests"].total == {(("endpoint", "/v1/completions"), ("status", "200")): 3.0}
    assert made["specflash_engine_num_drafted"].total == {(): 13.0}
    assert made["specflash_engine_kv_blocks_free"].total == {(): 5.0}
    assert len(itl.observed) == 4
