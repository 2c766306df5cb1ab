"""bench/multiturn.py, small: conversations with the prefix cache off and on, and a long prompt
among decoding streams with and without chunked prefill; the table, JSON and plot come out."""
import json

import pytest
import torch


def test_the_multiturn_bench_runs_every_configuration(tiny_target, close_draft, bench_script, tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        assert bench_script("multiturn").main([
            "--target", str(tiny_target), "--draft", str(close_draft), "--turns", "3", "--conversations", "1",
            "--system-tokens", "40", "--turn-tokens", "10", "--max-tokens", "4", "--long-prompt", "64",
            "--streams", "2", "--decode-tokens", "40", "--settle-s", "0.2", "--chunk", "16", "--block-size", "8",
            "--num-blocks", "256", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "TTFT turn 1 ms" in out and "chunks of 16" in out
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("multiturn-*.json")]
    assert list(tmp_path.glob("multiturn-*.png"))
    runs = result["conversations"]
    assert set(runs) == {f"spec {s}, cache {c}" for s in ("off", "chain") for c in ("off", "on")}
    for spec in ("off", "chain"):      # the same answers with the cache; later turns found cached
        on, off = runs[f"spec {spec}, cache on"], runs[f"spec {spec}, cache off"]
        assert [t["tokens"] for t in on["turns"]] == [t["tokens"] for t in off["turns"]]
        assert all(t["cached_tokens"] > 0 for t in on["turns"] if t["turn"] > 0)
        assert all(t["cached_tokens"] == 0 for t in off["turns"])
    assert runs["spec chain, cache on"]["target_hit_rate"] == runs["spec off, cache on"]["target_hit_rate"] > 0
    assert runs["spec chain, cache on"]["draft_hit_rate"] > 0
    assert set(result["interference"]) == {"one shot", "chunks of 16", "budget 0.5 of a step"}
    budgeted = result["interference"]["budget 0.5 of a step"]
    assert budgeted["engine"]["prefill_token_s"] > 0          # the budget measured its prefills


def test_the_interference_run_takes_its_configurations_and_refuses_unknown_ones(
        tiny_target, close_draft, bench_script, tmp_path, capsys):
    threads = torch.get_num_threads()
    common = ["--target", str(tiny_target), "--draft", str(close_draft), "--parts", "interference",
              "--long-prompt", "48", "--streams", "2", "--decode-tokens", "40", "--settle-s", "0.2", "--chunk", "16",
              "--block-size", "8", "--num-blocks", "256", "--out", str(tmp_path)]
    try:
        assert bench_script("multiturn").main(common + ["--prefill", "budget"]) == 0
    finally:
        torch.set_num_threads(threads)
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("multiturn-*.json")]
    assert set(result["interference"]) == {"budget 0.5 of a step"}
    run = result["interference"]["budget 0.5 of a step"]
    assert run["gaps_before"] > 0 and run["gaps_during"] > 0
    with pytest.raises(SystemExit) as exit_:
        bench_script("multiturn").main(common + ["--prefill", "budget,whole"])
    assert exit_.value.code == 2 and "--prefill takes" in capsys.readouterr().err
