"""What seeded (coupled) sampling costs in acceptance against rejection sampling (issue 24, item 5).

    python bench/coupling.py                                   # the embedded pair
    python bench/coupling.py --temperatures 0.7,1.0 --max-tokens 48 --seeds 3

A seeded request is verified by coupling (Daliri, Musco and Suresh, "Coupling without
communication and drafter-invariant speculative decoding"): the target's token at output
position t is argmax(log p + G_t), G_t keyed by (seed, t), the draft proposes the top tokens
under the same noise, and a node is accepted when it is the target's token. Its text is a
function of the seed alone, but a draft token is accepted only when it is exactly the
target's own sample, where rejection sampling accepts x with probability min(1, p(x)/q(x)):
coupling accepts less. This measures how much, on bench/e2e.py's prompts (chat template),
the sync engine, chains of K and trees: per temperature and shape, the acceptance rate
(accepted / drafted nodes) and the mean accepted length (bonus included) of unseeded requests
(rejection sampling) and of seeded ones (coupled), summed over prompts and seeds. Acceptance
is a count, not a timing: the figures hold on a loaded machine too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

import torch  # noqa: E402

RESULTS = ROOT / "results" / "coupling.json"


def measure(engine, work: list[tuple[str, list[int]]], temperature: float, spec, seeds: int,
            max_tokens: int) -> dict:
    """Acceptance of unseeded (rejection sampling) and seeded (coupled) requests, same prompts."""
    from models import SamplingParams
    from speculation.requests import GenerationRequest
    from speculation.stats import SpecStats

    out = {}
    for name, seeded in (("rejection", False), ("coupled", True)):
        total = SpecStats()
        for s in range(seeds):
            requests = [GenerationRequest(f"{name}-{s}-{i}", ids, SamplingParams(
                temperature=temperature, seed=1000 * s + i if seeded else None, max_tokens=max_tokens,
                ignore_eos=True), spec) for i, (_, ids) in enumerate(work)]
            for o in engine.generate(requests):
                total = total.merge(o.stats)
        out[name] = {"drafted": total.num_drafted, "accepted": total.num_accepted,
                     "acceptance": total.acceptance_rate, "mean_accepted_length": total.mean_accepted_len}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--temperatures", type=common.comma_list(common.positive_float), default=[0.7, 1.0])
    p.add_argument("--shapes", type=common.comma_list(str), default=["chain:4:1", "tree:3:2"],
                   help="name:spec_len:tree_width, comma separated")
    p.add_argument("--max-tokens", type=common.positive_int, default=48)
    p.add_argument("--prompts", type=common.positive_int, default=3, help="prompts per category (at most 3)")
    p.add_argument("--seeds", type=common.positive_int, default=3, help="runs of every prompt per sampler")
    p.add_argument("--threads", type=common.positive_int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.target, args.draft = common.model_pair(p, args)
    torch.set_num_threads(args.threads)
    from bench.e2e_async import chat_prompts
    from cluster.local import build_engine, speculation_for
    from models import load_tokenizer

    pair = build_engine(args.target, args.draft)
    work = chat_prompts(load_tokenizer(args.target), args.prompts)
    rows, result = [], []
    for temperature in args.temperatures:
        for shape in args.shapes:
            name, k, width = shape.split(":")
            r = measure(pair.engine, work, temperature, speculation_for("sync", int(k), int(width)), args.seeds,
                        args.max_tokens)
            result.append({"temperature": temperature, "shape": shape, **r})
            rej, cpl = r["rejection"], r["coupled"]
            rows.append([f"{temperature:g}", name, f"{k}x{width}", f"{rej['acceptance']:.3f}",
                         f"{cpl['acceptance']:.3f}", f"{rej['mean_accepted_length']:.2f}",
                         f"{cpl['mean_accepted_length']:.2f}"])
    print(common.markdown_table(["temperature", "shape", "K x width", "acceptance (rejection)",
                                 "acceptance (coupled)", "accepted length (rejection)",
                                 "accepted length (coupled)"], rows))
    common.write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "machine": common.machine(),
                                 "date": common.utc(), "result": result})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
