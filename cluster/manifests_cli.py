"""`specflash manifests render --config FILE --out DIR [--check]`: write (or verify) every deployment file.

Wired into `cluster/cli.py` by `manifests_cli.add_parser(subparsers)`; `run(args)` returns the exit code.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CONFIG = "manifests/cluster.example.yaml"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "manifests", help="render the KubeRay, Serve and `ray up` manifests from the cluster config"
    )
    actions = parser.add_subparsers(dest="manifests_command", required=True)
    render = actions.add_parser("render", help="write rayservice.yaml, raycluster.yaml, ... into --out")
    render.add_argument("--config", default=DEFAULT_CONFIG, help=f"cluster config YAML (default {DEFAULT_CONFIG})")
    render.add_argument("--out", default="manifests", help="output directory (default manifests/)")
    render.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when the files in --out differ (CI drift check)"
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import pydantic

    from cluster import manifests
    from cluster.config import ClusterConfig

    config = Path(args.config)
    try:
        cfg = ClusterConfig.from_yaml(config)
        rendered = manifests.render(cfg, source=config.name)
    except FileNotFoundError:
        print(f"error: no cluster config at {config}", file=sys.stderr)
        return 2
    except (pydantic.ValidationError, ValueError) as e:
        print(f"error: {config} is not a valid cluster config:\n{e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if getattr(args, "check", False):
        stale = [n for n, text in rendered.items() if not (out / n).is_file() or (out / n).read_text() != text]
        for name in stale:
            print(f"out of date: {out / name} (run: specflash manifests render --config {config} --out {out})")
        return 1 if stale else 0
    for path in manifests.write(cfg, out, source=config.name):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m cluster.manifests_cli render ...`) until cli.py wires it in."""
    parser = argparse.ArgumentParser(prog="specflash")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["manifests", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
