"""bench/poisson.py against the OpenAI front in process (FakeEngine, no Ray): the Poisson schedule
has the asked rate and mix, every arrival is sent and answered, goodput follows the SLO, and the
plot and table come out."""
from __future__ import annotations

import asyncio
import statistics

import httpx
import pytest

from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from serving.testing import FakeEngine, tiny_byte_tokenizer


@pytest.fixture(scope="module")
def poisson(bench_script):
    return bench_script("poisson")


def test_arrivals_are_poisson_at_the_rate_with_the_mix(poisson):
    plan = poisson.arrivals(rate=5.0, duration=400.0, seed=1)
    assert abs(len(plan) / 400.0 - 5.0) < 0.3                 # ~2000 arrivals: rate within 6 %
    gaps = [b[0] - a[0] for a, b in zip(plan, plan[1:])]
    assert abs(statistics.mean(gaps) - 0.2) < 0.02
    assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - 1.0) < 0.1   # exponential: CV 1
    shares = {k: sum(1 for _, kind, _ in plan if kind == k) / len(plan) for k in poisson.KINDS}
    for kind, (share, _) in poisson.KINDS.items():
        assert abs(shares[kind] - share) < 0.05, (kind, shares)
    assert poisson.arrivals(5.0, 10.0, seed=1) == poisson.arrivals(5.0, 10.0, seed=1)   # seeded


def test_cell_sends_every_arrival_and_counts_goodput_under_the_slo(poisson, tmp_path):
    tok = tiny_byte_tokenizer()
    engine = FakeEngine(tokenizer=tok, delay_s=0.005)
    server = OpenAIServer(engine, tok, ServerSettings(max_context=512))
    transport = httpx.ASGITransport(app=build_fastapi_app(server))
    tokens = {"code": 12, "math": 8, "chat": 6}
    run = lambda **slo: asyncio.run(poisson.run_cell("http://poisson.test", 4.0, "auto", 2.0, tokens,  # noqa: E731
                                                    seed=3, transport=transport, **slo))
    cell = run(slo_ttft=30.0, slo_itl=30.0)
    assert cell["sent"] == len(poisson.arrivals(4.0, 2.0, 3)) and cell["completed"] == cell["sent"]
    assert cell["errors"] == 0 and cell["slo_met"] and cell["good_requests"] == cell["sent"]
    assert cell["goodput_req_s"] == pytest.approx(cell["sent"] / 2.0)
    lengths = sorted(r.sampling.max_tokens for r in engine.requests)
    assert set(lengths) <= set(tokens.values()) and engine.requests[0].sampling.temperature == 0
    strict = run(slo_ttft=1e-6, slo_itl=30.0)           # mutation control: an SLO nobody meets
    assert strict["good_requests"] == 0 and not strict["slo_met"]
    assert "p99 TTFT <= 1e-06 s" in poisson.table([strict], 1e-6, 30.0)
    assert poisson.plot([cell, {**cell, "rate": 8.0}], tmp_path / "itl.png").stat().st_size > 0


def test_cells_turn_the_modes_order_and_record_the_engines_counters(poisson, monkeypatch):
    """At each rate the mode that went second goes first next (a drift, or what one mode leaves
    the next, favours neither); each cell carries the engine's counters over its window."""
    import argparse

    order, counts = [], iter(range(100))

    async def fake_cell(url, rate, mode, *rest, **kw):
        order.append((rate, mode))
        return {"rate": rate, "mode": mode, "completed": 1, "sent": 1, "goodput_req_s": 1.0}

    def counters(url):
        n = float(next(counts))
        return {"num_spec_steps": 10 * n, "planner_verify_1_rows_s": n}

    monkeypatch.setattr(poisson, "run_cell", fake_cell)
    monkeypatch.setattr(poisson.load, "engine_counters", counters)
    args = argparse.Namespace(rates=[0.5, 1.0, 2.0], modes=["off", "auto"], duration=1.0, slo_ttft=2.0,
                              slo_itl=0.2, seed=0)
    cells = poisson.run_cells("http://x", args, {"code": 1, "math": 1, "chat": 1})
    assert order == [(0.5, "off"), (0.5, "auto"), (1.0, "auto"), (1.0, "off"), (2.0, "off"), (2.0, "auto")]
    assert [(c["rate"], c["mode"]) for c in cells] == [(r, m) for r in args.rates for m in args.modes]
    assert all(c["engine"] == {"num_spec_steps": 10.0} for c in cells)     # after - before, per window
    assert cells[0]["planner"] == {"planner_verify_1_rows_s": 1.0}         # the gauge at the window's end
