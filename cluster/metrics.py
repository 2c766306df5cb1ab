"""Every replica's metrics through Ray's per-node metrics agents: one scrape sees the cluster.

The ingress `/metrics` route answers from whichever replica the Serve proxy picks, so with
several verifier replicas a scrape of it sees one of them at random. Each replica therefore
mirrors its own registry (`serving.prom.ServingStats`, the engine's stats included) into
`ray.serve.metrics` every `period_s`; Ray's metrics agent on each node exports them (port
`metrics-export-port`, 8080 in the KubeRay pods) with the `deployment`, `replica` and
`application` labels Serve adds, as Ray Serve's own metrics are. Ray prefixes the names with
`ray_`; the rendered PodMonitor strips it, so a dashboard reads the same names from a cluster as
from a single-process `specflash serve` (`specflash_requests_total`, ...).

Counters go over as increments (a counter that went down, a restarted verifier, restarts the
increments from its new value), gauges as values, histograms bucket by bucket: each new
observation of a bucket is replayed at the bucket's upper bound, so the bucket counts (what
`histogram_quantile` reads) are exact and `_sum` is an upper bound. A counter still at 0 has no
series through Ray (Ray's `Counter.inc` refuses 0) until it first grows: queries that must see
a zero (an error ratio) add `or vector(0)`, as the rendered alerts do.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os

log = logging.getLogger("specflash.metrics")
MIRROR_PERIOD_S = float(os.environ.get("SPECFLASH_METRICS_PERIOD_S", "5"))  # tests push every second


class RayMetricsMirror:
    """Mirrors one prometheus_client registry into `ray.serve.metrics` (`push()`, on demand)."""

    def __init__(self, registry) -> None:
        self.registry = registry
        self.metrics: dict[str, object] = {}         # ray metric by family name
        self.last: dict[tuple, float] = {}           # last value pushed per (sample name, labels)

    def push(self) -> None:
        for family in self.registry.collect():
            try:
                if family.type == "counter":
                    self._counter(family)
                elif family.type == "gauge":
                    self._gauge(family)
                elif family.type == "histogram":
                    self._histogram(family)
            except Exception as e:   # one bad family must not stop the others
                log.warning("metrics mirror: %s: %r", family.name, e)

    def _metric(self, kind: str, name: str, doc: str, tag_keys: tuple[str, ...], **kw):
        from ray.serve import metrics

        key = f"{kind}:{name}:{','.join(tag_keys)}"
        if key not in self.metrics:
            cls = {"counter": metrics.Counter, "gauge": metrics.Gauge, "histogram": metrics.Histogram}[kind]
            self.metrics[key] = cls(name, description=doc or name, tag_keys=tag_keys, **kw)
        return self.metrics[key]

    def _delta(self, sample_key: tuple, value: float) -> float:
        last = self.last.get(sample_key, 0.0)
        self.last[sample_key] = value
        return value if value < last else value - last   # went down: a reset, count from 0 again

    def _counter(self, family) -> None:
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue                                  # `_created` timestamps
            tags = dict(s.labels)
            delta = self._delta((s.name, tuple(sorted(tags.items()))), s.value)
            if delta > 0:
                self._metric("counter", family.name, family.documentation, tuple(sorted(tags))).inc(delta, tags=tags)

    def _gauge(self, family) -> None:
        for s in family.samples:
            tags = dict(s.labels)
            self._metric("gauge", family.name, family.documentation, tuple(sorted(tags))).set(s.value, tags=tags)

    def _histogram(self, family) -> None:
        series: dict[tuple, list[tuple[float, float]]] = {}
        for s in family.samples:
            if s.name.endswith("_bucket"):
                tags = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                series.setdefault(tags, []).append((float(s.labels["le"]), s.value))
        for tags, buckets in series.items():
            buckets.sort()
            bounds = [le for le, _ in buckets if math.isfinite(le)]
            hist = self._metric("histogram", family.name, family.documentation, tuple(k for k, _ in tags),
                                boundaries=bounds)
            below = 0.0
            for le, cumulative in buckets:
                in_bucket, below = cumulative - below, cumulative
                new = self._delta((family.name, tags, le), in_bucket)
                value = le if math.isfinite(le) else 2 * bounds[-1]
                for _ in range(int(new)):
                    hist.observe(value, tags=dict(tags))


async def mirror_forever(server, period_s: float = MIRROR_PERIOD_S) -> None:
    """In a replica: refresh the engine's numbers and push the registry every `period_s`."""
    mirror = RayMetricsMirror(server.stats.registry)
    while True:
        try:
            server.stats.observe_engine(await asyncio.wait_for(server.engine.stats(), 10))
        except Exception as e:   # an engine that cannot answer: the serving numbers still go out
            log.debug("metrics mirror: engine stats: %r", e)
        mirror.push()
        await asyncio.sleep(period_s)
