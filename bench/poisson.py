"""Open-loop load for `specflash serve`: Poisson arrivals at several rates, mixed requests, goodput
under an SLO, speculation on and off against the same server.

    python bench/poisson.py --url http://127.0.0.1:8000 --rates 0.25,0.5,1,2 --duration 120
    python bench/poisson.py --start --rates 0.25,0.5,1,2 --duration 120 --plot docs/poisson-itl.png

Unlike `bench/load.py` (N closed-loop clients), arrivals here do not wait for answers: at offered
load λ requests/s the gaps between sends are Exponential(1/λ) (seeded), so queues build as they
would in production. Each request is one of three kinds, drawn with the stated mix: code (a Python
task, `--code-tokens` out), math (a worked arithmetic question, `--math-tokens`) and chat (a short
question, `--chat-tokens`), sent to `/v1/chat/completions`, greedy, streamed, `ignore_eos`; the
speculation mode (default `off` and `auto`) goes in each request's `speculation` field, the modes
alternating cell by cell at each rate, which of them goes first turning from rate to rate. Per cell:

- TTFT p50 / p99 and ITL p50 / p99 (ITL per token, as bench/load.py counts it);
- goodput: requests per second (of the window) that met the SLO themselves: TTFT <= `--slo-ttft`
  and their own p99 ITL <= `--slo-itl` (DistServe's per-request goodput); and whether the cell as a
  whole met it (p99 TTFT and p99 ITL under the bounds), both bounds printed in the table;
- the engine's counters over the cell's window and the planner's step costs at its end
  (`engine`, `planner`: what `/metrics` says, as bench/load.py records them).

Writes `bench/results/poisson-<UTC time>.json`, prints a table, and with `--plot` draws ITL p50/p99
against offered load for each mode. `--quick` is a smoke run.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]
from bench import common, load  # noqa: E402  (bench/ off sys.path, the repository on it)

import httpx  # noqa: E402

KINDS = {   # kind -> (share of arrivals, prompts); the output lengths come from the flags
    "code": (0.4, load.CHAT_PROMPTS[:4]),
    "math": (0.3, load.CHAT_PROMPTS[4:]),
    "chat": (0.3, ["Explain what a hash map is in two sentences.",
                   "What is the capital of Japan? Answer and explain.",
                   "Translate to French: good morning, my friend.",
                   "Give me three tips for writing clear emails."]),
}


def arrivals(rate: float, duration: float, seed: int) -> list[tuple[float, str, str]]:
    """(send time offset s, kind, prompt) for a Poisson process of `rate` over `duration` seconds."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    weights = [KINDS[k][0] for k in kinds]
    out, t = [], rng.expovariate(rate)
    while t < duration:
        kind = rng.choices(kinds, weights)[0]
        out.append((t, kind, rng.choice(KINDS[kind][1])))
        t += rng.expovariate(rate)
    return out


def request_for(kind: str, prompt: str, tokens: dict[str, int], mode: str) -> tuple[str, dict]:
    path, body = load.request_body("chat-code-math", 0, tokens[kind], {"mode": mode})
    return path, {**body, "messages": [{"role": "user", "content": prompt}]}


def per_request_ok(rec: dict, slo_ttft: float, slo_itl: float) -> bool:
    if rec["requests"] != 1 or not rec["ttft"]:
        return False
    itl99 = load.percentile(rec["itl"], 99)
    return rec["ttft"][0] <= slo_ttft and (itl99 is None or itl99 <= slo_itl)


async def run_cell(url: str, rate: float, mode: str, duration: float, tokens: dict[str, int],
                   slo_ttft: float, slo_itl: float, seed: int = 0,
                   transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """One offered load, one mode: send on the Poisson schedule, wait for every answer (up to
    `duration` more seconds), and summarise."""
    plan = arrivals(rate, duration, seed)
    recs = [{"tokens": 0, "ttft": [], "itl": [], "tpot": [], "requests": 0, "errors": 0} for _ in plan]
    t0 = time.perf_counter()
    cutoff = t0 + 2 * duration + 60                  # a request still running then is cut

    async def send(i: int, client: httpx.AsyncClient) -> None:
        at, kind, prompt = plan[i]
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        path, body = request_for(kind, prompt, tokens, mode)
        try:
            await load.one_request(client, url, path, body, cutoff, recs[i])
        except httpx.HTTPError:
            recs[i]["errors"] += 1

    limits = httpx.Limits(max_connections=max(8, int(rate * duration) + 4))
    async with httpx.AsyncClient(timeout=600, limits=limits, transport=transport) as client:
        tasks = [asyncio.ensure_future(send(i, client)) for i in range(len(plan))]
        await asyncio.wait(tasks, timeout=max(1.0, cutoff - time.perf_counter()))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ttft = [x for r in recs for x in r["ttft"]]
    itl = [x for r in recs for x in r["itl"]]
    good = sum(per_request_ok(r, slo_ttft, slo_itl) for r in recs)
    cell = {"rate": rate, "mode": mode, "window_s": duration, "sent": len(plan),
            "completed": sum(r["requests"] for r in recs), "errors": sum(r["errors"] for r in recs),
            "kinds": {k: sum(1 for _, kind, _ in plan if kind == k) for k in KINDS},
            "tokens": sum(r["tokens"] for r in recs),
            "ttft_p50_s": load.percentile(ttft, 50), "ttft_p99_s": load.percentile(ttft, 99),
            "itl_p50_s": load.percentile(itl, 50), "itl_p99_s": load.percentile(itl, 99),
            "goodput_req_s": good / duration, "good_requests": good,
            "slo": {"ttft_p99_s": slo_ttft, "itl_p99_s": slo_itl}}
    cell["slo_met"] = (cell["ttft_p99_s"] is not None and cell["ttft_p99_s"] <= slo_ttft
                       and (cell["itl_p99_s"] or 0.0) <= slo_itl and cell["errors"] == 0)
    return cell


def run_cells(url: str, args, tokens: dict[str, int]) -> list[dict]:
    """Every (rate, mode) cell, the modes' order turned at each rate (as bench/load.py does) so
    that a drift of the machine, or what the first mode leaves the second (a warm prefix cache,
    a cost model fitted on its steps), favours neither; each with the engine's counters over its
    window (`engine`: speculating steps, drafted and accepted tokens, ...) and the planner's
    predicted step costs at its end (`planner`), which say whether `auto` speculated and why."""
    cells = []
    for turn, rate in enumerate(args.rates):
        for mode in (args.modes if turn % 2 == 0 else args.modes[::-1]):
            before = load.engine_counters(url)
            cell = asyncio.run(run_cell(url, rate, mode, args.duration, tokens, args.slo_ttft,
                                        args.slo_itl, seed=args.seed))
            after = load.engine_counters(url)
            cell["engine"] = {k: after[k] - before.get(k, 0.0) for k in after if not k.startswith("planner_")}
            cell["planner"] = {k: v for k, v in after.items() if k.startswith("planner_")}
            cells.append(cell)
            print(f"rate {rate:g} {mode}: {cell['completed']}/{cell['sent']} done, "
                  f"goodput {cell['goodput_req_s']:.3f} req/s", flush=True)
    return sorted(cells, key=lambda c: (args.rates.index(c["rate"]), args.modes.index(c["mode"])))


def table(cells: list[dict], slo_ttft: float, slo_itl: float) -> str:
    rows = [(f"{c['rate']:g}", c["mode"], c["sent"], c["completed"], c["errors"],
             common.cell(c["ttft_p50_s"], ".3f"), common.cell(c["ttft_p99_s"], ".3f"),
             common.cell(c["itl_p50_s"] and 1000 * c["itl_p50_s"], ".1f"),
             common.cell(c["itl_p99_s"] and 1000 * c["itl_p99_s"], ".1f"),
             f"{c['goodput_req_s']:.3f}", "yes" if c["slo_met"] else "no") for c in cells]
    header = ("offered req/s", "mode", "sent", "done", "err", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
              "ITL p99 ms", "goodput req/s", f"SLO met (p99 TTFT <= {slo_ttft:g} s, p99 ITL <= {1000 * slo_itl:g} ms)")
    return common.markdown_table(header, rows)


def plot(cells: list[dict], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in dict.fromkeys(c["mode"] for c in cells):
        mine = sorted((c for c in cells if c["mode"] == mode and c["itl_p50_s"]), key=lambda c: c["rate"])
        rates = [c["rate"] for c in mine]
        ax.plot(rates, [1000 * c["itl_p50_s"] for c in mine], marker="o", label=f"{mode} p50")
        ax.plot(rates, [1000 * c["itl_p99_s"] for c in mine], marker="x", linestyle="--", label=f"{mode} p99")
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title("ITL against offered load, speculation on and off")
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    load.add_server_args(p)
    p.add_argument("--rates", type=common.comma_list(common.positive_float), default="0.25,0.5,1,2",
                   help="offered loads, requests per second")
    p.add_argument("--modes", type=common.comma_list(), default="off,auto")
    p.add_argument("--duration", type=common.positive_float, default=120.0, help="seconds of arrivals per cell")
    p.add_argument("--code-tokens", type=common.positive_int, default=128)
    p.add_argument("--math-tokens", type=common.positive_int, default=96)
    p.add_argument("--chat-tokens", type=common.positive_int, default=48)
    p.add_argument("--slo-ttft", type=common.positive_float, default=2.0, help="p99 TTFT bound, seconds")
    p.add_argument("--slo-itl", type=common.positive_float, default=0.2, help="p99 ITL bound, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write the ITL-against-load plot here (PNG)")
    p.add_argument("--quick", action="store_true", help="rates 0.5,1, 10 s cells, 16 tokens each")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.duration = [0.5, 1.0], 10.0
        args.code_tokens = args.math_tokens = args.chat_tokens = 16
    tokens = {"code": args.code_tokens, "math": args.math_tokens, "chat": args.chat_tokens}
    proc = None
    if args.url is None:
        if not args.start:
            p.error("give --url or --start")
        proc, args.url = load.start_server(args)
    try:
        cells = run_cells(args.url, args, tokens)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    print(table(cells, args.slo_ttft, args.slo_itl))
    result = {"date": common.utc(), "machine": common.machine(), "url": args.url, "tokens": tokens,
              "mix": {k: v[0] for k, v in KINDS.items()}, "seed": args.seed, "cells": cells}
    out = args.out or common.RESULTS / f"poisson-{common.utc(common.STAMP)}.json"
    print(f"wrote {common.write_json(out, result)}")
    if args.plot:
        print(f"wrote {plot(cells, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
