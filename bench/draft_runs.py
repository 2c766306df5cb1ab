"""Where the draft misses: its greedy agreement with the target, token by token, and how
misses cluster.

    python bench/draft_runs.py                      # embedded pair, the e2e prompts, 48 tokens
    python bench/draft_runs.py --max-tokens 64 --out RANKS.json   # the ranks bench/async_model.py reads

For each prompt (bench/e2e.py's set, in the chat template) the target decodes greedily
alone; the draft then reads prompt + that continuation in one causal forward (its
reduced head, as the pipeline's proposer reads it), and at every generated position we
compare the draft's top choices with the target's token. Per category:

- `top1`: the draft's argmax is the target's token (what a chain's acceptance rests on);
- `top2_given_miss`: when it is not, the draft's second choice is (what drafting a second
  candidate outcome for a tree in flight, "hedging", could win);
- `right_after_right` / `right_after_miss`: the argmax is right given that it was right /
  wrong at the position before (how misses cluster: a tree after a rejection, or a bridge
  chain, starts right after a miss).

The JSON also keeps, per prompt, the rank of the target's token among the draft's
choices at every position (0 = its argmax; `RANKS` = not among its first `RANKS`):
greedy speculation is a function of these ranks, which bench/async_model.py replays.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

import torch  # noqa: E402

RANKS = 16         # ranks kept per position; a token further down counts as RANKS


def _prompts(tokenizer, per_category: int) -> list[tuple[str, list[int]]]:
    from bench import e2e

    return [(c, e2e.prompt_ids(tokenizer, t)) for c, texts in e2e.PROMPTS.items() for t in texts[:per_category]]


def _forward(model, ids: list[int], cache, seq_id, logit_rows=None) -> torch.Tensor:
    """Logits [T, V] for `ids` appended to the sequence's cache (causal)."""
    n = len(ids)
    start = cache.seq_len(seq_id)
    return model(torch.tensor([ids]), torch.arange(start, start + n)[None], cache, [seq_id],
                 torch.ones(n, n, dtype=torch.bool).tril()[None], logit_rows=logit_rows)[0]


@torch.inference_mode()
def measure(target, draft, logit_rows, work: list[tuple[str, list[int]]],
            max_tokens: int) -> tuple[list[dict], dict]:
    counts: dict[str, dict[str, int]] = {}
    ranks: list[dict] = []
    for category, ids in work:
        cache = target.new_cache(max(8, (len(ids) + max_tokens) // 16 + 2), 16)
        cache.add_sequence(0)
        logits, out = _forward(target, ids, cache, 0), []
        for _ in range(max_tokens):
            out.append(int(logits[-1].argmax()))
            logits = _forward(target, [out[-1]], cache, 0)
        dcache = draft.new_cache(max(8, (len(ids) + max_tokens) // 16 + 2), 16)
        dcache.add_sequence(0)
        dl = _forward(draft, ids + out, dcache, 0, logit_rows)
        top = dl.topk(min(RANKS, dl.shape[-1]), dim=-1).indices
        if logit_rows is not None:
            top = logit_rows[top]
        c = counts.setdefault(category, dict.fromkeys(
            ("tokens", "top1", "misses", "top2_after_miss", "after_right", "right_after_right",
             "after_miss", "right_after_miss"), 0))
        before, prompt_ranks = None, []
        ranks.append({"category": category, "ranks": prompt_ranks})
        for i, token in enumerate(out):
            choices = top[len(ids) - 1 + i].tolist()
            prompt_ranks.append(choices.index(token) if token in choices else RANKS)
            first, second = choices[:2]
            right = first == token
            c["tokens"] += 1
            c["top1"] += right
            if not right:
                c["misses"] += 1
                c["top2_after_miss"] += second == token
            if before is not None:
                key = "after_right" if before else "after_miss"
                c[key] += 1
                c["right_" + key] += right
            before = right
    rate = lambda a, b: a / b if b else None   # noqa: E731
    return ranks, {cat: {"tokens": c["tokens"], "top1": rate(c["top1"], c["tokens"]),
                  "top2_given_miss": rate(c["top2_after_miss"], c["misses"]),
                  "right_after_right": rate(c["right_after_right"], c["after_right"]),
                  "right_after_miss": rate(c["right_after_miss"], c["after_miss"]),
                  "positions_after_miss": c["after_miss"]}
            for cat, c in counts.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--max-tokens", type=common.positive_int, default=48)
    p.add_argument("--prompts", type=common.positive_int, default=3, help="prompts per category (at most 3)")
    p.add_argument("--threads", type=common.positive_int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the result and the ranks here as JSON")
    args = p.parse_args(argv)
    args.target, args.draft = common.model_pair(p, args)
    torch.set_num_threads(args.threads)
    from models.pair import read_logit_rows
    from models import load_model, load_tokenizer

    target, draft = load_model(args.target), load_model(args.draft)
    rows = read_logit_rows(args.draft, target.config.vocab_size)
    rows = None if rows is None else torch.tensor(list(rows))
    ranks, result = measure(target, draft, rows, _prompts(load_tokenizer(args.target), args.prompts),
                            args.max_tokens)
    f = common.cell
    print(common.markdown_table(
        ["category", "tokens", "top-1 right", "2nd choice right, given a miss", "right after right",
         "right after a miss"],
        [[cat, r["tokens"], f(r["top1"], ".2f"), f(r["top2_given_miss"], ".2f"), f(r["right_after_right"], ".2f"),
          f"{f(r['right_after_miss'], '.2f')} ({r['positions_after_miss']})"] for cat, r in result.items()]))
    if args.out:
        common.write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "result": result,
                                     "ranks": ranks})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
