"""bench/generate_modes.py, small: whole `specflash generate` processes timed from outside, the
rate between two lengths, every mode's tokens checked against the target alone's."""
import json

import pytest


def test_generate_modes_times_whole_processes_and_checks_tokens(tiny_target, close_draft, tmp_path, bench_script,
                                                                capsys):
    bench = bench_script("generate_modes")
    assert bench.main(["--target", str(tiny_target), "--draft", str(close_draft), "--modes", "off,sync",
                       "--rounds", "1", "--short", "3", "--long", "9", "--raw-prompt", "--prompt", "abc",
                       "--spec-len", "2", "--out", str(tmp_path)]) == 0
    (out,) = tmp_path.glob("generate_modes-*.json")
    modes = json.loads(out.read_text())["modes"]
    assert sorted(modes) == ["off", "sync"]
    assert all(m["exact_vs_off"] is True and len(m["rates"]) == 1 for m in modes.values())
    assert all(len(m["in_run_rates"]) == 1 and m["in_run_tokens_per_s"] > 0 for m in modes.values())
    # 6 tokens on a tiny model take milliseconds: noise may make the long run no longer than the
    # short one, and that round then has no rate rather than a negative one
    assert all(r is None or r > 0 for m in modes.values() for r in m["rates"] + m["segment_rates"])
    assert "| sync |" in capsys.readouterr().out


def test_rates_are_the_difference_of_two_lengths_or_none(bench_script, monkeypatch, capsys):
    """The outside rate: (long − short) over the two processes' wall times' difference; the segment
    rate the same over the runs' own request times; a round whose long run took no longer has none."""
    bench = bench_script("generate_modes")
    # (wall seconds, the run's own tokens/s) per (mode, length): sync's long run is quicker from outside
    runs = {("off", 4): (2.0, 8.0), ("off", 12): (3.0, 6.0), ("sync", 4): (2.5, 4.0), ("sync", 12): (2.4, 12.0)}
    monkeypatch.setattr(bench, "run_once", lambda mode, n, args: (runs[mode, n][0], [1] * n, runs[mode, n][1]))
    args = bench.argparse.Namespace(warmup=0, rounds=2, modes=["off", "sync"], short=4, long=12)
    result = bench.measure(args)
    assert result["off"]["rates"] == [8.0, 8.0] and result["off"]["tokens_per_s"] == 8.0
    assert result["off"]["segment_rates"] == [8 / (12 / 6 - 4 / 8)] * 2          # 8 tokens in 1.5 s
    assert result["sync"]["rates"] == [None, None] and result["sync"]["tokens_per_s"] is None
    assert result["sync"]["segment_rates"] == [None, None]                       # 12/12 − 4/4 = 0 s
    table = bench.summary(result)
    assert "| sync | – | – | 12.0 | 2.00 | – | – | yes |" in table


def test_generate_modes_refuses_bad_arguments(bench_script):
    bench = bench_script("generate_modes")
    for argv in (["--short", "9", "--long", "9"], ["--modes", "off,fast"], ["--draft", "/x"],
                 ["--warmup", "-1"], ["--top-p", "0.9"], ["--temperature", "1", "--top-p", "1.5"]):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2


def test_sampled_runs_are_seeded_and_still_checked_against_off(tiny_target, close_draft, tmp_path, bench_script,
                                                               monkeypatch):
    """--temperature runs seeded sampling: every process gets the temperature, the nucleus, a penalty
    (the others left off) and the seed, and a seeded request's tokens are the seed's whatever
    drafted them, so they still equal `off`'s."""
    bench = bench_script("generate_modes")
    commands, real = [], bench.subprocess.run
    # the `generate` processes alone (platform.processor() may run `uname -p` once per process)
    monkeypatch.setattr(bench.subprocess, "run",
                        lambda cmd, **kw: ("generate" in cmd and commands.append(cmd)) or real(cmd, **kw))
    assert bench.main(["--target", str(tiny_target), "--draft", str(close_draft), "--modes", "off,sync",
                       "--rounds", "1", "--warmup", "0", "--short", "3", "--long", "9", "--raw-prompt",
                       "--prompt", "abc", "--spec-len", "2", "--temperature", "1", "--seed", "3",
                       "--top-p", "0.9", "--presence-penalty", "0.5", "--out", str(tmp_path)]) == 0
    assert len(commands) == 4
    assert all(c[c.index("--temperature") + 1] == "1.0" and c[c.index("--seed") + 1] == "3"
               and c[c.index("--top-p") + 1] == "0.9" and c[c.index("--presence-penalty") + 1] == "0.5"
               and "--frequency-penalty" not in c and "--repetition-penalty" not in c for c in commands)
    (out,) = tmp_path.glob("generate_modes-*.json")
    assert all(m["exact_vs_off"] is True for m in json.loads(out.read_text())["modes"].values())
