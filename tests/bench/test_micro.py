"""bench/micro.py: the modes run in turn for several rounds, the pipeline's overhead is paired
within each round (the machine's speed drifts between rounds)."""
import json

import pytest


def _row(mode: str, steps_per_s: float, **kw) -> dict:
    return {"mode": mode, "tokens_per_s": 5 * steps_per_s, "steps_per_s": steps_per_s, "steps": 10,
            "tokens_per_step": 5.0, "forward_ms_per_step": 1.0, "draft_ms_per_step": 4.0,
            "other_ms_per_step": 0.5, **kw}


def test_overhead_is_paired_within_each_round(bench_script):
    micro = bench_script("micro")
    # round 1 a slow machine, round 2 a fast one: 8 vs 10 ms and 4 vs 5 ms a step
    rounds = [[_row("off", 900), _row("sync", 125), _row("pipeline", 100)],
              [_row("off", 900), _row("sync", 250), _row("pipeline", 200)],
              [_row("off", 900), _row("sync", 200), _row("pipeline", 100)]]
    out = micro.summary(rounds)
    assert out["overhead_ms_per_round"] == pytest.approx([2.0, 1.0, 5.0])
    assert out["overhead_ms"] == pytest.approx(2.0)
    med = {r["mode"]: r for r in out["medians"]}
    assert med["sync"]["steps_per_s"] == 200 and med["pipeline"]["steps_per_s"] == 100
    assert med["off"]["steps"] == 30


def test_in_process_rounds_write_every_round(bench_script, tmp_path, capsys):
    micro = bench_script("micro")
    path = tmp_path / "micro.json"
    assert micro.main(["--no-pipeline", "--requests", "1", "--rounds", "2", "--max-tokens", "6",
                       "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    assert len(data["rounds"]) == 2 and [r["mode"] for r in data["rounds"][0]] == ["off", "sync"]
    assert data["overhead_ms"] is None
    sync = data["rounds"][1][1]
    assert sync["tokens_per_step"] > 1          # the draft is the target's weights: all accepted
    assert "medians of 2 rounds" in capsys.readouterr().out
