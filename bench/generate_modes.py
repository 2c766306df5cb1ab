"""`specflash generate` timed from outside, in every mode on the same cores (issue 23's first goal).

    python bench/generate_modes.py                           # off, sync, async; 32 and 160 tokens; 3 rounds
    python bench/generate_modes.py --rounds 1 --short 8 --long 24 --modes off,sync   # a smoke run
    python bench/generate_modes.py --modes off,async,async-eagle     # the pipeline with the EAGLE head
    python bench/generate_modes.py --temperature 1                   # seeded sampling (the API's default temperature)
    python bench/generate_modes.py --temperature 0.8 --top-p 0.95    # ... through a nucleus
    python bench/generate_modes.py --temperature 1 --presence-penalty 0.5   # ... penalised

What a user sees: each run is a whole `specflash generate` process (`python -m cluster.cli
generate --ignore-eos --json`) on the embedded pair and one code prompt, both cores for every
mode. A mode's decoding rate is (long − short) / (T(long) − T(short)) tokens/s, with T the
process's wall time, so start-up (imports, loading, Ray for `async`) cancels. Modes alternate
within a round, the short and long runs of a mode back to back; the rate reported is the median
over rounds, with each ratio to `off` and `async ÷ sync`. Beside it, the rate each long run
reports itself (its request's own time, prefill included, start-up not): the outside rate is
what a user waits for but carries the start-up's noise (Ray's start varies by seconds), the
inside rate is steadier. The segment rate is the outside rate's difference taken inside: (long −
short) over the difference of the two runs' own request times, so that neither start-up nor a
request's first step (its prefill, and in `sync` an engine's first, cold forward: 0.59 s against
the warmed-up pipeline's 0.16 on the embedded pair) enters it: the decoding rate between the two
lengths, without the start-up's noise. One discarded warm-up run of each mode comes first
(`--warmup`). A mode named `<mode>-eagle` drafts with the embedded EAGLE head (`--proposer eagle`)
instead of the layered draft. Every run's tokens are checked equal to `off`'s: greedy, or with
`--temperature` (and `--top-p`) seeded sampling (`--seed`, 0 by default), whose tokens are the
seed's whatever drafted them (`models.sampling.coupled_scores`). Writes
generate_modes-<time>.json under bench/results/.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

MODES = ("off", "sync", "async", "sync-eagle", "async-eagle")   # `-eagle`: --proposer eagle (the embedded head)
PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."
PENALTIES = (("--presence-penalty", "presence_penalty", 0.0), ("--frequency-penalty", "frequency_penalty", 0.0),
             ("--repetition-penalty", "repetition_penalty", 1.0))     # passed on where not `off`


def run_once(mode: str, max_tokens: int, args) -> tuple[float, list[int], float]:
    """Wall seconds of one `specflash generate` process, the tokens it printed, and the rate it
    reported itself (tokens over the request's own time: prefill and decoding, no start-up)."""
    base, _, proposer = mode.partition("-")
    cmd = [sys.executable, "-m", "cluster.cli", "generate", "--mode", base, "--proposer", proposer or "model",
           "--prompt", args.prompt,
           "--max-tokens", str(max_tokens), "--ignore-eos", "--json", "--spec-len", str(args.spec_len),
           "--tree-width", str(args.tree_width)]
    cmd += [] if args.raw_prompt else ["--chat"]
    cmd += ["--temperature", str(args.temperature), "--seed", str(args.seed)] if args.temperature > 0 else []
    cmd += ["--top-p", str(args.top_p)] if args.top_p < 1 else []
    cmd += [f for flag, name, off in PENALTIES if getattr(args, name) != off for f in (flag, str(getattr(args, name)))]
    cmd += [f for flag, value in (("--target", args.target), ("--draft", args.draft)) if value
            for f in (flag, str(value))]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT.parent, capture_output=True, text=True, timeout=args.timeout)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = printed["token_ids"]
    if len(tokens) != max_tokens:
        raise RuntimeError(f"mode {mode}: {len(tokens)} tokens, asked for {max_tokens}")
    return seconds, tokens, printed["stats"]["tokens_per_s"]


def measure(args) -> dict:
    """Per mode: the rate of every round from outside and from inside the long run, and whether its
    tokens equal `off`'s. `--warmup` discarded short runs of each mode come first: the first
    process after a quiet spell pays cold file caches that would land on one mode alone."""
    for _ in range(args.warmup):
        for mode in args.modes:
            run_once(mode, args.short, args)
    rates, in_run, segment = ({m: [] for m in args.modes} for _ in range(3))
    tokens = {}
    for r in range(args.rounds):
        for mode in args.modes:
            t_short, _, inside_short = run_once(mode, args.short, args)
            t_long, toks, inside = run_once(mode, args.long, args)
            rates[mode].append(_rate(args.long - args.short, t_long - t_short))
            in_run[mode].append(inside)
            # the long request's extra seconds in the runs' own times
            segment[mode].append(_rate(args.long - args.short, args.long / inside - args.short / inside_short))
            tokens.setdefault(mode, toks)
            print(f"round {r + 1} {mode}: {t_short:.1f} s for {args.short}, {t_long:.1f} s for {args.long}: "
                  f"{common.cell(rates[mode][-1], '.1f')} tokens/s; in the long run's own time {inside:.1f}, "
                  f"between the two lengths in the runs' own times {common.cell(segment[mode][-1], '.1f')}", flush=True)
    ref = tokens.get("off")
    # rates and segment rates: None where the long run took no longer than the short (noise on a
    # small run), so that no round reports a negative or infinite rate
    return {m: {"rates": rates[m], "tokens_per_s": _median_of_measured(rates[m]), "in_run_rates": in_run[m],
                "in_run_tokens_per_s": statistics.median(in_run[m]),
                "segment_rates": segment[m],
                "segment_tokens_per_s": _median_of_measured(segment[m]),
                "exact_vs_off": None if ref is None else tokens[m] == ref} for m in args.modes}


def _rate(tokens: int, seconds: float) -> float | None:
    """tokens / seconds, or None where the seconds are not positive: the long run took no longer."""
    return tokens / seconds if seconds > 0 else None


def _median_of_measured(rates: list[float | None]) -> float | None:
    """The median of the rates measured (None where no round measured one)."""
    measured = [x for x in rates if x is not None]
    return statistics.median(measured) if measured else None


def summary(result: dict) -> str:
    off = result.get("off", {})
    keys = ("tokens_per_s", "in_run_tokens_per_s", "segment_tokens_per_s")
    rows = [(m, *(cell for key in keys
                  for cell in (common.cell(r[key], ".1f"), common.cell(common.ratio(r[key], off.get(key)), ".2f"))),
             "–" if r["exact_vs_off"] is None else ("yes" if r["exact_vs_off"] else "NO"))
            for m, r in result.items()]
    table = common.markdown_table(("mode", "tokens/s from outside (median)", "× off", "tokens/s in the run (median)",
                                   "× off", "tokens/s between the lengths, in the runs (median)", "× off",
                                   "tokens = off"), rows)
    if "async" in result and "sync" in result:
        a, s = result["async"], result["sync"]
        table += (f"\n\nasync ÷ sync: {common.cell(common.ratio(a['tokens_per_s'], s['tokens_per_s']), '.2f')} "
                  f"from outside, "
                  f"{a['in_run_tokens_per_s'] / s['in_run_tokens_per_s']:.2f} in the run, "
                  f"{common.cell(common.ratio(a['segment_tokens_per_s'], s['segment_tokens_per_s']), '.2f')} "
                  f"between the lengths in the runs")
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--modes", type=common.comma_list(), default=["off", "sync", "async"])
    p.add_argument("--short", type=common.positive_int, default=32)
    p.add_argument("--long", type=common.positive_int, default=160)
    p.add_argument("--rounds", type=common.positive_int, default=3)
    p.add_argument("--warmup", type=common.non_negative_int, default=1, help="discarded short runs of each mode")
    p.add_argument("--spec-len", type=common.positive_int, default=4)
    p.add_argument("--tree-width", type=common.positive_int, default=1)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; above: seeded sampling")
    p.add_argument("--seed", type=int, default=0, help="the sampled runs' seed (with --temperature)")
    p.add_argument("--top-p", type=common.positive_float, default=1.0, help="the nucleus (with --temperature)")
    for flag, _, off in PENALTIES:
        p.add_argument(flag, type=float, default=off, help=f"passed to every run ({off}: none)")
    p.add_argument("--raw-prompt", action="store_true", help="the prompt as it is, without the chat template")
    p.add_argument("--timeout", type=common.positive_float, default=600.0, help="seconds per process")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args(argv)
    args.target, args.draft = common.model_pair(p, args, embedded=False)
    if args.long <= args.short:
        p.error("--long must exceed --short")
    if args.top_p < 1 and args.temperature <= 0 or args.top_p > 1:
        p.error("--top-p: in (0, 1], below 1 only with --temperature")
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"--modes: some of {', '.join(MODES)}, not {sorted(unknown)}")
    result = measure(args)
    print(summary(result))
    out = common.write_json(args.out / f"generate_modes-{common.utc(common.STAMP)}.json",
                            {"date": common.utc(), "machine": common.machine(), "args": vars(args),
                             "modes": result}, default=str)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
