"""Speculation under structured output: grammar-aware drafting against a draft that ignores the
grammar (issue 24, item 4).

    python bench/structured.py                                 # the embedded pair
    python bench/structured.py --max-tokens 64 --prompts 3 --shapes chain:4:1,tree:3:2

Requests ask for JSON under a nested `json_schema` (the chat template's prompts below), greedy,
the sync engine; methods interleaved prompt by prompt (the order rotates), one run each:

- `off`: the target alone under the grammar (the baseline of every speedup);
- `<shape>-aware`: the draft's q masked by the grammar too, its grammar state forked along the
  tree's branches (`models.grammar`), so it proposes only grammar-valid tokens;
- `<shape>-free`: the draft proposes freely (`GrammarSpec.draft` False), only the target is masked:
  exact too, but every invalid proposal is a rejection.

Columns: tokens/s (generated tokens over wall time, prefill included), speedup over `off`,
acceptance rate (accepted / drafted nodes), mean accepted length (bonus included), the share
of answers that validate (jsonschema; answers cut by max_tokens count as invalid), and whether
every method's greedy tokens equal `off`'s. Timings on a shared machine are noisy; acceptance
is a count and is not.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

import torch  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                    "required": ["city", "country"], "additionalProperties": False},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "address", "hobbies"], "additionalProperties": False,
}
PROMPTS = [
    "Describe a famous scientist as JSON with name, age, address (city, country) and hobbies.",
    "Invent a fictional chef and give their name, age, address and hobbies as JSON.",
    "Give me a JSON profile of a retired teacher: name, age, address and hobbies.",
]


def method(engine, spec, schema: dict, vocabulary: str, draft: bool):
    from models import SamplingParams
    from models.grammar import GrammarSpec
    from speculation.requests import GenerationRequest

    def run(prompt_ids: list[int], max_tokens: int) -> dict:
        grammar = GrammarSpec("json_schema", json.dumps(schema), vocabulary, strict=True, draft=draft)
        request = GenerationRequest("bench", prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                         grammar=grammar), spec)
        start = time.perf_counter()
        out = engine.generate([request])[0]
        return dict(token_ids=out.token_ids, seconds=time.perf_counter() - start, drafted=out.stats.num_drafted,
                    accepted=out.stats.num_accepted, steps=out.stats.num_steps, finish=out.finish_reason)
    return run


def valid(tokenizer, tokens: list[int], schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--shapes", type=common.comma_list(str), default=["chain:4:1", "tree:3:2"],
                   help="name:spec_len:tree_width, comma separated")
    p.add_argument("--max-tokens", type=common.positive_int, default=64)
    p.add_argument("--prompts", type=common.positive_int, default=3, help=f"at most {len(PROMPTS)}")
    p.add_argument("--threads", type=common.positive_int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "results" / f"structured-{common.utc('%Y%m%d')}.json")
    args = p.parse_args(argv)
    args.target, args.draft = common.model_pair(p, args)
    torch.set_num_threads(args.threads)
    from cluster.local import build_engine, speculation_for
    from models import load_tokenizer
    from models.grammar import register_vocabulary

    tok = load_tokenizer(args.target)
    vocabulary = register_vocabulary(str(args.target), tok)
    pair = build_engine(args.target, args.draft)
    from bench.e2e import prompt_ids

    work = [prompt_ids(tok, t) for t in PROMPTS[:args.prompts]]
    methods = {"off": method(pair.engine, speculation_for("off", 1, 1), SCHEMA, vocabulary, True)}
    for shape in args.shapes:
        name, k, width = shape.split(":")
        for aware in (True, False):
            methods[f"{name}-{'aware' if aware else 'free'}"] = method(
                pair.engine, speculation_for("sync", int(k), int(width)), SCHEMA, vocabulary, aware)
    for run in methods.values():                  # warm-up: compiling, first calls
        run(work[0], 4)
    runs: dict[str, list] = {n: [] for n in methods}
    names = list(methods)
    for i, ids in enumerate(work):
        for n in names[i % len(names):] + names[:i % len(names)]:
            runs[n].append(methods[n](list(ids), args.max_tokens))
    result, rows = {}, []
    base = sum(len(r["token_ids"]) for r in runs["off"]) / sum(r["seconds"] for r in runs["off"])
    for n, rs in runs.items():
        tokens, seconds = sum(len(r["token_ids"]) for r in rs), sum(r["seconds"] for r in rs)
        drafted, accepted, steps = (sum(r[k] for r in rs) for k in ("drafted", "accepted", "steps"))
        ok = sum(valid(tok, r["token_ids"], SCHEMA) for r in rs) / len(rs)
        same = all(r["token_ids"] == o["token_ids"] for r, o in zip(rs, runs["off"]))
        result[n] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "speedup": tokens / seconds / base,
                     "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
                     "mean_accepted_length": tokens / steps if steps else None, "valid": ok, "equals_off": same,
                     "finish": [r["finish"] for r in rs]}
        rows.append([n, f"{tokens / seconds:.1f}", f"{tokens / seconds / base:.2f}",
                     common.cell(result[n]["acceptance"], ".3f"), common.cell(result[n]["mean_accepted_length"], ".2f"),
                     f"{ok:.0%}", "yes" if same else "NO"])
    print(common.markdown_table(["method", "tokens/s", "speedup", "acceptance", "accepted length", "valid JSON",
                                 "greedy = off"], rows))
    common.write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "machine": common.machine(),
                                 "date": common.utc(), "schema": SCHEMA, "result": result})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
