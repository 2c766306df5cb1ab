"""The cost of verifying T tokens against one decoding step, CPU, C kernel vs torch matmul.

    python bench/cpu_matmul.py                     # embedded target, 1 thread, rows 1 2 4 8
    python bench/cpu_matmul.py --threads 2 --reps 12
    python bench/cpu_matmul.py --target DIR --rows 1 3 5
    python bench/cpu_matmul.py --rows 1 2 3 4 --baseline OLD.c   # also an earlier kernel's source

One process, the same target and KV cache; every repetition runs each row
count through torch alone (C-: the few-row C kernels instead): with
`kernels.cpu.skinny_linear` on the weights in place and the C layer operators
(kernels/cpu/layer_ops.c) called from Python (C-layer); the same with each whole
layer in one C call (kernels/cpu/decoder_layer.c; C-decoder); and that with the
weights repacked into panels (`kernels.cpu.panel_linear`; C-panels on AVX2,
C-panels-512 on AVX-512 where the CPU has it: the default there), interleaved, so drift of
the machine hits all alike. A row count T is a verification of a chain of
T - 1 draft tokens after a 120-token prefix (T = 1: plain decoding). Reports
the median milliseconds and the ratio to torch's one-row step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

import torch  # noqa: E402


def time_paths(paths: list[tuple], verify_once, rows: list[int], reps: int, layer_ops, whole
               ) -> dict[tuple[str, int], list[float]]:
    """Seconds of `verify_once(n)` for each path and row count, the paths interleaved round by
    round (the first round warms them up, untimed). A path: (name, few-row limit, library, C
    layer operators, a layer in one call, float32 panels, the panels' instruction set or None),
    set on `models.linear` and `kernels.cpu` for its turn (the caller puts them back)."""
    import models.linear as mt
    from kernels import cpu

    never = lambda *a: False     # noqa: E731
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(reps + 1):
        for name, limit, library, fused, in_one_call, panels, isa in paths:
            mt._SKINNY_ROWS, cpu._lib, mt.FP32_PANELS = limit, library, panels
            if isa is not None:
                cpu.panel_isa(isa)
            cpu.layer_ops_apply = layer_ops if fused else never
            cpu.decoder_layer_available = whole if in_one_call else never
            verify_once(1)                               # a switch of path may repack the weights
            for n in rows:
                t = verify_once(n)
                if rep:                                  # the first round warms both paths up
                    times.setdefault((name, n), []).append(t)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target checkpoint (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=common.positive_int, default=1)
    p.add_argument("--reps", type=common.positive_int, default=10)
    p.add_argument("--rows", type=common.positive_int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--baseline", metavar="SOURCE",
                   help="also time the kernel built from this C source (e.g. an earlier commit's "
                        "kernels/cpu/skinny_gemm.c, from `git show`), interleaved with the others")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import models.linear as mt
    from kernels import cpu
    from models import load_model
    from models.sampling import SamplingParams
    from models.tree import TokenTree
    from verifier import Verifier, VerifyRequest

    if not cpu.available():
        print(f"the C kernel is unavailable here: {cpu.unavailable_reason()}")
        return 1
    if args.target is None:
        from models.embedded import target_dir

        args.target = str(target_dir())
    model = load_model(args.target, device="cpu", dtype=torch.float32)
    verifier = Verifier(model, model.new_cache(256, 16))
    prompt = [100 + i % 1000 for i in range(120)]
    params = SamplingParams(temperature=0.0, max_tokens=16)

    def verify_once(rows: int) -> float:
        n = rows - 1
        tree = (TokenTree.empty(len(prompt)) if n == 0 else
                TokenTree(torch.full((n,), 5), torch.arange(-1, n - 1), torch.arange(1, n + 1), None, len(prompt), 0))
        verifier.prefill("s", prompt)
        start = time.perf_counter()
        verifier.verify([VerifyRequest("s", prompt[-1], tree, params, torch.Generator())])
        seconds = time.perf_counter() - start
        verifier.release("s")
        return seconds

    saved, lib, layer_ops, whole = mt._SKINNY_ROWS, cpu._load(), cpu.layer_ops_apply, cpu.decoder_layer_available
    isa = cpu.panel_isa()
    # name, few-row limit, library, C layer operators, a layer in one call, float32 panels, their ISA
    paths = [("torch", 0, lib, False, False, False, None), ("C-layer", saved, lib, True, False, False, None),
             ("C-decoder", saved, lib, True, True, False, None), ("C-panels", saved, lib, True, True, True, "avx2")]
    if isa == "avx512":
        paths.append(("C-panels-512", saved, lib, True, True, True, "avx512"))
    if args.baseline:
        paths.append(("baseline", saved, cpu.open_library(cpu.build(source=Path(args.baseline))), True, True, False,
                      None))
    try:
        times = time_paths(paths, verify_once, args.rows, args.reps, layer_ops, whole)
    finally:
        mt._SKINNY_ROWS, cpu._lib, cpu.layer_ops_apply, cpu.decoder_layer_available = saved, lib, layer_ops, whole
        mt.FP32_PANELS = True
        cpu.panel_isa(isa)
    base = statistics.median(times[("torch", args.rows[0])])
    print(f"threads {args.threads}, {args.reps} interleaved repetitions, median ms (ratio to torch's "
          f"{args.rows[0]}-row step)")
    for name, *_ in paths:
        cells = [f"{r} rows {statistics.median(times[(name, r)]) * 1e3:.1f} "
                 f"({statistics.median(times[(name, r)]) / base:.2f})" for r in args.rows]
        print(f"{name:9s} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
