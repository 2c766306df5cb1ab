"""What a target forward does to the next draft: a drafted chain timed back to back and
right after a verification.

    python bench/draft_warmth.py                   # embedded pair, 3-level chains, 40 of each
    python bench/draft_warmth.py --spec-len 4 --reps 60 --draft-threads 2

The pipeline's drafter (`drafter.draft_side.DraftSide`, the proposer as a drafter actor
runs it, in lockstep: drafted from the committed prefix, nothing assumed) drafts a chain
of `--spec-len` for one sequence, the whole chain accepted and a bonus token committed
after each, so every proposal is one catch-up level and the rest. Two interleaved
series: proposals back to back (the draft's weights stay in the caches), and each right
after a `--target-threads` verification of `--spec-len` + 1 tokens by the target (which
streams its own weights through them, as every step of sync decoding and of a lockstep
pipeline does). Reports the median milliseconds of each.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--spec-len", type=common.positive_int, default=3)
    p.add_argument("--reps", type=common.positive_int, default=40, help="proposals timed in each series")
    p.add_argument("--draft-threads", type=common.positive_int, default=1,
                   help="the drafter actor's threads (its CPUs)")
    p.add_argument("--target-threads", type=common.positive_int, default=2, help="the verification's threads")
    args = p.parse_args(argv)
    target_dir, draft_dir = common.model_pair(p, args)
    from drafter.draft_side import DraftItem, DraftSide
    from models.presets import config_of
    from speculation.settings import EngineSettings
    from models import load_model
    from models.sampling import SamplingParams
    from models.transformer import causal_mask

    side = DraftSide.build(draft_dir, config_of(target_dir).vocab_size, EngineSettings())
    target = load_model(target_dir)
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (48,), generator=gen).tolist()
    tokens = list(prompt)
    cache = target.new_cache(-(-(len(prompt) + args.spec_len + 1) // 16) + 1, 16)
    cache.add_sequence("t")
    with torch.inference_mode():
        target(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, ["t"], causal_mask(1, len(prompt)))
    greedy = SamplingParams(temperature=0.0)

    def propose() -> float:
        nonlocal tokens
        torch.set_num_threads(args.draft_threads)
        item = DraftItem("s", tokens, greedy, gen, args.spec_len, 1, 0)
        (drafted,), seconds = side.propose([item], assume=False)
        chain = drafted.tree.token_ids.tolist()
        side.model.on_verified("s", drafted.tree, list(range(len(chain))))
        tokens = tokens + chain + [int(torch.randint(0, vocab, (1,), generator=gen))]
        if len(tokens) > 400:        # keep the context short and alike across the series
            side.release("s")
            tokens = list(prompt)
        return seconds

    def verify() -> None:
        torch.set_num_threads(args.target_threads)
        n = args.spec_len + 1
        with torch.inference_mode():
            target(torch.randint(0, vocab, (1, n), generator=gen), (len(prompt) + torch.arange(n))[None], cache,
                   ["t"], causal_mask(1, n))
        cache.truncate("t", len(prompt))

    for _ in range(3):
        propose()
    warm, cold = [], []
    for _ in range(args.reps):        # interleaved, so that drift of the machine hits both alike
        warm.append(propose())
        verify()
        cold.append(propose())
    w, c = 1e3 * statistics.median(warm), 1e3 * statistics.median(cold)
    print(f"{args.spec_len}-level chain, drafter on {args.draft_threads} thread(s): back to back {w:.1f} ms, "
          f"right after a {args.target_threads}-thread verification {c:.1f} ms ({c / w:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
