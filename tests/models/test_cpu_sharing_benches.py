"""bench/core_sharing.py and bench/draft_warmth.py, small: what sharing a CPU does to a draft."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "core_sharing.py"


def test_the_core_sharing_bench_times_both_sides_in_each_case(tiny_target, close_draft, tmp_path):
    out = tmp_path / "sharing.json"
    subprocess.run([sys.executable, str(SCRIPT), "--target", str(tiny_target), "--draft", str(close_draft),
                    "--seconds", "0.3", "--load-s", "3", "--target-threads", "1", "--cases", "alone", "nice19",
                    "--rows", "2", "--out", str(out)], check=True, timeout=240,
                   env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])})
    result = json.loads(out.read_text())
    assert set(result["cases"]) == {"alone", "nice19"}
    alone = result["cases"]["alone"]
    # alone, each side ran its loop over the whole window and timed what it did
    assert alone["target_iters"] > 0 and alone["draft_iters"] > 0
    for side in ("target", "draft"):    # each loop ran until the 0.3 s window closed
        assert alone[f"{side}_ms"] * alone[f"{side}_iters"] >= 300
    assert result["cases"]["nice19"]["target_iters"] > 0
    assert set(result["one_thread_rows_ms"]) == {"2"} and result["one_thread_rows_ms"]["2"] > 0


def test_the_draft_warmth_bench_times_both_series(tiny_target, close_draft, bench_script, capsys):
    """bench/draft_warmth.py, small: the pipeline's drafter proposes chains back to back and
    after target verifications, and reports both medians."""
    threads = torch.get_num_threads()
    try:
        assert bench_script("draft_warmth").main(["--target", str(tiny_target), "--draft", str(close_draft),
                                                  "--reps", "3", "--spec-len", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "2-level chain" in out and "back to back" in out and "right after" in out


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
