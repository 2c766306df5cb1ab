"""bench/e2e.py, small: the async pipeline runs in the same run as the baselines (issue 4, item 8)."""
import json

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
                           "--categories", "code", "--max-tokens", "6", "--spec-len", "2", "--one-core-each",
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
    assert f"the fastest sync ({fastest})" in capsys.readouterr().out
    for bad in ("2,x", "0"):                                       # a clear error, nothing run
        try:
            bench.main(["--sync-spec-lens", bad])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"--sync-spec-lens {bad} was accepted")
    assert "--sync-spec-lens" in capsys.readouterr().err
