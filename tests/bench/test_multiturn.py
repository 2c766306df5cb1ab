"""bench/multiturn.py, small: conversations with the prefix cache off and on, and a long prompt
among decoding streams with and without chunked prefill, against a control run of the same
streams matched by token index; the table, JSON and plot come out."""
import json

import pytest
import torch


def test_the_multiturn_bench_runs_every_configuration(tiny_target, close_draft, bench_script, tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        assert bench_script("multiturn").main([
            "--target", str(tiny_target), "--draft", str(close_draft), "--turns", "3", "--conversations", "1",
            "--system-tokens", "40", "--turn-tokens", "10", "--max-tokens", "4", "--long-prompt", "64",
            "--streams", "2", "--decode-tokens", "200", "--settle-s", "0.01", "--chunk", "16", "--block-size", "8",
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
    assert "p99 ITL control ms" in out and "during/control" in out
    for run in result["interference"].values():               # each configuration's pair: its own control
        assert run["gaps_control"] == run["gaps_during"] > 0 and run["gaps_control_missing"] == 0
        assert run["ratio_control"] == pytest.approx(run["p99_itl_during_s"] / run["p99_itl_control_s"])
        assert len(run["pairs"]) == 1 and run["ratio_control_per_pair"] == [run["ratio_control"]]


def test_the_interference_run_takes_its_configurations_and_refuses_unknown_ones(
        tiny_target, close_draft, bench_script, tmp_path, capsys):
    threads = torch.get_num_threads()
    # the streams must still decode when the long prompt arrives and while it prefills: the tiny
    # model's steps take well under a millisecond (each layer one C call), so 200 tokens and a
    # 10 ms settle (120 tokens and 100 ms once outran the settle)
    common = ["--target", str(tiny_target), "--draft", str(close_draft), "--parts", "interference",
              "--long-prompt", "48", "--streams", "2", "--decode-tokens", "200", "--settle-s", "0.01", "--chunk", "16",
              "--block-size", "8", "--num-blocks", "256", "--out", str(tmp_path)]
    try:
        assert bench_script("multiturn").main(common + ["--prefill", "budget", "--repeats", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("multiturn-*.json")]
    assert set(result["interference"]) == {"budget 0.5 of a step"}
    run = result["interference"]["budget 0.5 of a step"]
    assert run["gaps_before"] > 0 and run["gaps_during"] > 0   # the streams outlast the prompt's prefill
    assert len(run["pairs"]) == 2 and len(run["ratio_control_per_pair"]) == 2     # --repeats 2
    matched = []
    for pair in run["pairs"]:      # each control's gaps at its run's "during" numbers, recomputed from the JSON
        spans, gaps, firsts = pair["during_gap_numbers"], pair["control_gaps"], pair["control_first_gap"]
        last = max(span[1] for span in spans if span)
        assert max(first + len(g) for first, g in zip(firsts, gaps)) == last + 1   # decoded just that far
        own = [g[k - first] for g, first, span in zip(gaps, firsts, spans) if span
               for k in range(span[0], span[1] + 1)]
        assert own == pair["gaps"]["control"] and len(own) == pair["gaps_during"]
        matched += own
    p99 = bench_script("multiturn").percentile(matched, 99)      # pooled over the pairs
    assert len(matched) == run["gaps_control"] == run["gaps_during"]
    assert run["p99_itl_control_s"] == pytest.approx(p99)
    assert run["ratio_control"] == pytest.approx(run["p99_itl_during_s"] / p99)
    with pytest.raises(SystemExit) as exit_:
        bench_script("multiturn").main(common + ["--prefill", "budget,whole"])
    assert exit_.value.code == 2 and "--prefill takes" in capsys.readouterr().err


def test_the_control_gaps_are_matched_by_token_index_not_by_time(bench_script):
    bench = bench_script("multiturn")

    def stream(stamps, gaps):
        return {"stamps": stamps, "gaps": gaps}

    # with the prompt: gap k ends at stamps[k + 1]; a stall (gap 3: 7 s) inside the window [2.5, 11.5)
    slowed = stream([0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0], [1.0, 1.0, 1.0, 7.0, 1.0, 1.0])
    # a first chunk of two tokens: no gap before token 1, so gaps[0] is gap 1 (token 1 to 2)
    chunked = stream([0.0, 0.0, 5.0, 11.0, 20.0], [5.0, 6.0, 9.0])
    # the control's tokens all came inside that window in time: matching by time would take every gap
    alone = stream([2.6, 2.7, 2.8, 2.9, 3.0, 3.1, 3.2], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    short = stream([3.0, 4.0, 5.0], [0.7, 0.8])          # gaps 0 and 1 only: gap 2 is missing
    assert bench.gap_numbers(slowed, 2.5, 11.5) == range(2, 5)
    assert bench.gap_numbers(chunked, 2.5, 11.5) == range(1, 3)
    assert bench.gap_at(chunked, 0) is None and bench.gap_at(chunked, 1) == 5.0
    matched = bench.match_control([slowed, chunked], [alone, short], 2.5, 11.5)
    assert matched["during"] == [1.0, 7.0, 1.0, 5.0, 6.0]
    assert matched["control"] == [0.3, 0.4, 0.5, 0.8]    # each stream's own gaps 2..4 and 1..2
    assert matched["missing"] == 1 and matched["spans"] == [[2, 4], [1, 2]]
    assert bench.match_control([slowed], [alone], 30.0, 40.0) == {"during": [], "control": [], "missing": 0,
                                                                   "spans": [None]}
