"""Where one target forward's time goes on a GPU: device time against wall time.

The pipeline's plain step on an 8B-shaped target took ~34 ms a token on an H200
(bench/gpu_e2e.py), where reading 16 GB of bf16 weights takes ~4 ms. This times
`models.Transformer.forward` in-process (no Ray) for a chain of T tokens after a
prefill, per T and dtype: wall-clock per forward (synchronised), the device time
the profiler attributes to kernels, the number of kernel launches, and the top
operators by host and by device time. Writes JSON (and prints a table).

    python bench/gpu_forward.py --out $OUT                 # on a CUDA machine
    python bench/gpu_forward.py --model random:tiny --device cpu --dtypes float32   # harness check
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

import torch  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def chain_inputs(model, T: int, prefix: int, device: str):
    """Random token ids [1, T] of a chain after `prefix` cached tokens, their positions and mask."""
    from models.transformer import causal_mask

    ids = torch.randint(0, model.config.vocab_size, (1, T), device=device)
    return ids, torch.arange(prefix, prefix + T, device=device)[None], causal_mask(1, T, device)


def time_forward(model, cache, T: int, prefix: int, reps: int, device: str) -> tuple[float, list[float]]:
    """Median wall ms of a T-token chain forward at a fixed prefix length (cache truncated back)."""
    ids, pos, mask = chain_inputs(model, T, prefix, device)
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            model(ids, pos, cache, [0], mask)
            sync(device)
            times.append((time.perf_counter() - t) * 1e3)
            cache.truncate(0, prefix)
    times.sort()
    return times[len(times) // 2], times


def profile_forward(model, cache, T: int, prefix: int, device: str, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    ids, pos, mask = chain_inputs(model, T, prefix, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.inference_mode(), profile(activities=acts) as prof:
        for _ in range(3):
            model(ids, pos, cache, [0], mask)
            sync(device)
            cache.truncate(0, prefix)
    events = prof.key_averages()
    dev_attr = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]
    rows = [dict(name=e.key[:80], calls=e.count // 3, host_ms=e.self_cpu_time_total / 3e3,
                 device_ms=getattr(e, "self_" + dev_attr, 0.0) / 3e3) for e in events]
    return dict(
        kernel_launches_per_forward=len(kernels) / 3,
        device_ms_per_forward=sum(getattr(e, dev_attr) for e in kernels) / 3e3 if kernels else None,
        top_host=sorted(rows, key=lambda r: -r["host_ms"])[:top],
        top_device=sorted(rows, key=lambda r: -r["device_ms"])[:top] if device == "cuda" else [],
    )


def chain_vs_steps(model, cache, T: int, prefix: int, device: str) -> dict:
    """Logits of one T-token chain forward against T one-token forwards of the same tokens:
    how far rounding moves them, how often the greedy token flips, and the top-2 gap."""
    from models.transformer import causal_mask

    ids, pos, mask = chain_inputs(model, T, prefix, device)
    with torch.inference_mode():
        chain = model(ids, pos, cache, [0], mask)[0].double()
        cache.truncate(0, prefix)
        steps = torch.cat([model(ids[:, i:i + 1], pos[:, i:i + 1], cache, [0], causal_mask(1, 1, device))[0]
                           for i in range(T)]).double()
        cache.truncate(0, prefix)
    top2 = steps.topk(2, dim=-1).values
    return dict(rel_diff=float((chain - steps).norm() / steps.norm()),
                max_abs_diff=float((chain - steps).abs().max()),
                argmax_agree=float((chain.argmax(-1) == steps.argmax(-1)).double().mean()),
                median_top2_gap=float((top2[:, 0] - top2[:, 1]).median()),
                logit_std=float(steps.std()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama3-8b:0")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--tokens", type=common.positive_int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--prefix", type=common.positive_int, default=128)
    p.add_argument("--reps", type=common.positive_int, default=20)
    p.add_argument("--top", type=common.positive_int, default=12)
    p.add_argument("--out", default=str(common.RESULTS), help="the folder for gpu_forward.json")
    args = p.parse_args(argv)
    from models.presets import random_model
    from models import cuda_graphs

    result = dict(args=vars(args), device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  torch=torch.__version__, runs=[])
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model = random_model(args.model, device=args.device, dtype=dtype)
        cache = model.new_cache(num_blocks=(args.prefix + max(args.tokens)) // 16 + 2)
        cache.add_sequence(0)
        ids, pos, mask = chain_inputs(model, args.prefix, 0, args.device)
        with torch.inference_mode():                                   # the prefix, cached once
            model(ids, pos, cache, [0], mask)
        agree = chain_vs_steps(model, cache, max(args.tokens), args.prefix, args.device)
        result["runs"].append(dict(dtype=dtype_name, chain_vs_steps=agree))
        print(f"{dtype_name:9s} chain of {max(args.tokens)} vs one-token forwards: "
              + ", ".join(f"{k} {v:.3g}" for k, v in agree.items()), flush=True)
        for T in args.tokens:
            time_forward(model, cache, T, args.prefix, 3, args.device)          # compile, warm up
            median, times = time_forward(model, cache, T, args.prefix, args.reps, args.device)
            run = dict(dtype=dtype_name, T=T, wall_ms=median, wall_ms_all=times)
            if T in (1, max(args.tokens)):
                run.update(profile_forward(model, cache, T, args.prefix, args.device, args.top))
            result["runs"].append(run)
            dev = run.get("device_ms_per_forward")
            print(f"{dtype_name:9s} T={T:3d}: wall {median:8.2f} ms"
                  + (f", device {dev:7.2f} ms, {run['kernel_launches_per_forward']:.0f} launches" if dev else ""),
                  flush=True)
        if args.device == "cuda" and cuda_graphs.enable(model):   # the same forwards as CUDA graphs
            for T in args.tokens:
                time_forward(model, cache, T, args.prefix, 3, args.device)      # eager, capture, replay
                median, times = time_forward(model, cache, T, args.prefix, args.reps, args.device)
                eager = next(r["wall_ms"] for r in result["runs"] if r.get("T") == T and r["dtype"] == dtype_name
                             and not r.get("graphs"))
                result["runs"].append(dict(dtype=dtype_name, T=T, graphs=True, wall_ms=median, wall_ms_all=times))
                print(f"{dtype_name:9s} T={T:3d}: graphed wall {median:8.2f} ms ({eager / median:.1f}x eager)",
                      flush=True)
            result["runs"].append(dict(dtype=dtype_name, graph_stats=model.graphs.stats()))
        del model, cache
        if args.device == "cuda":
            torch.cuda.empty_cache()
    common.write_json(Path(args.out) / "gpu_forward.json", result)
    for run in result["runs"]:
        if run.get("top_host") and run.get("top_device") is not None:
            print(f"\n{run['dtype']} T={run['T']}: top host (ms/forward) | top device (ms/forward)")
            for h, d in zip(run["top_host"], run["top_device"] or [{}] * len(run["top_host"])):
                print(f"  {h['host_ms']:7.2f} {h['calls']:5d} {h['name'][:45]:45s} | "
                      f"{d.get('device_ms', 0):7.2f} {d.get('calls', 0):5d} {d.get('name', '')[:45]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
