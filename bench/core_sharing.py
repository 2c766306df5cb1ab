"""Can a drafter draft in the gaps of a verification that runs on every core?

    python bench/core_sharing.py                        # embedded pair, 10 s per case
    python bench/core_sharing.py --seconds 6 --cases alone idle nice19
    python bench/core_sharing.py --rows 1 4 8 16        # also: the target on one thread per row count

Two processes, started together and timed over the same window: a target that
verifies a chain of `--target-rows` tokens after a 100-token prefix over and over
on all `--target-threads` threads (what a lockstep verification does on a
2-core node), and a drafter that drafts a 3-level chain (three one-row forwards
with the draft's fp16 layers and its reduced LM head selected once, as
`drafter.model_proposer` does; the head read in fp32 here, where the proposer
reads an fp16 copy) over and over on one thread, under a Linux scheduling class
or niceness per case:

- `alone`: each process by itself (the reference);
- `normal`: both at normal priority (three busy threads on two cores);
- `idle`: the drafter at `SCHED_IDLE` (runs only on a core nothing else wants);
- `nice19`: the drafter at niceness 19;
- `spinNNN`: the drafter at `SCHED_IDLE`, the target with `GOMP_SPINCOUNT=NNN`
  (its OpenMP threads stop spinning sooner after each parallel region, so a
  gap between two regions could go to the drafter).

Reports milliseconds per verification and per draft chain in each case. If a
drafter at idle priority drafted at near its own speed while the verification
kept its speed, drafting beside a verification would be free on a CPU and an
overlapped pipeline would beat taking turns (lockstep). `--rows` adds the
target's forward on one thread per row count: what a verifier pays when it
keeps one core and leaves the other to its drafter.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)


def worker(role: str, model_dir: str, rows: int, threads: int, seconds: float, start_at: float,
           sched: str) -> dict:
    """One side's loop; returns {"iters", "ms"} over [start_at, start_at + seconds]."""
    import torch

    from models import load_model
    from models.embedded import draft_logit_rows
    from models.linear import use_draft_weights
    from models.transformer import causal_mask

    torch.set_num_threads(threads)
    if sched == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif sched.startswith("nice"):
        os.nice(int(sched[4:]))
    model = load_model(model_dir)
    head = None       # the draft's reduced LM head, selected once (as drafter.model_proposer does)
    if role == "draft":
        use_draft_weights(model)         # the proposer's low-precision few-row matmuls
        ids = draft_logit_rows(Path(model_dir))
        if ids is not None:
            head = model.lm_head_weight.index_select(0, torch.tensor(ids))
    one_row = torch.zeros(1, dtype=torch.long)
    cache = model.new_cache(64)
    cache.add_sequence(0)
    prefix = 100
    gen = torch.Generator().manual_seed(0)
    vocab = min(1000, model.config.vocab_size)
    ids = torch.randint(0, vocab, (1, prefix), generator=gen)
    model(ids, torch.arange(prefix)[None], cache, [0], causal_mask(1, prefix))
    levels = 1 if role == "target" else 3
    while time.time() < start_at:
        time.sleep(0.001)
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        for _ in range(levels):
            length = cache.seq_len(0)
            x = torch.randint(0, vocab, (1, rows), generator=gen)
            args = (x, (length + torch.arange(rows))[None], cache, [0], causal_mask(1, rows))
            if head is None:
                model(*args)
            else:       # the model's own head on one row only; the reduced head on the last position
                _, hidden = model(*args, logit_rows=one_row, logit_positions=one_row, return_hidden=True)
                torch.nn.functional.linear(hidden[:, -1], head)
        cache.truncate(0, prefix)
        n += 1
    elapsed = time.perf_counter() - t0
    return {"iters": n, "ms": 1e3 * elapsed / max(n, 1)}


def spawn(role: str, model_dir: str, rows: int, threads: int, seconds: float, start_at: float,
          sched: str = "normal", env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", role, model_dir, str(rows), str(threads), str(seconds),
           repr(start_at), sched]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, **(env or {})}, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"worker failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        role, model_dir, rows, threads, seconds, start_at, sched = sys.argv[2:9]
        print(json.dumps(worker(role, model_dir, int(rows), int(threads), float(seconds), float(start_at),
                                sched)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--seconds", type=common.positive_float, default=10.0)
    p.add_argument("--target-rows", type=common.positive_int, default=4)
    p.add_argument("--target-threads", type=common.positive_int, default=os.cpu_count() or 2)
    p.add_argument("--cases", nargs="+", default=["alone", "normal", "idle", "nice19", "spin1000", "spin100000"])
    p.add_argument("--rows", type=common.positive_int, nargs="*", default=[],
                   help="one-thread target forwards of these rows")
    p.add_argument("--load-s", type=float, default=15.0,
                   help="seconds given to both processes to load their model before the window opens")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    target, draft = common.model_pair(p, args)
    load_s = args.load_s
    cases = {}
    for case in args.cases:
        if case == "alone":
            t = result(spawn("target", target, args.target_rows, args.target_threads, args.seconds,
                             time.time() + load_s))
            d = result(spawn("draft", draft, 1, 1, args.seconds, time.time() + load_s))
        else:
            sched, env = case, None
            if case.startswith("spin"):
                sched, env = "idle", {"GOMP_SPINCOUNT": case[4:]}
            start_at = time.time() + load_s
            tp = spawn("target", target, args.target_rows, args.target_threads, args.seconds, start_at, env=env)
            dp = spawn("draft", draft, 1, 1, args.seconds, start_at, sched)
            t, d = result(tp), result(dp)
        cases[case] = {"target_ms": t["ms"], "target_iters": t["iters"], "draft_ms": d["ms"],
                       "draft_iters": d["iters"]}
        print(f"{case:>11}: verification ({args.target_rows} rows, {args.target_threads} threads) "
              f"{t['ms']:7.1f} ms x{t['iters']:<4d} draft chain (3 levels, 1 thread) "
              f"{d['ms']:8.1f} ms x{d['iters']}", flush=True)
    one_thread = {}
    for rows in args.rows:
        one_thread[rows] = result(spawn("target", target, rows, 1, args.seconds, time.time() + load_s))["ms"]
        print(f"target forward, {rows:>2} rows on one thread: {one_thread[rows]:.1f} ms", flush=True)
    if args.out:
        common.write_json(args.out, {"args": vars(args), "cases": cases, "one_thread_rows_ms": one_thread,
                                     "date": common.utc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
