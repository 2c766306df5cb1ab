"""bench/lookup_plan.py: the verifier's prompt-lookup planning, by the scan and by the n-gram index."""


def test_the_lookup_planning_bench_runs_and_both_ways_plan_the_same_chains(capsys, bench_script):
    """bench/lookup_plan.py, small: it exits 0 only when scan and index planned the same chains."""
    bench = bench_script("lookup_plan")
    assert bench.main(["--seqs", "3", "--tokens", "40", "--steps", "30", "--vocab", "6"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary 6: 3 sequences" in out and " 0 chains planned" not in out
