"""Benchmark of the split-K tree attention kernel (kernels/tree_attention.py).

For each (batch B, tree size T, prefix length P) on Llama-3-8B head shapes
(32 query heads, 8 KV heads, D = 128, bf16, 16-token pages) it times:

- `ours`: `kernels.tree_decode_attention` (Triton, flash-decoding split-K);
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` with the equivalent
  boolean mask on K/V already gathered out of the pages and repeated to 32 heads
  (gathering is not timed: this favours SDPA);
- `decode`: the one-query decode path torch offers, SDPA with a single query and
  no mask on gathered K/V (GQA through `enable_gqa` where supported): the cost of
  plain decoding the tree should approach;
- `ref`: the pure-torch reference, on small sizes only.

Bytes moved are the fewest a kernel must read and write (prefix + tree K/V,
q, out); achieved bytes/s are reported against the device's measured copy
bandwidth (a device-to-device copy, read + write). Timings are medians of
`triton.testing.do_bench`; small problems rotate among several input sets so
that L2 does not serve them. Prints a table; writes `kernels.json` and
`kernels_table.md` to --out.

`--dry-run` runs tiny shapes on the CPU under TRITON_INTERPRET=1 (one call
each, wall-clock): it checks the harness, not the speed.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

if "--dry-run" in sys.argv:  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kernels  # noqa: E402
from kernels import ref  # noqa: E402
from kernels.testing import make_paged_inputs  # noqa: E402

L2_DEFEAT_BYTES = 256 << 20  # rotate inputs until one pass touches this much


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(common.RESULTS), help="directory for kernels.json / table")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, interpreter")
    ap.add_argument("--prefix", type=int, nargs="*", default=[1024, 4096, 16384, 32768, 65536, 131072])
    ap.add_argument("--tree", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2 << 20, help="skip B*P above this")
    ap.add_argument("--sdpa-max-bytes", type=float, default=16e9, help="skip SDPA above this")
    ap.add_argument("--ref-max-tokens", type=int, default=1 << 18)
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting configs after")
    args = ap.parse_args()
    if args.dry_run:
        args.prefix, args.tree, args.batch = [0, 40], [1, 3], [1, 2]
        args.heads, args.page = [4, 2, 64], 16
    return args


def timed(fn, device) -> float:
    """Median milliseconds of fn()."""
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write."""
    n = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device)
    del src, dst
    return 2 * n / (ms * 1e-3)


def gathered(inputs):
    """Pages gathered to contiguous K/V [B, Hkv, L, D] and the boolean mask [B, 1, T, L]."""
    q, k_cache, v_cache, block_tables, prefix_lens, tree_mask = inputs
    B, T = q.shape[:2]
    page = k_cache.shape[1]
    P = int(prefix_lens[0])  # the benchmark gives every row the same prefix
    L = P + T
    n = (L + page - 1) // page
    pages = block_tables[:, :n].long()
    k = k_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    v = v_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    mask = torch.ones(B, 1, T, L, dtype=torch.bool, device=q.device)
    mask[:, 0, :, P:] = tree_mask
    return q.transpose(1, 2).contiguous(), k, v, mask


def sdpa_fn(q, k, v, mask):
    """SDPA over repeated heads (the masked path has no GQA support in every backend)."""
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)


def decode_fn(q, k, v):
    """One query, no mask: torch's best decode path (flash / cuDNN with GQA)."""
    q1 = q[:, :, :1].contiguous()
    try:
        torch.nn.functional.scaled_dot_product_attention(q1, k, v, enable_gqa=True)
        return lambda: torch.nn.functional.scaled_dot_product_attention(q1, k, v, enable_gqa=True)
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: torch.nn.functional.scaled_dot_product_attention(q1, k_rep, v_rep)


def bench_one(B, T, P, args, device, dtype) -> dict:
    Hq, Hkv, D = args.heads
    elt = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * B * (P + T) * Hkv * D * elt
    min_bytes = kv_bytes + 2 * B * T * Hq * D * elt
    sets = max(1, min(16, math.ceil(L2_DEFEAT_BYTES / max(kv_bytes, 1))))
    if device.type != "cuda":
        sets = 1
    inputs = [make_paged_inputs(B, T, Hq, Hkv, D, args.page, [P] * B, dtype, seed=s,
                                device=device) for s in range(sets)]
    turn = [0]

    def ours():
        turn[0] = (turn[0] + 1) % sets
        return kernels.tree_decode_attention(*inputs[turn[0]])

    row = dict(B=B, T=T, P=P, Hq=Hq, Hkv=Hkv, D=D, dtype=str(dtype).replace("torch.", ""),
               min_bytes=min_bytes, input_sets=sets)
    row["ours_ms"] = timed(ours, device)
    row["ours_bytes_per_s"] = min_bytes / (row["ours_ms"] * 1e-3)
    out = kernels.tree_decode_attention(*inputs[0])
    if B * P <= args.ref_max_tokens:
        row["ref_ms"] = timed(lambda: ref.tree_decode_attention(*inputs[0]), device)
    if 2 * B * (P + T) * Hq * D * elt <= args.sdpa_max_bytes:
        q, k, v, mask = gathered(inputs[0])
        fn = sdpa_fn(q, k, v, mask)
        want = fn().transpose(1, 2)
        row["rel_err_vs_sdpa"] = float((out.double() - want.double()).norm() / want.double().norm())
        row["sdpa_ms"] = timed(fn, device)
        row["decode_ms"] = timed(decode_fn(q, k, v), device)
        del q, k, v, mask, fn, want
    del inputs
    return row


def configs(args):
    """Headline configurations first (P >= 32K, T <= 16), so a cut budget drops the rest."""
    all_ = [(B, T, P) for B in args.batch for T in args.tree for P in args.prefix
            if B * P <= args.max_tokens]
    return sorted(all_, key=lambda c: (not (c[2] >= 32768 and c[1] <= 16), c[0], c[2], c[1]))


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(rows, copy_bw) -> str:
    ours_t1 = {(r["B"], r["P"]): r["ours_ms"] for r in rows if r["T"] == 1}
    head = ("|   B |  T |      P | ours ms |  GB/s | % copy | sdpa ms | x sdpa | decode ms "
            "| ours/T=1 | ours/decode |  ref ms | rel err |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in sorted(rows, key=lambda r: (r["B"], r["P"], r["T"])):
        t1 = ours_t1.get((r["B"], r["P"]))
        lines.append(
            f"| {r['B']:3d} | {r['T']:2d} | {r['P']:6d} | {r['ours_ms']:7.4f} "
            f"| {r['ours_bytes_per_s'] / 1e9:5.0f} | {100 * r['ours_bytes_per_s'] / copy_bw:6.1f} "
            f"| {fmt(r.get('sdpa_ms'), '7.4f')} "
            f"| {fmt(r['sdpa_ms'] / r['ours_ms'] if 'sdpa_ms' in r else None, '6.2f')} "
            f"| {fmt(r.get('decode_ms'), '9.4f')} | {fmt(r['ours_ms'] / t1 if t1 else None, '8.2f')} "
            f"| {fmt(r['ours_ms'] / r['decode_ms'] if 'decode_ms' in r else None, '11.2f')} "
            f"| {fmt(r.get('ref_ms'), '7.3f')} | {fmt(r.get('rel_err_vs_sdpa'), '7.1e')} |")
    return "\n".join(lines)


def main():
    args = parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench/kernel_bench.py needs CUDA; use --dry-run to check the harness on the CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_bw = copy_bandwidth(device)
    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, triton=triton.__version__, dry_run=args.dry_run,
                copy_bytes_per_s=copy_bw, page=args.page, started=common.utc(common.ISO))
    print(f"device {meta['device']}, copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    rows, skipped, start = [], [], time.monotonic()
    for B, T, P in tqdm(configs(args), desc="tree attention", file=sys.stdout):
        if time.monotonic() - start > args.budget_s:
            skipped.append(dict(B=B, T=T, P=P, why="time budget"))
            continue
        try:
            rows.append(bench_one(B, T, P, args, device, dtype))
        except torch.cuda.OutOfMemoryError as err:
            skipped.append(dict(B=B, T=T, P=P, why=f"out of memory: {err}"[:200]))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = table(rows, copy_bw)
    print(text)
    if skipped:
        print(f"skipped {len(skipped)} configurations (see kernels.json)")
    common.write_json(out_dir / "kernels.json", dict(meta=meta, rows=rows, skipped=skipped))
    (out_dir / "kernels_table.md").write_text(f"{meta['device']}, copy {copy_bw / 1e9:.0f} GB/s\n\n{text}\n")
    bad = [r for r in rows if r.get("rel_err_vs_sdpa", 0.0) > 2e-2]
    if bad:
        print(f"ERROR: {len(bad)} configurations disagree with SDPA", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
