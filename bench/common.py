"""What the benchmark scripts in bench/ share: the model pair's flags, argument checks,
results files, the machine a run was on, and markdown tables. Plain functions, no framework.

bench/ is a folder of scripts, not a package (no __init__.py). Each script that uses this module
starts with these lines, written out since they must run before `common` can be imported:

    ROOT = Path(__file__).resolve().parent
    sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
    from bench import common

They take bench/ itself off sys.path (`python bench/x.py` puts it first, where a script named
like a package, a bench/kernels.py, would shadow the project's `kernels`) and put the repository
first instead. `bench` is then a namespace package, so a script uses a sibling the plain way
(`from bench import e2e`), whether it runs as a script, is loaded by path (the tests'
`bench_script`) or is imported by another script.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"    # where the scripts write by default
DATE = "%Y-%m-%d %H:%M UTC"         # a run's date in its JSON
ISO = "%Y-%m-%dT%H:%M:%SZ"          # the same to the second, ISO 8601
STAMP = "%Y%m%dT%H%M%SZ"            # a file name's time stamp (load-20261201T210142Z.json)


# -- argument checks (argparse `type=`) -------------------------------------------------------
def positive_int(text: str) -> int:
    """An integer of at least 1, for `type=`; argparse reports anything else as a usage error."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer of at least 0 (a count that may be none), for `type=`."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer, not {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"at least {low}, not {value}")
    return value


def positive_float(text: str) -> float:
    """A number above 0, for `type=` (seconds, durations)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"above 0, not {text}")
    return value


def comma_list(item: Callable[[str], object] = str) -> Callable[[str], list]:
    """A `type=` for a comma list ("1,4,16"): each item through `item` (e.g. `positive_int`),
    empty items skipped, an item `item` refuses named in the error."""
    def parse(text: str) -> list:
        out = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            try:
                out.append(item(part))
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise argparse.ArgumentTypeError(f"a comma list; {part!r}: {e}") from None
        return out
    return parse


# -- the model pair ----------------------------------------------------------------------------
def add_model_pair(parser: argparse.ArgumentParser, default: str = "the embedded pair") -> None:
    """`--target DIR` and `--draft DIR`, the checkpoints a bench runs (check them with `model_pair`)."""
    parser.add_argument("--target", help=f"target checkpoint directory (default: {default})")
    parser.add_argument("--draft", help="draft checkpoint directory (with --target)")


def model_pair(parser: argparse.ArgumentParser, args: argparse.Namespace, draft_optional: bool = False,
               embedded: bool = True) -> tuple[str | None, str | None]:
    """(target, draft) from `--target` / `--draft`, which go together (a lone `--target` too
    where `draft_optional`: the target alone); neither given: the embedded pair
    (`models.embedded.default_pair`), or (None, None) where not `embedded` (the script has a
    default of its own). A usage error (exit 2) otherwise."""
    if args.draft is not None and args.target is None:
        parser.error("--target and --draft go together" if not draft_optional else "--draft needs --target")
    if args.target is not None and args.draft is None and not draft_optional:
        parser.error("--target and --draft go together")
    if args.target is not None or not embedded:
        return args.target, args.draft
    from models import embedded as assets

    target, draft = assets.default_pair()
    return str(target), str(draft)


# -- results files -----------------------------------------------------------------------------
def utc(fmt: str = DATE) -> str:
    """The time now in UTC, as `fmt` (DATE, ISO or STAMP)."""
    return time.strftime(fmt, time.gmtime())


def write_json(path: Path | str, data: object, indent: int = 1, **dumps_kw) -> Path:
    """`data` as JSON (and a final newline) at `path`, its folders made; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, **dumps_kw) + "\n")
    return path


def machine() -> dict:
    """The machine a CPU run was on: the CPU's model name, logical CPUs, torch's threads now,
    Python, torch, transformers and the OS."""
    import torch
    import transformers

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform()}


# -- tables ------------------------------------------------------------------------------------
def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None where either is missing or zero (no figure to compare)."""
    return None if not (num and den) else num / den


def cell(value: float | None, spec: str, none: str = "–") -> str:
    """`value` formatted by `spec` ('.2f', '.1%'), or `none` where there is no value."""
    return none if value is None else format(value, spec)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table, the first column left-aligned and the others right (figures)."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
