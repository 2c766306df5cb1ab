"""Serving metrics: a stats object the ingress feeds, and its Prometheus exporter.

`ServingStats` has `observe_*` methods and knows nothing of Prometheus
(the vLLM split between stats and loggers); `PrometheusExporter` renders it,
plus the engine's speculative metrics, in the Prometheus text format for
`/metrics`. Each exporter owns its registry, so several servers (or tests) in
one process never collide on metric names.

Conventions: latencies in seconds; inter-token latency is per token — a chunk of
k tokens that arrives d seconds after the previous one counts as k gaps of d/k
(a speculative step commits several tokens at once); mean accepted length
includes the bonus token (the engine's number, passed through).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from speculation.stats import MAXIMA, SpecStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 0.75, 1.0, 2.0, 5.0)
# Engine stats exported by name; of the other numeric keys of `engine.stats()`, the ones that
# only grow (ENGINE_COUNTERS) go out as counters `specflash_engine_<key>_total`, the rest as
# gauges `specflash_engine_<key>` (levels: KV blocks free, drafters alive, ...).
SPEC_GAUGES = {
    "acceptance_rate": "Share of drafted tokens the verifier accepted",
    "mean_accepted_length": "Tokens committed per verification step, bonus token included",
    "verifier_idle_fraction": "Share of time the verifier waited for a draft tree",
    "speculation_enabled": "1 while a live drafter feeds a verifier; 0 = decoding without speculation",
    "drafters_alive": "Drafters the verifiers heard from recently",
}
# The prefix caches' levels (gauges) and evictions (counters), exported as
# specflash_prefix_cache_<name>, by engine stats key.
PREFIX_CACHE_GAUGES = {
    "prefix_hit_rate": ("target_hit_rate", "Share of prompt tokens the target's prefills found in its prefix cache"),
    "prefix_cached_blocks": ("target_blocks", "KV blocks held in the target's prefix cache"),
    "draft_prefix_hit_rate": ("draft_hit_rate", "Share of prompt tokens the draft model found in its prefix cache"),
    "draft_prefix_cached_blocks": ("draft_blocks", "KV blocks held in the draft model's prefix cache"),
}
PREFIX_CACHE_COUNTERS = {
    "prefix_evictions": ("target_evictions", "Cached KV blocks of the target evicted for reuse"),
    "draft_prefix_evictions": ("draft_evictions", "Cached KV blocks of the draft model evicted for reuse"),
}
# Other names engines use for the same numbers.
SPEC_ALIASES = {"mean_accepted_len": "mean_accepted_length"}
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Cumulative engine numbers: SpecStats' summed fields, and the pipeline's own sums.
ENGINE_COUNTERS = frozenset(
    {k for k, f in SpecStats.__dataclass_fields__.items() if f.type in ("int", "float") and k not in MAXIMA}
    | {"drafter_rollbacks", "verifier_gc_s", "verifier_gc_full_collections"})
# Per-depth counts (`acceptance per depth` = rate(accepts) / rate(attempts), by depth).
DEPTH_COUNTERS = ("depth_attempts", "depth_accepts")


def _metric_name(key: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in key)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class EngineCollector:
    """The engine's last `stats()` as Prometheus families, typed: counters for what only grows
    (a restarted verifier starts again from 0, which `rate()` reads as a counter reset), gauges
    for levels, per-depth counters labelled `depth`, and each drafter's counters labelled
    `drafter` (the `drafters` list of the pipeline's stats)."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self):
        stats = self.stats
        for key, value in sorted(stats.items()):
            if not _number(value) or SPEC_ALIASES.get(key, key) in SPEC_GAUGES or key in PREFIX_CACHE_GAUGES:
                continue
            if key in PREFIX_CACHE_COUNTERS:
                name, doc = PREFIX_CACHE_COUNTERS[key]
                yield CounterMetricFamily(f"specflash_prefix_cache_{name}", doc, value=float(value))
                continue
            name = f"specflash_engine_{_metric_name(key)}"
            if key in ENGINE_COUNTERS:
                yield CounterMetricFamily(name, f"Engine counter {key!r}", value=float(value))
            else:
                yield GaugeMetricFamily(name, f"Engine stat {key!r}", value=float(value))
        for key in DEPTH_COUNTERS:
            if isinstance(stats.get(key), list):
                family = CounterMetricFamily(f"specflash_engine_{key}", f"Engine {key} per depth (1 = first draft token)",
                                             labels=["depth"])
                for d, n in enumerate(stats[key]):
                    family.add_metric([str(d + 1)], float(n))
                yield family
        drafters = [d for d in stats.get("drafters") or [] if isinstance(d, dict)]
        keys = sorted({k for d in drafters for k, v in d.items() if k in ENGINE_COUNTERS and _number(v)})
        for key in keys:
            family = CounterMetricFamily(f"specflash_drafter_{_metric_name(key)}", f"Drafter counter {key!r}",
                                         labels=["drafter"])
            for i, d in enumerate(drafters):
                if _number(d.get(key)):
                    family.add_metric([str(d.get("index", i))], float(d[key]))
            yield family


class ServingStats:
    """What the ingress observes about requests; rendered by `PrometheusExporter`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("specflash_requests", "Finished HTTP/gRPC requests",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("specflash_request_latency_seconds", "End-to-end request latency",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specflash_time_to_first_token_seconds",
                              "Time from admission to the first committed token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specflash_inter_token_latency_seconds",
                             "Time between consecutive output tokens (per token)",
                             buckets=ITL_BUCKETS, registry=r)
        self.queue_depth = Gauge("specflash_queue_depth",
                                 "Admitted generations still waiting for their first token",
                                 registry=r)
        self.running = Gauge("specflash_requests_running", "Generations producing tokens",
                             registry=r)
        self.rejected = Counter("specflash_requests_rejected", "Requests refused by admission",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("specflash_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("specflash_generation_tokens", "Generated tokens",
                                         registry=r)
        self.drafted_tokens = Counter("specflash_spec_drafted_tokens",
                                      "Draft tokens proposed for served requests", registry=r)
        self.accepted_tokens = Counter("specflash_spec_accepted_tokens",
                                       "Draft tokens accepted for served requests", registry=r)
        self.aborted = Counter("specflash_generations_aborted",
                               "Generations aborted (client gone, timeout, stop string)",
                               ["reason"], registry=r)
        self.engine = {k: Gauge(f"specflash_spec_{k}", doc, registry=r)
                       for k, doc in SPEC_GAUGES.items()}
        self.prefix_cache = {k: Gauge(f"specflash_prefix_cache_{name}", doc, registry=r)
                             for k, (name, doc) in PREFIX_CACHE_GAUGES.items()}
        self.engine_collector = EngineCollector()
        r.register(self.engine_collector)

    # -- observations -------------------------------------------------------------------
    def observe_request(self, endpoint: str, status: int, latency_s: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(latency_s)

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def observe_queued(self, delta: int) -> None:
        self.queue_depth.inc(delta)

    def observe_running(self, delta: int) -> None:
        self.running.inc(delta)

    def observe_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def observe_tokens(self, num_tokens: int, gap_s: float) -> None:
        """A chunk of `num_tokens` arrived `gap_s` after the previous one."""
        for _ in range(num_tokens):
            self.itl.observe(gap_s / num_tokens)

    def observe_prompt(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def observe_finished(self, completion_tokens: int, drafted: int, accepted: int) -> None:
        """A generation (one choice) ended, however it ended."""
        self.generation_tokens.inc(completion_tokens)
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)

    def observe_aborted(self, reason: str) -> None:
        self.aborted.labels(reason).inc()

    def observe_engine(self, stats: dict) -> None:
        """The engine's own numbers (`Engine.stats()`): SPEC_GAUGES by name, the rest typed by
        `EngineCollector`."""
        for key, value in stats.items():
            gauge = self.engine.get(SPEC_ALIASES.get(key, key)) or self.prefix_cache.get(key)
            if gauge is not None and _number(value):
                gauge.set(float(value))
        self.engine_collector.stats = dict(stats)


class PrometheusExporter:
    """Renders `ServingStats` in the Prometheus text exposition format."""

    def __init__(self, stats: ServingStats) -> None:
        self.stats = stats

    def render(self, engine_stats: dict | None = None) -> bytes:
        if engine_stats:
            self.stats.observe_engine(engine_stats)
        return generate_latest(self.stats.registry)
