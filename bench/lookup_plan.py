"""The verifier's per-step prompt-lookup planning, timed: the scan against the n-gram index.

    python bench/lookup_plan.py                     # 16 sequences of 300 tokens, 500 steps
    python bench/lookup_plan.py --seqs 32 --tokens 1000

Each step calls `speculation.planner.plan_lookups` for every sequence, as the verifier does
when its whole batch decodes alone; the sequences (random tokens) grow by one token every
step. Reports milliseconds per step (lookups and the plan) for the scan
(`drafter.ngram.lookup`) and for a kept `drafter.ngram.NgramIndex` per sequence, and checks
that both plan the same chains.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)


def run(seqs: int, tokens: int, steps: int, vocab: int, indexed: bool) -> tuple[float, list]:
    from speculation.cost_model import CostModel, VerifyCosts
    from speculation.planner import AdaptiveSpeculation
    from speculation.proposal import NgramIndex
    from verifier.lookup import plan_lookups

    rng = random.Random(0)
    planner = AdaptiveSpeculation(max_spec_len=16, overlap=False)    # as verifier.lookup.VerifierLookup's
    steps_model = CostModel(overlap=False)
    for rows in (seqs, seqs, seqs, 2 * seqs, 2 * seqs, 2 * seqs):
        steps_model.observe_verify(rows, 0.05 + 0.002 * rows)        # a fixed cost rows barely add to
    planner.costs = VerifyCosts(steps_model)          # the verifier drafts these itself: no draft cost
    names = [f"s{i}" for i in range(seqs)]
    for name in names:
        planner.add(name, "auto", 4, 1)
        planner.seqs[name].attempts, planner.seqs[name].accepts = 10.0, 8.0    # γ 0.8: chains pay
    context = {name: [rng.randrange(vocab) for _ in range(tokens)] for name in names}
    indexes = {name: NgramIndex(3, 2) for name in names} if indexed else None
    chosen = []
    start = time.perf_counter()
    for _ in range(steps):
        candidates = [(name, context[name], 4, False) for name in names]   # greedy: no q
        chains = plan_lookups(planner, candidates, 0, indexes)
        chosen.append(sorted((s, t.token_ids.tolist()) for s, t in chains.items()))
        for name in names:                      # one token committed per sequence per step
            context[name].append(rng.randrange(vocab))
    return (time.perf_counter() - start) / steps, chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=common.positive_int, default=16)
    p.add_argument("--tokens", type=common.positive_int, default=300)
    p.add_argument("--steps", type=common.positive_int, default=500)
    p.add_argument("--vocab", type=common.comma_list(common.positive_int), default="200,12",
                   help="token ids drawn from this many, one run each: few repeats (a scan goes far back, "
                        "most steps find nothing) and many (a match close to the end, a chain most steps)")
    args = p.parse_args(argv)
    run(2, 50, 5, 12, indexed=False)            # imports and first calls out of the way
    for vocab in args.vocab:
        scan_s, scan_plans = run(args.seqs, args.tokens, args.steps, vocab, indexed=False)
        index_s, index_plans = run(args.seqs, args.tokens, args.steps, vocab, indexed=True)
        if scan_plans != index_plans:
            print(f"vocabulary {vocab}: the index planned other chains than the scan", file=sys.stderr)
            return 1
        found = sum(len(p) for p in scan_plans)
        print(f"vocabulary {vocab}: {args.seqs} sequences from {args.tokens} tokens, {args.steps} steps, "
              f"{found} chains planned: scan {1e3 * scan_s:.2f} ms/step, index {1e3 * index_s:.2f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
