"""`specflash manifests render --config FILE --out DIR [--check]`: write (or verify) every deployment file.

Wired into `cluster/cli.py` by `manifests_cli.add_parser(subparsers)` (sets `func=run`); `run(args)`
returns the exit code: 0 done, 1 invalid config or (with --check) files out of date.
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
    from cluster import manifests
    from cluster.config import ClusterConfig, ConfigError

    config = Path(args.config)
    try:
        cfg = ClusterConfig.from_yaml(config)
        rendered = manifests.render(cfg, source=config.name)
    except FileNotFoundError:
        return _fail(f"no cluster config at {config}")
    except ConfigError as e:
        partial = any("is missing" in p for p in e.problems)
        return _fail(f"{e}" + (" (cluster manifests need a complete config; only `specflash serve` layers a "
                                "partial one over the local defaults)" if partial else ""))
    except ValueError as e:
        return _fail(f"{config} is not a valid cluster config: {e}")
    out = Path(args.out)
    if getattr(args, "check", False):
        stale = [n for n, text in rendered.items() if not (out / n).is_file() or (out / n).read_text() != text]
        for name in stale:
            print(f"out of date: {out / name} (run: specflash manifests render --config {config} --out {out})")
        return 1 if stale else 0
    for path in manifests.write(cfg, out, source=config.name):
        print(f"wrote {path}")
    return 0


def _fail(message: str) -> int:
    """One `error: ...` line and exit status 1, as every specflash subcommand does."""
    print(f"error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m cluster.manifests_cli render ...`) until cli.py wires it in."""
    parser = argparse.ArgumentParser(prog="specflash")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["manifests", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
