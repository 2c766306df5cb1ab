"""The `specflash` console script.

    specflash generate [--target DIR] [--draft DIR] --prompt TEXT [--max-tokens N]
        [--temperature T] [--top-p P] [--top-k K] [--seed S] [--spec-len K]
        [--tree-width W] [--mode off|sync|async] [--ignore-eos] [--json]
        [--chat] [--proposer model|ngram]

`generate` (cluster/generate.py) runs one request: `off` is the target alone, `sync` is
draft-then-verify in process with a chain (width 1) or an EAGLE-2 tree; `async` runs the Ray
drafter/verifier pipeline (`cluster.pipeline`) on a local Ray.
`serve` (`cluster.serve_cli`) and `manifests` (`cluster.manifests_cli`) share the parser.
Without --target / --draft it uses the embedded pair (`models.embedded`).
Bad input ends with one `error: ...` line on stderr and exit status 1.
"""
from __future__ import annotations

import argparse
import sys

from cluster.generate import CliError, run_generate
from speculation.settings import MAX_SPEC_LEN, MAX_TREE_WIDTH

EXIT_ERROR = 1


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
    p.add_argument("--min-p", type=float, default=0.0, metavar="P", help="0 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="X")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X", help="1 = off")
    p.add_argument("--spec-len", type=int, default=4, metavar="K",
                   help=f"draft chain length / tree depth, 1..{MAX_SPEC_LEN}")
    p.add_argument("--tree-width", type=int, default=1, metavar="W",
                   help=f"children per expanded node, 1..{MAX_TREE_WIDTH} (1 = chain)")
    p.add_argument("--mode", choices=("off", "sync", "async"), default="sync")
    p.add_argument("--proposer", choices=("model", "eagle", "ngram"), default="model",
                   help="model: the draft model; eagle: the embedded EAGLE draft head (the embedded "
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
    except (ValueError, OSError, RuntimeError) as e:   # ModelLoadError, InvalidRequest are ValueErrors
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
