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
