"""What the asynchronous pipeline could reach on these prompts: a trace model.

    python bench/draft_runs.py --max-tokens 48 --out RANKS.json
    python bench/async_model.py --ranks RANKS.json --costs RESULTS.json --spec-len 6 \
        --round-trip-ms 4,16,30 [--hedges 1,4]

(RANKS.json: what bench/draft_runs.py wrote; RESULTS.json: a bench/e2e_async.py result, a run
with a `sync` row and the pipeline's fitted costs.)

Greedy speculation is a function of where the draft agrees with the target: a chain
drafted after position p is accepted up to the first position whose target token is
not the draft's argmax (rank 0 in bench/draft_runs.py's `ranks`), and the drafter's
assumed outcome of a tree (all of it plus its guess of the bonus token) holds when
those K + 1 positions are all rank 0. So the steps of every method can be replayed
from the ranks, and priced with the costs the verifier fitted in an e2e_async run
(`pipeline_costs_ms`: forward_<n>_rows, draft_level; the target alone at that run's
`off` tokens/s, prefills included, the step overhead from step_1_row − forward_1_rows;
sync's draft level as that run's sync row measured it in process, `draft_ms_per_node`):

- `sync`: K draft levels, then one forward of K + 1 rows;
- `bridge` (a stream that shares its drafter): a tree's forward; when its outcome contradicts
  the drafter's assumption, a bridge forward of one row, after which the restart
  tree (drafted after the draft's guess of that token) is valid if the guess was
  right, else the verifier waits a round trip plus K + 1 draft levels;
- `restart S` (`restart_depth`; a lone overlapped stream's default is S = 3,
  `speculation.policy.LONE_RESTART_DEPTH`): after a contradiction the verifier waits a round
  trip plus S + 1 draft levels, then verifies a chain of S;
- `hedged h` (`--hedges`; nothing runs it): as `bridge`, but the drafter is taken to
  have also filed, for each outcome of the tree in flight, trees after its next h choices
  of the token the target contributes there, for free and in time, so an outcome whose
  token ranks at most h needs no bridge: a bound on what hedged drafting ahead could win;
- `never contradicted`: sync's own steps with their drafting hidden, as if the drafter's
  assumption always held (what overlapping alone is worth at these costs; not a bound
  on the others, since a bridge may commit a token for less than a tree does).

With `--fix-misses`, the same for drafts of higher agreement at the same cost (a share
of the misses made hits at random): how the pipeline's lead over sync moves with the
draft's quality. Every figure is a speedup over the target alone; in parentheses (and in the
`--fix-misses` table's ratios), over the fastest sync chain of 1 .. K on the same prompts.
The model leaves out batching, Python and Ray overheads beyond the round trip, and
cache effects: it is for seeing which policy could pay and what bounds the pipeline,
not a measurement (bench/e2e_async.py measures).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

RANKS = 16      # bench/draft_runs.py keeps ranks below this; RANKS itself: not among the draft's first RANKS


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def run_length(ranks: list[int], p: int, k: int) -> int:
    """Draft tokens accepted of a chain of k drafted after position p."""
    a = 0
    while a < k and p + a < len(ranks) and ranks[p + a] == 0:
        a += 1
    return a


class Costs:
    def __init__(self, forward_ms: dict[int, float], draft_level_ms: float, off_ms: float,
                 step_overhead_ms: float, round_trip_ms: float,
                 sync_draft_level_ms: float | None = None) -> None:
        """`draft_level_ms`: a level as the pipeline's drafter drafts it; `sync_draft_level_ms`
        (default the same): as the sync engine does, in process."""
        self.forward_ms, self.d, self.off_ms = dict(forward_ms), draft_level_ms, off_ms
        self.sync_d = draft_level_ms if sync_draft_level_ms is None else sync_draft_level_ms
        self.o, self.rt = step_overhead_ms, round_trip_ms

    def forward(self, rows: int) -> float:
        """A verifier forward of `rows` rows: measured, else a line through the measured ones.

        The line is a Theil-Sen fit (the median of the pairwise slopes, through the median
        point), since one shape seen in a few disturbed steps can be far off (a 6-row forward
        at 208 ms between 95 and 129 ms in one run); never below the cheapest measured forward."""
        if rows in self.forward_ms:
            return self.forward_ms[rows]
        known = sorted(self.forward_ms)
        slopes = sorted((self.forward_ms[b] - self.forward_ms[a]) / (b - a)
                        for i, a in enumerate(known) for b in known[i + 1:])
        slope = max(0.0, _median(slopes)) if slopes else 0.0
        at = _median([self.forward_ms[r] - slope * r for r in known])
        return max(min(self.forward_ms.values()), at + slope * rows)

    @classmethod
    def from_run(cls, result: dict, round_trip_ms: float) -> Costs:
        c = result["pipeline_costs_ms"]
        forward = {int(k.split("_")[1]): v for k, v in c.items() if k.startswith("forward_") and v}
        off = next(r for r in result["rows"] if r["method"] == "off")["tokens_per_s"]
        overhead = max(0.0, (c.get("step_1_row") or forward[1]) - forward[1])
        costs = cls(forward, c["draft_level"], 1000.0 / off, overhead, round_trip_ms)
        # the pipeline's draft level carries its exchange, which sync's does not: sync's comes from
        # the run's own sync row, as measured in process (`draft_ms_per_node`: a chain's node is a
        # level); in results without it, from the row's rate, a step being its mean accepted length
        # of tokens, K levels and a forward of K + 1 rows, which also charges each request's
        # prefill to the levels (5.95 ms a level against 3.5 measured, e2e_async_s46-log.json)
        k = int((result.get("args") or {}).get("spec_len") or 0)
        sync = next((r for r in result["rows"] if r["method"] == "sync"), None)
        if sync and sync.get("draft_ms_per_node"):
            costs.sync_d = sync["draft_ms_per_node"]
        elif k and sync and sync.get("mean_accepted_len") and sync.get("tokens_per_s"):
            step = 1000.0 * sync["mean_accepted_len"] / sync["tokens_per_s"]
            costs.sync_d = max(0.0, (step - costs.forward(k + 1) - overhead) / k)
        return costs


def sync_ms(ranks: list[int], n: int, k: int, c: Costs) -> float:
    p = t = 0
    while p < n:
        t += k * c.sync_d + c.forward(k + 1) + c.o
        p += run_length(ranks, p, k) + 1
    return t


def pipeline_ms(ranks: list[int], n: int, k: int, c: Costs, restart: int = 0,
                contradictions: bool = True, hedges: int = 0) -> tuple[float, float]:
    """(milliseconds, of which the verifier waited) to commit n tokens.

    Two clocks: the verifier's, and the drafter's, which drafts one tree at a time (K + 1
    levels: the tree and its bonus guess), hears a signal only between two of its drafting
    passes, half a round trip after it was sent, and files a tree half a round trip before
    the verifier can take it; with two ring slots it drafts at most one tree past the one
    being verified. So a drafter slower than the verifier makes it wait, as it does.

    `hedges` h: the drafter also filed, for every outcome of the tree in flight, trees
    after the draft's next h choices for the token the target contributes there, at no
    cost and in time: an outcome whose token ranks at most h is then as good as assumed
    (an upper bound on hedged drafting ahead, not a policy anything runs)."""
    half = c.rt / 2
    p, t, idle = 0, 0.0, 0.0
    depth = k                   # the tree the verifier holds next
    ready = 0.0                 # when that tree is in the verifier's ring
    drafted = 0.0               # when the drafter finished drafting it
    freed = 0.0                 # when the drafter heard the signal that freed the slot it needs next
    while p < n:
        start = max(t, ready)
        idle += start - t
        a = run_length(ranks, p, depth)
        t = start + c.forward(depth + 1) + c.o
        p += a + 1
        heard = t + half
        # meanwhile the drafter drafts the next tree on the assumed outcome, once a slot is free
        begun = max(drafted, freed)
        assumed = begun + (k + 1) * c.d
        held = a == depth and p - 1 < len(ranks) and ranks[p - 1] == 0     # outcome as assumed
        hedged = p - 1 < len(ranks) and ranks[p - 1] <= min(hedges, RANKS - 1)
        depth, freed = k, heard
        if held or hedged or not contradictions or p >= n:
            drafted, ready = assumed, assumed + half
            continue
        learnt = max(heard, assumed) if begun <= heard else max(heard, drafted)
        if restart:                              # wait for the drafter's restart chain
            drafted = learnt + (restart + 1) * c.d
            ready, depth = drafted + half, restart
            continue
        t += c.forward(1) + c.o                  # the bridge: the next token alone
        p += 1
        freed = t + half                         # its signal frees the slot the bridge held
        drafted = learnt + (k + 1) * c.d         # the restart tree, after the drafter's guess
        if p - 1 < len(ranks) and ranks[p - 1] != 0:     # a wrong guess: draft again after the bridge
            drafted = max(freed, drafted) + (k + 1) * c.d
        ready = drafted + half
    return t, idle


def model(prompts: list[dict], n: int, k: int, c: Costs, restarts: tuple[int, ...] = (1, 2, 3),
          hedges: tuple[int, ...] = ()) -> dict:
    """Speedups over the target alone, per method, for these prompts (`ranks` lists); "fastest
    sync" is sync's best chain of 1 .. k on them (its length: "fastest sync k"), the pipeline's
    fair baseline."""
    off = sum(n * c.off_ms for _ in prompts)
    by_k = {j: off / sum(sync_ms(pr["ranks"], n, j, c) for pr in prompts) for j in range(1, k + 1)}
    best = max(by_k, key=by_k.get)
    out = {"sync": by_k[k], "fastest sync": by_k[best], "fastest sync k": best}
    runs = {"bridge": {}, **{f"restart {s}": {"restart": s} for s in restarts},
            **{f"hedged {h}": {"hedges": h} for h in hedges},
            "never contradicted": {"contradictions": False}}
    for name, kw in runs.items():
        spent = [pipeline_ms(pr["ranks"], n, k, c, **kw) for pr in prompts]
        total, idle = sum(s for s, _ in spent), sum(i for _, i in spent)
        out[name] = off / total
        out[name + " idle"] = idle / total
    return out


def better_draft(prompts: list[dict], fix: float, seed: int) -> list[dict]:
    """The same prompts as if the draft had been right at a share `fix` of its misses
    (chosen at random, `seed`), at the same cost: a draft of higher agreement, for asking
    how the pipeline's lead over sync moves with the draft's quality."""
    rng = random.Random(seed)
    return [{**pr, "ranks": [0 if r and rng.random() < fix else r for r in pr["ranks"]]} for pr in prompts]


def by_category(ranked: list[dict]) -> list[tuple[str, list[dict]]]:
    """(category, its prompts) for each category, then ("all", every prompt): the tables' rows."""
    cats = sorted({r["category"] for r in ranked})
    return [(cat, [r for r in ranked if r["category"] == cat]) for cat in cats] + [("all", ranked)]


def quality_table(ranked: list[dict], n: int, k: int, c: Costs, fixes: list[float], seeds: int) -> list[list]:
    """How the pipeline's lead over sync's fastest chain moves with the draft's quality: each
    category's prompts (and all of them together) with a share of the misses made right; a lone
    stream's restart chains of 3 (its default) and the ceiling, every outcome as assumed. The
    printed table's rows (means over `seeds` draws)."""
    print(f"draft made right at a share of its misses, {seeds} seeds each (mean; ÷ fastest sync):")
    table = []
    for cat, prompts in by_category(ranked):
        for fix in fixes:
            rows = []
            for seed in range(seeds):
                prs = better_draft(prompts, fix, seed)
                top1 = sum(x == 0 for pr in prs for x in pr["ranks"][:n]) / sum(len(pr["ranks"][:n]) for pr in prs)
                m = model(prs, n, k, c, restarts=(3,))
                rows.append((top1, m["fastest sync"], m["restart 3"] / m["fastest sync"],
                             m["never contradicted"] / m["fastest sync"]))
            mean = [sum(r[i] for r in rows) / len(rows) for i in range(4)]
            table.append([cat, f"{fix:g}", f"{mean[0]:.2f}", f"{mean[1]:.2f}×", f"{mean[2]:.2f}", f"{mean[3]:.2f}"])
    print(common.markdown_table(["prompts", "misses fixed", "top-1 agreement", "fastest sync", "restart 3",
                                 "never contradicted"], table))
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=Path, required=True, help="bench/draft_runs.py's JSON (with `ranks`)")
    p.add_argument("--costs", type=Path, required=True, help="a bench/e2e_async.py result JSON")
    p.add_argument("--spec-len", type=common.positive_int, default=6)
    p.add_argument("--max-tokens", type=common.positive_int, default=48,
                   help="tokens per prompt (at most what was ranked)")
    p.add_argument("--round-trip-ms", type=common.comma_list(float), default="4,16,30",
                   help="signal to drafter and tree back, beyond the draft levels (comma list)")
    p.add_argument("--hedges", type=common.comma_list(common.positive_int), default="",
                   help="also the bound on hedged drafting with the draft's next h choices (comma list)")
    p.add_argument("--fix-misses", type=common.comma_list(float), default="",
                   help="also a table for drafts right at these shares of the misses (comma list, 0-1), "
                        "at the first --round-trip-ms")
    p.add_argument("--seeds", type=common.positive_int, default=5, help="random draws per --fix-misses share")
    p.add_argument("--categories", type=common.comma_list(), default="",
                   help="only these prompt categories (comma list; `all` is then theirs), as e2e_async ran")
    args = p.parse_args(argv)
    fixes, hedges = args.fix_misses, tuple(args.hedges)
    if any(not 0.0 <= f <= 1.0 for f in fixes) or not args.round_trip_ms:
        p.error("--fix-misses: shares from 0 to 1; --round-trip-ms: at least one")
    if any(not h < RANKS for h in hedges):
        p.error(f"--hedges: each h must be from 1 to {RANKS - 1} (the ranks kept)")
    ranked = json.loads(args.ranks.read_text()).get("ranks")
    if not ranked:
        p.error(f"{args.ranks} holds no per-prompt ranks: run bench/draft_runs.py again")
    if args.categories:
        ranked = [r for r in ranked if r["category"] in args.categories]
        if not ranked:
            p.error(f"--categories: none of {args.ranks}'s prompts is in {','.join(args.categories)}")
    n = min([args.max_tokens] + [len(r["ranks"]) for r in ranked])
    result = json.loads(args.costs.read_text())
    print(f"K = {args.spec_len}, {n} tokens per prompt; costs from {args.costs.name}")
    table = []
    for rt in args.round_trip_ms:
        c = Costs.from_run(result, rt)
        for cat, prompts in by_category(ranked):
            m = model(prompts, n, args.spec_len, c, hedges=hedges)
            ratio = lambda name: f"{m[name]:.2f}× ({m[name] / m['fastest sync']:.2f})"   # noqa: E731
            table.append([cat, f"{rt:g}", f"{m['sync']:.2f}×", f"{m['fastest sync']:.2f}× ({m['fastest sync k']})",
                          *(ratio(name) for name in ("bridge", "restart 1", "restart 2", "restart 3")),
                          *(ratio(f"hedged {h}") for h in hedges), ratio("never contradicted")])
    print(f"(÷ fastest sync); sync's draft level {c.sync_d:.2f} ms, the pipeline's {c.d:.2f} ms")
    print(common.markdown_table(["prompts", "round trip ms", f"sync K = {args.spec_len}", "fastest sync (K)",
                                 "bridge", "restart 1", "restart 2", "restart 3",
                                 *(f"hedged {h}" for h in hedges), "never contradicted"], table))
    if fixes:
        rt = args.round_trip_ms[0]
        quality_table(ranked, n, args.spec_len, Costs.from_run(result, rt), fixes, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
