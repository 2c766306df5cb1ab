"""bench/e2e.py, e2e_async.py and engine_load.py, small: the async pipeline in the same run as
the baselines (issue 4, item 8), sync at its best chain length, the engine under concurrent load."""
import json

import pytest
import torch


def test_the_e2e_bench_measures_the_pipeline_beside_the_baselines(ray_cluster, tiny_target, close_draft, tmp_path,
                                                                 bench_script):
    import ray

    threads = torch.get_num_threads()
    methods = ["off", "sync-chain", "async", "hf-target", "hf-assisted"]
    try:
        assert bench_script("e2e").main(["--target", str(tiny_target), "--draft", str(close_draft), "--prompts", "1",
                                  "--max-tokens", "6", "--spec-len", "2", "--threads", "1", "--eagle", "none",
                                  "--methods", *methods, "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    (out,) = tmp_path.glob("e2e-*.json")
    rows = {r["method"]: r for r in json.loads(out.read_text())["summary"]}
    assert sorted(rows) == sorted(methods)
    pipeline = rows["async"]
    assert pipeline["exact_vs_off"] == 1.0                       # greedy: token for token the target alone
    assert pipeline["tokens"] == rows["off"]["tokens"] > 0
    assert 0.0 <= pipeline["verifier_idle_fraction"] <= 1.0
    assert pipeline["acceptance_rate"] is not None and pipeline["gamma"] is not None
    assert all(rows[m]["verifier_idle_fraction"] is None for m in methods if m != "async")
    assert ray.is_initialized()                                   # the shared cluster is left running


def test_the_e2e_bench_runs_the_eagle_pipeline_beside_the_layered_one(ray_cluster, tiny_target, close_draft,
                                                                      fused_eagle_draft, tmp_path, bench_script):
    """`async-eagle`: a second pipeline, its drafter the EAGLE head (here a fused one), alternated
    with `async` prompt by prompt on the same Ray; both token for token the target alone."""
    import ray

    threads = torch.get_num_threads()
    methods = ["off", "async", "async-eagle"]
    try:
        assert bench_script("e2e").main(["--target", str(tiny_target), "--draft", str(close_draft), "--prompts", "1",
                                         "--max-tokens", "6", "--spec-len", "2", "--threads", "1", "--no-hf",
                                         "--eagle", str(fused_eagle_draft), "--methods", *methods,
                                         "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    (out,) = tmp_path.glob("e2e-*.json")
    rows = {r["method"]: r for r in json.loads(out.read_text())["summary"]}
    assert sorted(rows) == sorted(methods)
    for m in ("async", "async-eagle"):
        assert rows[m]["exact_vs_off"] == 1.0 and rows[m]["tokens"] == rows["off"]["tokens"] > 0
        assert 0.0 <= rows[m]["verifier_idle_fraction"] <= 1.0
    # the close draft always speculates; `auto` may stop drafting with the random head in six tokens
    # (its drafting through the pipeline: tests/cluster/test_eagle.py)
    assert rows["async"]["acceptance_rate"] is not None
    assert ray.is_initialized()                                   # the shared cluster is left running


def test_one_core_each_keeps_every_model_to_one_core(ray_cluster, tiny_target, close_draft, tmp_path, bench_script):
    """`--one-core-each`: the in-process methods on one thread, and no verifier forward of the
    pipeline on its drafter's core (the CPU stand-in for one device per model)."""
    threads = torch.get_num_threads()
    try:
        assert bench_script("e2e").main(["--target", str(tiny_target), "--draft", str(close_draft), "--prompts", "1",
                                  "--max-tokens", "6", "--spec-len", "2", "--eagle", "none", "--no-hf",
                                  "--methods", "off", "sync-chain", "async", "--one-core-each",
                                  "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    (out,) = tmp_path.glob("e2e-*-one-core.json")
    info = json.loads(out.read_text())
    assert info["machine"]["threads"] == 1 and info["args"]["one_core_each"] == "True"
    assert info["async_pipeline"]["target_forwards"] > 0
    assert info["async_pipeline"]["borrowed_steps"] == 0
    rows = {r["method"]: r for r in info["summary"]}
    assert rows["async"]["exact_vs_off"] == 1.0 and rows["async"]["tokens"] == rows["off"]["tokens"] > 0


def test_e2e_async_compares_the_pipeline_with_sync_at_its_best_chain_length(
        ray_cluster, tiny_target, close_draft, tmp_path, bench_script, capsys):
    """`bench/e2e_async.py --sync-spec-lens`: sync at other chain lengths in the same run, and
    the pipeline over the fastest of them."""
    bench = bench_script("e2e_async")
    bench.RESULTS = tmp_path
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--target", str(tiny_target), "--draft", str(close_draft), "--prompts", "1",
                           "--categories", "code,math", "--max-tokens", "6", "--spec-len", "2", "--one-core-each",
                           "--sync-spec-lens", "1,2,3", "--tag", "t"]) == 0
    finally:
        torch.set_num_threads(threads)
    info = json.loads((tmp_path / "e2e_async_t.json").read_text())
    rows = {r["method"]: r for r in info["rows"]}
    assert sorted(rows) == ["async", "off", "sync", "sync-k1", "sync-k3"]     # K = 2 is `sync` itself
    assert all(r["exact_vs_off"] == 1.0 for r in rows.values())
    fastest = max(("sync", "sync-k1", "sync-k3"), key=lambda m: rows[m]["tokens_per_s"])
    assert info["fastest_sync"] == fastest
    assert info["async_over_fastest_sync"] == rows["async"]["tokens_per_s"] / rows[fastest]["tokens_per_s"]
    # sync's draft level as measured in process (the async rows' drafting is the drafter's)
    assert all(rows[m]["draft_ms_per_node"] > 0 for m in ("sync", "sync-k1", "sync-k3"))
    assert rows["async"]["draft_ms_per_node"] is None and rows["off"]["draft_ms_per_node"] is None
    # each category's ratio, from that category's runs alone
    assert rows["off"]["by_category"] == {"code": 1.0, "math": 1.0}
    by_category = info["async_over_fastest_sync_by_category"]
    assert set(by_category) == {"code", "math"} and all(v > 0 for v in by_category.values())
    for c, v in by_category.items():
        assert v == rows["async"]["by_category"][c] / rows[fastest]["by_category"][c]
    out = capsys.readouterr().out
    assert f"the fastest sync ({fastest})" in out and f"by category: code {by_category['code']:.2f}" in out
    for bad in ("2,x", "0"):                                       # a clear error, nothing run
        with pytest.raises(SystemExit) as refused:
            bench.main(["--sync-spec-lens", bad])
        assert refused.value.code == 2, bad
    assert "--sync-spec-lens" in capsys.readouterr().err


def test_engine_load_drives_both_modes_through_the_engine(ray_cluster, tiny_target, close_draft, tmp_path,
                                                          bench_script):
    """bench/engine_load.py: concurrent clients in process, a window per mode, the verifier's
    and the drafter's counters over each; `off` drafts nothing."""
    out = tmp_path / "load.json"
    assert bench_script("engine_load").main(["--target", str(tiny_target), "--draft", str(close_draft),
                                             "--concurrency", "3", "--seconds", "2", "--rounds", "1",
                                             "--max-tokens", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["off", "auto"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["num_batches"] > 0 and r["concurrency"] == 3
        assert 0 <= r["borrowed_steps"] <= r["num_batches"]
        assert r["busy_ms_per_forward"] == 1e3 * r["verifier_busy_s"] / r["num_batches"]
    off = rows[0]
    assert off["num_spec_steps"] == 0 and off["drafter_trees_drafted"] == 0


def test_engine_load_refuses_bad_arguments(bench_script, capsys):
    bench = bench_script("engine_load")
    for bad in (["--concurrency", "0"], ["--seconds", "0"], ["--target", "x"]):
        with pytest.raises(SystemExit) as refused:
            bench.main(bad)
        assert refused.value.code == 2, bad
    assert "--target and --draft go together" in capsys.readouterr().err
