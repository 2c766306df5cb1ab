"""Load generator for `specflash serve`: N concurrent streaming clients, speculation on vs off.

    python bench/load.py --url http://127.0.0.1:8000            # a running server
    python bench/load.py --start --target DIR --draft DIR       # start one (python -m cluster.serve_cli)

For each concurrency (default 1, 4, 16, 64) and each speculation mode (default `off` and
`auto`), N clients stream requests back to back for `--duration` seconds (greedy, or unseeded
sampling at `--temperature` as an API client sends by default, through `--top-p` if given,
`ignore_eos`, `--max-tokens` each) against the *same* server; the mode goes in the request's
`speculation` field. `--workload completions` (default) sends raw prompts to `/v1/completions`;
`--workload chat-code-math` sends code and math questions to `/v1/chat/completions`. Reported per cell:

- throughput: output tokens received in the window ÷ window length (tokens/s);
- TTFT: request sent → first token received, p50 / p99 (requests that got a token in the window;
  requests still running when the window closes are cut and aborted);
- ITL: per token — a chunk of k tokens arriving d seconds after the previous one counts as k
  gaps of d/k (speculation commits several tokens per step); p50 / p99. Ray Serve's proxy
  may deliver chunks that were ready together in one read, which shows as gaps near 0;
- TPOT: per request, (last token time − first token time) ÷ (tokens after the first), p50 / p99
  — the same quantity averaged per request, immune to that coalescing.

`--rounds R` runs R windows per mode at each concurrency, the modes alternating, and
reports each ratio as the geometric mean over the rounds (the rounds' ratios listed too):
on a shared host the same cell moves by 10-15 % between windows, more than the goals'
margins. Each cell also records the pipeline's counters over its window (`engine`:
forwards, those on borrowed cores, speculative steps, drafted / accepted, lookups).

Writes `bench/results/load-<UTC time>.json` and prints a table. `--quick` is a smoke run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT / "bench")]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

import httpx  # noqa: E402

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash map is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "def fibonacci(n):",
    "The quick brown fox",
    "Translate to French: good morning, my friend.",
    "What is the capital of Japan? Answer and explain.",
    "import numpy as np\n\ndef normalize(x):",
]

# `--workload chat-code-math`: the chat endpoint (the model's chat template) on the kinds of
# request the project's claim is about; answers run past `--max-tokens` with room to spare.
CHAT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function is_palindrome(s) that ignores case and spaces.",
    "Write a Python class Stack with push, pop and peek methods.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "What is 17 multiplied by 23? Explain step by step.",
    "Solve for x: 3x + 7 = 22. Show your work.",
    "A train travels 120 km in 2 hours. What is its average speed in km per hour?",
    "What is the sum of the integers from 1 to 50? Show your reasoning.",
]
WORKLOADS = ("completions", "chat-code-math")


def request_body(workload: str, k: int, max_tokens: int, speculation: dict,
                 sampling: dict | None = None) -> tuple[str, dict]:
    """(path, body) of the k-th request of a client: greedy, or unseeded sampling by `sampling`'s
    fields (`temperature`, `top_p`), `ignore_eos`, streamed."""
    body = {"model": "specflash", "max_tokens": max_tokens, "temperature": 0.0, **(sampling or {}),
            "ignore_eos": True, "stream": True, "return_token_ids": True, "speculation": speculation}
    if workload == "chat-code-math":
        text = CHAT_PROMPTS[k % len(CHAT_PROMPTS)]
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": PROMPTS[k % len(PROMPTS)]}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, url: str, path: str, body: dict,
                      window_end: float, rec: dict) -> None:
    start = time.perf_counter()
    first = last = None
    n = 0   # tokens after the first chunk
    try:
        async with client.stream("POST", f"{url}{path}", json=body) as r:
            if r.status_code != 200:
                rec["errors"] += 1
                await r.aread()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec["errors"] += 1
                    return
                k = sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
                if not k:
                    continue
                now = time.perf_counter()
                if now <= window_end:
                    rec["tokens"] += k
                if last is None:
                    rec["ttft"].append(now - start)
                    first = now
                else:
                    rec["itl"].extend([(now - last) / k] * k)
                    n += k
                last = now
        rec["requests"] += 1
    finally:  # a request cut at the end of the window still has its TPOT so far
        if n:
            rec["tpot"].append((last - first) / n)


async def run_cell(url: str, concurrency: int, mode: str, duration: float, max_tokens: int,
                   spec_len: int | None, workload: str = "completions",
                   transport: httpx.AsyncBaseTransport | None = None, sampling: dict | None = None) -> dict:
    rec = {"tokens": 0, "ttft": [], "itl": [], "tpot": [], "requests": 0, "errors": 0}
    speculation = {"mode": mode}
    if spec_len and mode in ("chain", "tree"):
        speculation["spec_len"] = spec_len
    t0 = time.perf_counter()
    window_end = t0 + duration

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        j = 0
        while time.perf_counter() < window_end:
            path, body = request_body(workload, i + j, max_tokens, speculation, sampling)
            j += 1
            try:
                await one_request(client, url, path, body, window_end, rec)
            except httpx.HTTPError:
                rec["errors"] += 1
                await asyncio.sleep(0.5)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, transport=transport) as client:
        tasks = [asyncio.ensure_future(client_loop(i, client)) for i in range(concurrency)]
        # Requests still running at the end of the window are cut (their streams closed, which
        # aborts them in the server): tokens after the window do not count anyway.
        await asyncio.wait(tasks, timeout=duration)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.perf_counter() - t0
    return {"concurrency": concurrency, "mode": mode, "window_s": duration, "elapsed_s": elapsed,
            "requests": rec["requests"], "errors": rec["errors"], "tokens": rec["tokens"],
            "throughput_tok_s": rec["tokens"] / duration,
            "ttft_p50_s": percentile(rec["ttft"], 50), "ttft_p99_s": percentile(rec["ttft"], 99),
            "itl_p50_s": percentile(rec["itl"], 50), "itl_p99_s": percentile(rec["itl"], 99),
            "tpot_p50_s": percentile(rec["tpot"], 50), "tpot_p99_s": percentile(rec["tpot"], 99)}


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "cluster.serve_cli", "--port", str(args.port),
           "--grpc-port", str(args.port + 1000), "--engine", args.engine]
    if args.target:
        cmd += ["--target", args.target] + (["--draft", args.draft] if args.draft else [])
    if args.config:
        cmd += ["--config", args.config]
    log_path = Path(tempfile.gettempdir()) / f"specflash-load-server-{args.port}.log"
    print(f"starting the server (log: {log_path})", flush=True)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    raise SystemExit("server did not become healthy in 900 s")


def print_table(cells: list[dict]) -> None:
    def ms(x):
        return "-" if x is None else f"{1000 * x:8.1f}"
    print(f"{'conc':>4} {'mode':>5} {'reqs':>5} {'err':>4} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9}"
          f" {'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>8} {'TPOT p99':>8}   (ms)")
    for c in cells:
        print(f"{c['concurrency']:>4} {c['mode']:>5} {c['requests']:>5} {c['errors']:>4} "
              f"{c['throughput_tok_s']:>8.1f} {ms(c['ttft_p50_s']):>9} {ms(c['ttft_p99_s']):>9} "
              f"{ms(c['itl_p50_s']):>8} {ms(c['itl_p99_s']):>8} {ms(c['tpot_p50_s']):>8} "
              f"{ms(c['tpot_p99_s']):>8}")


def summary(cells: list[dict], on: str) -> dict:
    """The issue's goals: ITL ratio at concurrency 1, throughput ratios at 16 and 64.

    With several rounds, each ratio is the geometric mean of the rounds' ratios (each round
    one window per mode, back to back), and `c<N>_<ratio>_rounds` lists them."""
    by = {(c["concurrency"], c["mode"], c.get("round", 0)): c for c in cells}
    out = {}
    for conc in sorted({c["concurrency"] for c in cells}):
        rounds = sorted({c.get("round", 0) for c in cells if c["concurrency"] == conc})
        for key, name in (("throughput_tok_s", "throughput"), ("itl_p50_s", "itl_p50"),
                          ("tpot_p50_s", "tpot_p50")):
            ratios = []
            for r in rounds:
                a, b = by.get((conc, on, r)), by.get((conc, "off", r))
                if a and b and a[key] and b[key]:
                    ratios.append(a[key] / b[key])
            if ratios:
                out[f"c{conc}_{name}_ratio"] = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                if len(rounds) > 1:
                    out[f"c{conc}_{name}_ratio_rounds"] = ratios
    return out


ENGINE_COUNTERS = ("num_batches", "borrowed_steps", "num_spec_steps", "num_drafted", "num_accepted",
                   "lookup_trees", "lookup_accepted", "verifier_busy_s", "num_committed",
                   "verifier_gc_s", "verifier_gc_full_collections", "verifier_wall_s", "verifier_idle_s",
                   "spec_on_decisions", "joins_speculating")


def engine_counters(url: str) -> dict:
    """The pipeline's counters from /metrics (specflash_engine_*), {} where there are none."""
    out = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = name.removeprefix("specflash_engine_").removesuffix("_total")   # counters end in _total
        if key != name and (key in ENGINE_COUNTERS or key.startswith("planner_")):
            out[key] = float(value)
    return out


def add_server_args(p: argparse.ArgumentParser) -> None:
    """--url, or --start and what the started server runs (`start_server` reads them)."""
    p.add_argument("--url", help="a running server (default: start one with --start)")
    p.add_argument("--start", action="store_true", help="start python -m cluster.serve_cli")
    common.add_model_pair(p, default="the server's own")
    p.add_argument("--engine", default="auto")
    p.add_argument("--config", help="ClusterConfig YAML for the started server (specflash serve --config)")
    p.add_argument("--port", type=common.positive_int, default=8321)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--concurrency", type=common.comma_list(common.positive_int), default="1,4,16,64")
    p.add_argument("--modes", type=common.comma_list(), default="off,auto",
                   help="speculation modes; 'off' is the baseline")
    p.add_argument("--spec-len", type=common.positive_int, default=None)
    p.add_argument("--duration", type=common.positive_float, default=30.0, help="seconds per cell")
    p.add_argument("--rounds", type=common.positive_int, default=1,
                   help="windows per mode and concurrency, the modes alternating (off, auto, auto, off, ...)")
    p.add_argument("--max-tokens", type=common.positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); above: unseeded sampling, the API's default at 1")
    p.add_argument("--top-p", type=common.positive_float, default=1.0, help="the nucleus (with --temperature)")
    p.add_argument("--workload", choices=WORKLOADS, default="completions",
                   help="completions: raw prompts on /v1/completions (a mix, continued past the "
                        "answer); chat-code-math: code and math questions on /v1/chat/completions")
    p.add_argument("--quick", action="store_true", help="concurrency 1,4, 8 s cells, 16 tokens")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.duration, args.max_tokens = [1, 4], 8.0, 16
    if not args.url and not args.start:
        p.error("give --url of a running server, or --start")
    if args.top_p > 1 or args.top_p < 1 and args.temperature <= 0:
        p.error("--top-p: in (0, 1], below 1 only with --temperature")
    common.model_pair(p, args, draft_optional=True, embedded=False)
    proc = None
    if args.start:
        proc, url = start_server(args)
    else:
        url = args.url.rstrip("/")
    try:
        health = httpx.get(f"{url}/health", timeout=30).json()
        cells = run_cells(url, args)
        stats = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    write_result(args, url, health, cells, stats)
    return 0


def sampling(args) -> dict:
    """The requests' sampling fields: the temperature, and the nucleus where it is below 1."""
    return {"temperature": args.temperature, **({"top_p": args.top_p} if args.top_p < 1 else {})}


def run_cells(url: str, args) -> list[dict]:
    """Every (concurrency, round, mode) window against the server at `url`, with the engine's
    counters over each window."""
    modes, cells, turn = args.modes, [], 0
    for conc in args.concurrency:
        for rnd in range(args.rounds):
            # alternate which mode goes first, so a drift in machine load favours neither
            for mode in (modes if turn % 2 == 0 else modes[::-1]):
                before = engine_counters(url)
                cell = asyncio.run(run_cell(url, conc, mode, args.duration, args.max_tokens,
                                            args.spec_len, args.workload, sampling=sampling(args)))
                after = engine_counters(url)
                cell["round"] = rnd
                cell["engine"] = {k: after[k] - before.get(k, 0.0) for k in after
                                  if not k.startswith("planner_")}
                # gauges: the planner's predicted step seconds at the window's end
                cell["planner"] = {k: v for k, v in after.items() if k.startswith("planner_")}
                cells.append(cell)
                print_table([cell])
            turn += 1
    return cells


def write_result(args, url: str, health: dict, cells: list[dict], stats: str) -> None:
    """The results file (load-<time>.json, or --out) and the closing tables."""
    modes = args.modes
    on = next((m for m in modes if m != "off"), "auto")
    result = {"bench": "load", "utc": common.utc(common.ISO),
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "processor": platform.processor()},
              "server": {"url": url, "health": health, "target": args.target, "draft": args.draft,
                         "engine": args.engine, "config": args.config,
                         "config_yaml": Path(args.config).read_text() if args.config else None},
              "settings": {"duration_s": args.duration, "max_tokens": args.max_tokens,
                           "modes": modes, "spec_len": args.spec_len, "rounds": args.rounds,
                           "workload": args.workload, "temperature": args.temperature, "top_p": args.top_p},
              "cells": cells, "summary": summary(cells, on),
              "engine_metrics": [l for l in stats.splitlines() if l.startswith("specflash_spec_")]}
    out = Path(args.out) if args.out else common.RESULTS / f"load-{common.utc(common.STAMP)}.json"
    short = sorted({c["concurrency"] for c in cells if c["requests"] < c["concurrency"]})
    if short:
        result["short_windows"] = short
    common.write_json(out, result, indent=2)
    print("\nall cells:")
    print_table(cells)
    if short:
        print(f"warning: at concurrency {short} fewer requests finished in a window than there are "
              f"clients: the window holds about one wave of requests, so the throughput there is "
              f"quantised by it; use a longer --duration for those levels")
    print(json.dumps(result["summary"], indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    sys.exit(main())
