"""bench/coupling.py, tiny: acceptance of rejection sampling and of coupled (seeded) sampling."""
import json

import torch


def test_the_coupling_bench_reports_both_samplers(tiny_target, close_draft, bench_script, tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "coupling.json"
    try:
        assert bench_script("coupling").main(["--target", str(tiny_target), "--draft", str(close_draft),
                                              "--temperatures", "1.0", "--shapes", "chain:3:1",
                                              "--prompts", "1", "--seeds", "1", "--max-tokens", "8",
                                              "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "acceptance (coupled)" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["result"]
    assert (row["temperature"], row["shape"]) == (1.0, "chain:3:1")
    for sampler in ("rejection", "coupled"):
        r = row[sampler]
        assert r["drafted"] > 0 and 0.0 <= r["acceptance"] <= 1.0 and r["mean_accepted_length"] >= 1.0
