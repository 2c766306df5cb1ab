"""The `specflash` console script.

    specflash generate [--target DIR] [--draft DIR] --prompt TEXT [--max-tokens N]
        [--temperature T] [--top-p P] [--top-k K] [--seed S] [--spec-len K]
        [--tree-width W] [--mode off|sync|async] [--ignore-eos] [--json]
        [--chat] [--proposer model|ngram]

`generate` runs the in-process engine (`cluster.engine`): `off` is the target
alone, `sync` is draft-then-verify with a chain (width 1) or an EAGLE-2 tree;
`async` runs the Ray drafter/verifier pipeline (`cluster.pipeline`) on a local Ray.
`serve` (`cluster.serve_cli`) and `manifests` (`cluster.manifests_cli`) share the parser.
Without --target / --draft it uses the embedded pair (`models.embedded`).
Bad input ends with one `error: ...` line on stderr and exit status 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from cluster.engine import MAX_SPEC_LEN, MAX_TREE_WIDTH, EngineError, build_engine, speculation_for

EXIT_ERROR = 1


class CliError(Exception):
    """A user-facing error: printed as `error: <message>`."""


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text in-process (speculative or not)",
                              description="Generate text with the target model, speculatively or not.")
    p.add_argument("--target", metavar="DIR", help="target HF checkpoint directory (default: embedded)")
    p.add_argument("--draft", metavar="DIR", help="draft HF checkpoint directory (default: embedded)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="raw prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--spec-len", type=int, default=4, metavar="K",
                   help=f"draft chain length / tree depth, 1..{MAX_SPEC_LEN}")
    p.add_argument("--tree-width", type=int, default=1, metavar="W",
                   help=f"children per expanded node, 1..{MAX_TREE_WIDTH} (1 = chain)")
    p.add_argument("--mode", choices=("off", "sync", "async"), default="sync")
    p.add_argument("--proposer", choices=("model", "eagle", "ngram"), default="model",
                   help="model: the draft model; eagle: the embedded EAGLE draft head (sync mode, embedded "
                        "pair; name one with --draft instead); ngram: prompt lookup")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specflash", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(subparsers)
    from cluster import manifests_cli, serve_cli

    serve_cli.add_parser(subparsers)
    manifests_cli.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as e:
        return _fail(str(e))
    except (EngineError, ValueError, OSError, RuntimeError) as e:   # ModelLoadError is a ValueError
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_ERROR


@dataclass
class _Plan:
    target_dir: str
    draft_dir: str | None
    needs_draft: bool


def run_generate(args) -> int:
    from speculation.requests import GenerationRequest
    from models.sampling import SamplingParams

    if args.proposer == "eagle" and args.mode == "async":
        raise CliError("--proposer eagle: the EAGLE draft head reads the target's features, which only the "
                       "sync engine passes it (--mode sync)")
    if args.mode == "async":
        from cluster.pipeline import run_async_generate

        return run_async_generate(args)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    speculation = speculation_for(args.mode, args.spec_len, args.tree_width,
                                  "model" if args.proposer == "eagle" else args.proposer)
    plan = _resolve_dirs(args)
    pair = build_engine(plan.target_dir, plan.draft_dir, spec_len=args.spec_len,
                        tree_width=args.tree_width, load_draft=plan.needs_draft)
    prompt_ids = _tokenize(pair.tokenizer, args.prompt, args.chat)
    out = pair.engine.generate([GenerationRequest("cli", prompt_ids, params, speculation)])[0]
    text = pair.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    stats = out.stats.as_dict()
    if args.json:
        print(json.dumps({"text": text, "token_ids": out.token_ids, "target": pair.target_dir,
                          "draft": pair.draft_dir, "stats": stats}))
    else:
        print(text)
        print(f"[{len(out.token_ids)} tokens, {stats['tokens_per_s']:.1f} tokens/s, mode {args.mode}, "
              f"acceptance {stats['acceptance_rate']:.2f}, mean accepted length "
              f"{stats['mean_accepted_len']:.2f}, finish: {out.finish_reason}]", file=sys.stderr)
    return 0


def _resolve_dirs(args) -> _Plan:
    """The checkpoint directories to use; the embedded pair when none is named."""
    needs_draft = args.mode == "sync" and args.proposer in ("model", "eagle")
    if args.proposer == "eagle" and (args.target is not None or args.draft is not None):
        raise CliError("--proposer eagle picks the embedded EAGLE draft head; with --target, name an EAGLE "
                       "head with --draft and keep --proposer model")
    if args.target is None and args.draft is not None:
        raise CliError("--draft needs --target (the draft must match a named target)")
    if args.target is not None:
        if needs_draft and args.draft is None:
            raise CliError("--mode sync with the model proposer needs --draft; "
                           "or use --proposer ngram, or --mode off")
        return _Plan(args.target, args.draft, needs_draft)
    from models import embedded

    try:
        if needs_draft and args.proposer == "eagle":
            return _Plan(str(embedded.target_dir()), str(embedded.eagle_dir()), True)
        if needs_draft:
            target, draft = embedded.default_pair()
            return _Plan(str(target), str(draft), True)
        return _Plan(str(embedded.target_dir()), None, False)
    except embedded.EmbeddedModelError as e:
        raise CliError(f"the embedded model pair is not available: {e}") from e


def _tokenize(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise CliError("--chat: the target's tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


if __name__ == "__main__":
    sys.exit(main())
