"""bench/draft_runs.py and bench/async_model.py, small: where the draft misses, and the trace model
that replays speculation from those misses."""
import json

import pytest
import torch


def test_the_draft_runs_bench_counts_where_the_draft_misses(tiny_target, close_draft, far_draft, bench_script,
                                                           tmp_path, capsys):
    threads = torch.get_num_threads()
    results = {}
    try:
        for name, draft in (("close", close_draft), ("far", far_draft)):
            out = tmp_path / f"{name}.json"
            assert bench_script("draft_runs").main(["--target", str(tiny_target), "--draft", str(draft),
                                                    "--prompts", "1", "--max-tokens", "12", "--threads", "1",
                                                    "--out", str(out)]) == 0
            results[name] = json.loads(out.read_text())["result"]
    finally:
        torch.set_num_threads(threads)
    assert "right after a miss" in capsys.readouterr().out
    for result in results.values():
        assert set(result) == {"code", "math", "chat"}
        for r in result.values():
            assert r["tokens"] == 12
            for key in ("top1", "top2_given_miss", "right_after_right", "right_after_miss"):
                assert r[key] is None or 0.0 <= r[key] <= 1.0
    top1 = {name: sum(r["top1"] for r in result.values()) / 3 for name, result in results.items()}
    assert top1["close"] > top1["far"]            # a draft near the target agrees with it more often
    for name in ("close", "far"):                 # per prompt, the rank of every target token
        saved = json.loads((tmp_path / f"{name}.json").read_text())
        assert [r["category"] for r in saved["ranks"]] == ["code", "math", "chat"]
        for r in saved["ranks"]:
            assert len(r["ranks"]) == 12 and all(0 <= x <= 16 for x in r["ranks"])
            # rank 0 is the draft's argmax: the same count as top-1 agreement
            assert sum(x == 0 for x in r["ranks"]) == round(saved["result"][r["category"]]["top1"] * 12)


MISS_AT_1 = [0, 1, 0, 0, 0, 0, 0, 0, 0]     # the draft wrong at position 1 only (the target's token: its rank 1)
FAR_MISS_AT_1 = [0, 2, 0, 0, 0, 0, 0, 0, 0]  # the same, the target's token its third choice


def _costs(m):
    """Forwards of 1, 2, 3 rows at 10, 12, 14 ms; a draft level 1 ms, `off` 10, overhead 0.5, a round trip 3."""
    return m.Costs({1: 10.0, 2: 12.0, 3: 14.0}, draft_level_ms=1.0, off_ms=10.0, step_overhead_ms=0.5,
                   round_trip_ms=3.0)


def test_the_async_model_replays_speculation_from_the_ranks(bench_script):
    """bench/async_model.py: steps replayed from where the draft agrees, priced by hand here."""
    m = bench_script("async_model")
    c, ranks = _costs(m), MISS_AT_1
    assert c.forward(5) == 18.0                   # beyond the measured rows: the last slope
    right = [0] * 9                               # the draft always right: every tree of K = 2
    assert m.sync_ms(right, 9, 2, c) == 3 * (2.0 + 14.0 + 0.5)     # commits 3 tokens
    assert m.pipeline_ms(right, 9, 2, c) == (3 * 14.5, 0.0)        # and overlaps its drafting
    # a miss at position 1: the first tree commits 2 tokens and contradicts the drafter
    # bridge: the token at 2 alone; the guess there (rank 0) was right, so trees at 3 and 6 follow
    assert m.pipeline_ms(ranks, 9, 2, c) == (14.5 + 10.5 + 14.5 + 14.5, 0.0)
    # ... had the guess been wrong, the verifier waits a round trip and K + 1 draft levels
    assert m.pipeline_ms([0, 1, 2, 0, 0, 0, 0, 0, 0], 9, 2, c) == (14.5 + 10.5 + 6.0 + 14.5 + 14.5, 6.0)
    # restart 1: wait a round trip and 2 draft levels, verify a chain of one after position 2
    # (accepted, with the bonus at 3 as guessed), then trees at 4 and 7
    assert m.pipeline_ms(ranks, 9, 2, c, restart=1) == (14.5 + 5.0 + 12.5 + 14.5 + 14.5, 5.0)
    assert m.pipeline_ms(ranks, 9, 2, c, contradictions=False)[1] == 0.0
    # a drafter slower than the verifier (3 levels of 5 ms against a 14.5 ms step) makes it
    # wait: the second tree is filed at 15 + 1.5, the third begun once the first's signal
    # was heard (16) and filed at 31 + 1.5
    slow = m.Costs({1: 10.0, 2: 12.0, 3: 14.0}, 5.0, 10.0, 0.5, 3.0)
    assert m.pipeline_ms(right, 9, 2, slow) == (16.5 + 14.5 + 1.5 + 14.5, 3.5)
    # hedged with the draft's second choice (the target's token at 1 ranks 1): no bridge, trees
    # at 0, 2, 5 and 8; a token ranked 2 is not covered, so that pipeline bridges as before
    assert m.pipeline_ms(ranks, 9, 2, c, hedges=1) == (4 * 14.5, 0.0)
    far = FAR_MISS_AT_1
    assert m.pipeline_ms(far, 9, 2, c, hedges=1) == m.pipeline_ms(far, 9, 2, c)
    # a token outside the draft's kept choices (rank RANKS) is never hedged
    lost = [0, m.RANKS, 0, 0, 0, 0, 0, 0, 0]
    assert m.pipeline_ms(lost, 9, 2, c, hedges=m.RANKS) == m.pipeline_ms(lost, 9, 2, c)


def test_the_async_models_costs_come_from_a_run(bench_script):
    m = bench_script("async_model")
    # sync's draft level comes from the run's own sync row: 3 tokens a step at 150 tokens/s is
    # 20 ms a step, of which the 3-row forward and the overhead take 14.5: 2.75 ms a level
    run = {"args": {"spec_len": 2}, "rows": [{"method": "off", "tokens_per_s": 100.0},
                                             {"method": "sync", "tokens_per_s": 150.0, "mean_accepted_len": 3.0}],
           "pipeline_costs_ms": {"step_1_row": 10.5, "draft_level": 1.0, "forward_1_rows": 10.0,
                                 "forward_2_rows": 12.0, "forward_3_rows": 14.0}}
    fitted = m.Costs.from_run(run, 3.0)
    assert (fitted.d, fitted.sync_d, fitted.o, fitted.off_ms) == (1.0, 2.75, 0.5, 10.0)
    assert m.sync_ms([0] * 9, 9, 2, fitted) == 3 * 20.0
    # ... unless the row says what its draft levels cost, as measured in process (the rate
    # also carries each request's prefill)
    run["rows"][1]["draft_ms_per_node"] = 1.25
    assert m.Costs.from_run(run, 3.0).sync_d == 1.25
    # one shape seen in disturbed steps does not bend the line beyond the measured rows
    noisy = m.Costs({1: 10.0, 2: 12.0, 3: 40.0, 4: 16.0}, 1.0, 10.0, 0.0, 3.0)
    assert noisy.forward(6) == 20.0 and noisy.forward(3) == 40.0


def test_the_async_model_compares_with_sync_s_fastest_chain_and_a_better_draft(bench_script):
    m = bench_script("async_model")
    c, ranks = _costs(m), MISS_AT_1
    speed = m.model([{"category": "code", "ranks": ranks}], 9, 2, c)
    assert speed["sync"] == pytest.approx(90.0 / m.sync_ms(ranks, 9, 2, c))
    # the fair baseline: sync's fastest chain of 1 .. K on the same prompts
    by_k = {j: 90.0 / m.sync_ms(ranks, 9, j, c) for j in (1, 2)}
    assert speed["fastest sync k"] == max(by_k, key=by_k.get)
    assert speed["fastest sync"] == pytest.approx(max(by_k.values()))
    assert speed["restart 3"] == pytest.approx(90.0 / m.pipeline_ms(ranks, 9, 2, c, restart=3)[0])
    # sync's very steps with their drafting hidden (not a bound on the others: a bridge may
    # commit a token more cheaply than a tree does)
    assert speed["never contradicted"] == pytest.approx(speed["sync"] * (2.0 + 14.5) / 14.5)
    # a better draft: every miss made right (fix 1) agrees everywhere, and its pipeline is never
    # contradicted; fix 0 is the draft as it is
    table = m.quality_table([{"category": "code", "ranks": ranks}], 9, 2, c, [0.0, 1.0], 2)
    assert [row[:3] for row in table] == [["code", "0", "0.89"], ["code", "1", "1.00"],
                                          ["all", "0", "0.89"], ["all", "1", "1.00"]]
    same = m.model([{"category": "code", "ranks": ranks}], 9, 2, c, restarts=(3,))
    assert table[0][4] == f"{same['restart 3'] / same['fastest sync']:.2f}"
    assert table[1][4] == table[1][5]                 # nothing to contradict: restarts never happen


def test_the_async_models_command_line(bench_script, tmp_path, capsys):
    """It reads draft_runs' ranks and an e2e_async run's costs; bad choices are clear errors."""
    m = bench_script("async_model")
    ranks, far = MISS_AT_1, FAR_MISS_AT_1
    (tmp_path / "ranks.json").write_text(json.dumps({"ranks": [{"category": "code", "ranks": ranks}]}))
    (tmp_path / "run.json").write_text(json.dumps({
        "rows": [{"method": "off", "tokens_per_s": 100.0}],
        "pipeline_costs_ms": {"step_1_row": 10.5, "draft_level": 1.0, "forward_1_rows": 10.0,
                              "forward_2_rows": 12.0, "forward_3_rows": 14.0}}))
    assert m.main(["--ranks", str(tmp_path / "ranks.json"), "--costs", str(tmp_path / "run.json"),
                   "--spec-len", "2", "--max-tokens", "9", "--round-trip-ms", "3", "--hedges", "1"]) == 0
    out = capsys.readouterr().out
    assert "| code | 3 |" in out and "hedged 1" in out and "fastest sync (K)" in out
    (tmp_path / "ranks2.json").write_text(json.dumps({"ranks": [{"category": "code", "ranks": ranks},
                                                                {"category": "chat", "ranks": far}]}))
    assert m.main(["--ranks", str(tmp_path / "ranks2.json"), "--costs", str(tmp_path / "run.json"),
                   "--spec-len", "2", "--max-tokens", "9", "--round-trip-ms", "3", "--categories", "code"]) == 0
    out = capsys.readouterr().out                # the chat prompt left out, `all` is code's alone
    assert "| code | 3 |" in out and "| chat |" not in out
    assert out.split("| code | 3 |")[1].split("\n")[0] == out.split("| all | 3 |")[1].split("\n")[0]
    with pytest.raises(SystemExit):               # no prompt of those categories: a clear error
        m.main(["--ranks", str(tmp_path / "ranks.json"), "--costs", str(tmp_path / "run.json"), "--categories", "math"])
    assert "--categories" in capsys.readouterr().err
    with pytest.raises(SystemExit):               # a hedge past the ranks kept: a clear error
        m.main(["--ranks", str(tmp_path / "ranks.json"), "--costs", str(tmp_path / "run.json"),
                "--hedges", str(m.RANKS)])
    assert "--hedges" in capsys.readouterr().err