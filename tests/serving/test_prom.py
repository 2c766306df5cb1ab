"""The /metrics exposition is typed as Prometheus expects (issue 26): what only grows is a counter
(`_total`, so `rate()` works and a restarted verifier reads as a counter reset), levels are gauges,
per-depth and per-drafter numbers carry `depth` / `drafter` labels."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from serving.prom import ENGINE_COUNTERS, PrometheusExporter, ServingStats
from speculation.stats import SpecStats


def families(engine_stats: dict) -> dict:
    text = PrometheusExporter(ServingStats()).render(engine_stats).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def pipeline_stats() -> dict:
    stats = SpecStats()
    stats.observe_verification(num_nodes=4, num_accepted=2, max_depth=4, accepted_depth=2)
    stats.observe_rejected_frame()
    out = stats.as_dict()
    out.update(kv_blocks_free=60, kv_blocks_total=64, drafters_alive=1, speculation_enabled=1,
               drafter_rollbacks=3, drafters=[{"index": 0, "trees_drafted": 5, "rollbacks": 1},
                                              {"index": 2, "trees_drafted": 7, "rollbacks": 0}])
    return out


def test_cumulative_engine_numbers_are_counters_and_levels_gauges():
    fam = families(pipeline_stats())
    for name in ("num_steps", "num_drafted", "num_accepted", "frames_rejected", "drafter_rollbacks",
                 "verifier_busy_s"):
        f = fam[f"specflash_engine_{name}"]             # the parser strips `_total`
        assert f.type == "counter", name
        assert f.samples[0].name == f"specflash_engine_{name}_total"
    assert fam["specflash_engine_num_drafted"].samples[0].value == 4
    assert fam["specflash_engine_frames_rejected"].samples[0].value == 1
    for name in ("kv_blocks_free", "kv_blocks_total", "ring_max"):
        assert fam[f"specflash_engine_{name}"].type == "gauge", name
    assert fam["specflash_spec_speculation_enabled"].type == "gauge"
    assert "specflash_engine_speculation_enabled" not in fam          # exported once, as specflash_spec_*
    assert fam["specflash_requests"].type == "counter"                # serving's own: _total already


def test_per_depth_and_per_drafter_counters_are_labelled():
    fam = families(pipeline_stats())
    depth = {s.labels["depth"]: s.value for s in fam["specflash_engine_depth_attempts"].samples}
    assert depth == {"1": 1.0, "2": 1.0, "3": 1.0, "4": 0.0}
    accepts = {s.labels["depth"]: s.value for s in fam["specflash_engine_depth_accepts"].samples}
    assert accepts == {"1": 1.0, "2": 1.0, "3": 0.0, "4": 0.0}
    trees = {s.labels["drafter"]: s.value for s in fam["specflash_drafter_trees_drafted"].samples}
    assert trees == {"0": 5.0, "2": 7.0}
    assert fam["specflash_drafter_trees_drafted"].type == "counter"


def test_every_summed_stats_field_is_a_counter_and_no_level_is():
    """Mutation control for the classification: maxima and ratios are levels; the rest add up."""
    assert {"ring_max", "exchange_s_max", "work_s_max", "acceptance_rate"}.isdisjoint(ENGINE_COUNTERS)
    a, b = SpecStats(num_steps=2, ring_max=3), SpecStats(num_steps=5, ring_max=4)
    merged = a.merge(b)
    assert (merged.num_steps, merged.ring_max) == (7, 4)   # summed -> counter; max -> gauge
