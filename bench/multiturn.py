"""Multi-turn conversations with prefix caching on and off, and a long prompt among decoding streams
with chunked prefill on and off (issue 25).

    python bench/multiturn.py                                   # the embedded pair, the issue's sizes
    python bench/multiturn.py --turns 2 --conversations 1 --max-tokens 4 --long-prompt 64 \\
        --streams 2 --chunk 16 --target DIR --draft DIR         # a smoke run

Drives the in-process engine behind the Engine protocol (`cluster.local.LocalEngine`, what
`specflash serve --engine local` serves over HTTP), a fresh engine per configuration so no
cache carries over:

1. Conversations: a shared system prompt (`--system-tokens`), then `--turns` turns of a user
   message (`--turn-tokens`) and a greedy answer (`--max-tokens`), each turn's prompt the
   whole history so far (growing to ~1-2K tokens at the defaults), `--conversations` of them
   interleaved turn by turn; speculation off and chained (`--spec-len`) x the prefix cache
   off and on. Per turn: time to first token (TTFT), inter-token latency (ITL), the prompt
   tokens found cached; per configuration: the target's and the draft's hit rates.
2. Interference: `--streams` greedy streams decoding, then one `--long-prompt`-token prompt
   arrives; the p99 ITL of the decoding streams while it is prefilled (from its arrival to
   its first token) against their p99 ITL in the `--settle-s` before it arrived (once every
   stream decodes; `--prefill` picks the configurations): chunked prefill off, fixed
   `--chunk`-token chunks, and chunks of at most that many tokens sized so that each takes at
   most `--share` of a decoding step (`kv_cache.prefill_step_share`, verifier/chunking.py).

Prints both tables; writes JSON and PNG plots under bench/results/ (`--out DIR`).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)
from bench.load import percentile  # noqa: E402

PREFILL_RUNS = ("one-shot", "chunks", "budget")   # the interference run's configurations (--prefill)
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under bright lamps in old towns near rivers of code and data").split()


def text_tokens(tokenizer, rng: random.Random, n: int) -> list[int]:
    """About `n` tokens of word salad (no BOS), cut to exactly n."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(16)), add_special_tokens=False)
    return ids[:n]


def engine_for(target: str, draft: str | None, caching: bool, chunk: int, args, share: float = 0.0):
    """`share`: `prefill_step_share`, the chunk's time budget (0: every chunk `chunk` tokens)."""
    from cluster.local import build_local_engine
    from speculation.settings import EngineSettings

    settings = EngineSettings(num_blocks=args.num_blocks, block_size=args.block_size, prefix_caching=caching,
                              prefill_chunk=chunk, prefill_step_share=share, max_batch_size=max(16, args.streams + 1))
    return build_local_engine(target, draft, settings)


async def timed(engine, request, stamps: list | None = None) -> dict:
    """One request: its tokens, TTFT, the gaps between tokens (a chunk of k tokens d seconds
    after the previous one counts k gaps of d / k, as /metrics does) and its cached tokens.
    `stamps`: a list the arrival time of each token is appended to as it comes."""
    start = time.perf_counter()
    first, last, tokens, gaps, cached = None, None, [], [], 0
    stamps = [] if stamps is None else stamps
    async for chunk in engine.generate(request):
        if chunk.finish_reason == "error":
            raise RuntimeError(f"{request.request_id}: {chunk.error}")
        now = time.perf_counter()
        if chunk.token_ids:
            if first is None:
                first = now
            elif last is not None:
                gaps += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
            stamps += [now] * len(chunk.token_ids)
            last = now
        tokens += chunk.token_ids
        cached = chunk.cached_tokens
    return {"tokens": tokens, "ttft_s": None if first is None else first - start, "gaps": gaps,
            "cached": cached, "stamps": stamps, "start": start, "first": first}


def request(rid: str, prompt: list[int], max_tokens: int, spec: str, spec_len: int):
    from cluster.local import speculation_for
    from models.sampling import SamplingParams
    from speculation.requests import GenerationRequest

    return GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                             speculation_for("off" if spec == "off" else "sync", spec_len, 1))


async def conversations(engine, tokenizer, spec: str, args) -> list[dict]:
    """Every turn of every conversation, turn by turn (module doc, 1.)."""
    rng = random.Random(args.seed)
    system = text_tokens(tokenizer, rng, args.system_tokens)
    histories = [list(system) for _ in range(args.conversations)]
    users = [[text_tokens(tokenizer, rng, args.turn_tokens) for _ in range(args.turns)]
             for _ in range(args.conversations)]
    turns = []
    for t in range(args.turns):
        for c in range(args.conversations):
            prompt = histories[c] + users[c][t]
            rec = await timed(engine, request(f"{spec}-c{c}-t{t}", prompt, args.max_tokens, spec, args.spec_len))
            histories[c] = prompt + rec["tokens"]
            turns.append({"conversation": c, "turn": t, "prompt_tokens": len(prompt), "cached_tokens": rec["cached"],
                          "ttft_s": rec["ttft_s"], "itl_s": rec["gaps"], "tokens": rec["tokens"]})
    return turns


async def interference(engine, tokenizer, args) -> dict:
    """`--streams` decoding streams and one long prompt arriving among them (module doc, 2.)."""
    rng = random.Random(args.seed + 1)
    prompts = [text_tokens(tokenizer, rng, 32) for _ in range(args.streams)]
    live = [[] for _ in prompts]
    decoding = [asyncio.create_task(timed(engine, request(f"d{i}", p, args.decode_tokens, "off", 1), live[i]))
                for i, p in enumerate(prompts)]
    while not all(len(s) >= 2 for s in live):       # every stream decoding, then a settled stretch
        await asyncio.sleep(0.01)
    settled = time.perf_counter()                   # "before" counts from here: not the streams' own start
    await asyncio.sleep(args.settle_s)
    long = await timed(engine, request("long", text_tokens(tokenizer, rng, args.long_prompt), 2, "off", 1))
    streams = await asyncio.gather(*decoding)
    arrived, answered = long["start"], long["first"]
    before, during = [], []
    for s in streams:        # each gap is filed under the time its token arrived
        for stamp, gap in zip(s["stamps"][1:], s["gaps"]):
            if settled <= stamp < arrived:
                before.append(gap)
            elif stamp <= answered:
                during.append(gap)
    p99_before, p99_during = percentile(before, 99), percentile(during, 99)
    return {"long_ttft_s": long["ttft_s"], "p99_itl_before_s": p99_before, "p99_itl_during_s": p99_during,
            "ratio": None if not (p99_before and p99_during) else p99_during / p99_before,
            "gaps_before": len(before), "gaps_during": len(during)}


def summarize(turns: list[dict]) -> dict:
    later = [t for t in turns if t["turn"] > 0]
    return {"ttft_first_turn_s": percentile([t["ttft_s"] for t in turns if t["turn"] == 0], 50),
            "ttft_later_turns_s": percentile([t["ttft_s"] for t in later], 50),
            "ttft_last_turn_s": percentile([t["ttft_s"] for t in turns if t["turn"] == turns[-1]["turn"]], 50),
            "itl_p50_s": percentile([g for t in turns for g in t["itl_s"]], 50),
            "itl_p99_s": percentile([g for t in turns for g in t["itl_s"]], 99),
            "cached_share": sum(t["cached_tokens"] for t in turns) / max(1, sum(t["prompt_tokens"] for t in turns))}


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in result["conversations"].items():
        turns = sorted({t["turn"] for t in run["turns"]})
        ttft = [percentile([t["ttft_s"] for t in run["turns"] if t["turn"] == k], 50) for k in turns]
        left.plot(turns, [x * 1e3 for x in ttft], marker="o", label=name)
    left.set(xlabel="turn", ylabel="TTFT, ms (median over conversations)", title="Time to first token per turn")
    left.legend()
    names = list(result["interference"])
    before = [result["interference"][n]["p99_itl_before_s"] or 0 for n in names]
    during = [result["interference"][n]["p99_itl_during_s"] or 0 for n in names]
    xs = range(len(names))
    right.bar([x - 0.2 for x in xs], [b * 1e3 for b in before], 0.4, label="before the long prompt")
    right.bar([x + 0.2 for x in xs], [d * 1e3 for d in during], 0.4, label="while it is prefilled")
    right.set_xticks(list(xs), names)
    right.set(ylabel="p99 ITL of decoding streams, ms", title="A long prompt among decoding streams")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tables(result: dict) -> str:
    rows = []
    for name, run in result["conversations"].items():
        s = run["summary"]
        rows.append([name, common.cell(s["ttft_first_turn_s"] * 1e3, ".0f"), common.cell(s["ttft_later_turns_s"] * 1e3, ".0f"),
                     common.cell(s["ttft_last_turn_s"] * 1e3, ".0f"), common.cell(s["itl_p50_s"] and s["itl_p50_s"] * 1e3, ".1f"),
                     common.cell(s["itl_p99_s"] and s["itl_p99_s"] * 1e3, ".1f"), common.cell(run["target_hit_rate"], ".1%"),
                     common.cell(run["draft_hit_rate"], ".1%")])
    out = common.markdown_table(["config", "TTFT turn 1 ms", "TTFT later ms", "TTFT last ms", "ITL p50 ms",
                                 "ITL p99 ms", "target hit", "draft hit"], rows)
    rows = [[name, common.cell(r["p99_itl_before_s"] and r["p99_itl_before_s"] * 1e3, ".1f"),
             common.cell(r["p99_itl_during_s"] and r["p99_itl_during_s"] * 1e3, ".1f"), common.cell(r["ratio"], ".2f"),
             common.cell(r["long_ttft_s"] * 1e3, ".0f")] for name, r in result["interference"].items()]
    return out + "\n\n" + common.markdown_table(["prefill", "p99 ITL before ms", "p99 ITL during ms", "ratio",
                                                 "long prompt TTFT ms"], rows)


async def run_all(target: str, draft: str | None, args) -> dict:
    result: dict = {"conversations": {}, "interference": {}}
    for spec in args.spec if "conversations" in args.parts else ():
        for caching in args.cache:
            engine, tokenizer = engine_for(target, draft, caching == "on", 0, args)
            try:
                turns = await conversations(engine, tokenizer, spec, args)
                stats = await engine.stats()
            finally:
                engine.shutdown()
            result["conversations"][f"spec {spec}, cache {caching}"] = {
                "turns": turns, "summary": summarize(turns),
                "target_hit_rate": stats.get("prefix_hit_rate") if caching == "on" else 0.0,
                "draft_hit_rate": stats.get("draft_prefix_hit_rate") if caching == "on" and spec != "off" else None}
    runs = {"one shot": (0, 0.0), f"chunks of {args.chunk}": (args.chunk, 0.0),
            f"budget {args.share:g} of a step": (args.chunk, args.share)}
    runs = {name: run for name, run, key in zip(runs, runs.values(), PREFILL_RUNS) if key in args.prefill}
    for name, (chunk, share) in runs.items() if "interference" in args.parts else ():
        engine, tokenizer = engine_for(target, draft, False, chunk, args, share)
        try:
            result["interference"][name] = await interference(engine, tokenizer, args)
            result["interference"][name]["engine"] = {k: v for k, v in (await engine.stats()).items()
                                                      if k.startswith("prefill_")}
        finally:
            engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(parser)
    parser.add_argument("--conversations", type=common.positive_int, default=2)
    parser.add_argument("--turns", type=common.positive_int, default=8)
    parser.add_argument("--system-tokens", type=common.positive_int, default=300)
    parser.add_argument("--turn-tokens", type=common.positive_int, default=80)
    parser.add_argument("--max-tokens", type=common.positive_int, default=48)
    parser.add_argument("--spec", type=common.comma_list(), default=["off", "chain"], help="off,chain")
    parser.add_argument("--spec-len", type=common.positive_int, default=3)
    parser.add_argument("--cache", type=common.comma_list(), default=["off", "on"], help="off,on")
    parser.add_argument("--long-prompt", type=common.positive_int, default=2048)
    parser.add_argument("--streams", type=common.positive_int, default=8)
    parser.add_argument("--decode-tokens", type=common.positive_int, default=400,
                        help="tokens each decoding stream generates (it must outlast the long prompt)")
    parser.add_argument("--settle-s", type=common.positive_float, default=3.0,
                        help="seconds the streams decode before the long prompt arrives")
    parser.add_argument("--chunk", type=common.positive_int, default=128)
    parser.add_argument("--share", type=common.positive_float, default=0.5,
                        help="prefill_step_share of the budgeted interference run")
    parser.add_argument("--block-size", type=common.positive_int, default=16)
    parser.add_argument("--num-blocks", type=common.positive_int, default=4096)
    parser.add_argument("--prefill", type=common.comma_list(), default=list(PREFILL_RUNS),
                        help="one-shot,chunks,budget: the interference run's configurations")
    parser.add_argument("--parts", type=common.comma_list(), default=["conversations", "interference"],
                        help="conversations,interference: the runs to make (module doc, 1. and 2.)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args(argv)
    if set(args.spec) - {"off", "chain"} or set(args.cache) - {"off", "on"}:
        parser.error("--spec takes off,chain and --cache off,on")
    if not args.parts or set(args.parts) - {"conversations", "interference"}:
        parser.error("--parts takes conversations,interference")
    if not args.prefill or set(args.prefill) - set(PREFILL_RUNS):
        parser.error("--prefill takes one-shot,chunks,budget")
    target, draft = common.model_pair(parser, args)
    result = asyncio.run(run_all(target, draft, args))
    result.update(date=common.utc(), machine=common.machine(), args={k: str(v) for k, v in vars(args).items()})
    stamp = common.utc(common.STAMP)
    path = common.write_json(args.out / f"multiturn-{stamp}.json", result)
    png = plot(result, args.out / f"multiturn-{stamp}.png")
    print(tables(result))
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
