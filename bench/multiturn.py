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
   arrives; the p99 ITL of the decoding streams while it is prefilled ("during": from its
   arrival to its first token) against their p99 ITL without that prompt (issue 25's goal:
   at most 1.5x), in the configurations `--prefill` picks: chunked prefill off, fixed
   `--chunk`-token chunks, and chunks of at most that many tokens sized so that each takes at
   most `--share` of a decoding step (`kv_cache.prefill_step_share`, verifier/chunking.py).
   "Without that prompt" is a control run: the same streams (prompts, seed) in a fresh engine
   where no prompt arrives, right after the run with the prompt (whose streams stop once it
   answers), decoding as far as the last gap compared. Its gaps are matched by token index,
   not time: if stream s's gaps k..m (gap k: from its token k to token k+1) fell "during", the
   control's are its stream s's gaps k..m, so both sides are steps at the same context lengths
   (`ratio_control`, the headline). `--repeats` such pairs per configuration, their gaps pooled
   for the p99s (each pair's ratio kept too): on this machine one run's p99 moves by 2x from
   one run to the next. The older reading, the p99 ITL in the `--settle-s` before the prompt
   arrived (once every stream decodes; `ratio`), stays beside it: its steps have shorter
   contexts than the ones "during".

Prints both tables; writes JSON and PNG plots under bench/results/ (`--out DIR`).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import random
import statistics
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


async def timed(engine, request, rec: dict | None = None) -> dict:
    """One request: its tokens, TTFT, the gaps between tokens (a chunk of k tokens d seconds
    after the previous one counts k gaps of d / k, as /metrics does), the arrival time of each
    token (`stamps`) and its cached tokens, filled into `rec` as they come: a caller that
    cancels the task keeps what came (the request is then aborted)."""
    rec = {} if rec is None else rec
    start = time.perf_counter()
    rec.update(tokens=[], gaps=[], stamps=[], cached=0, start=start, first=None, ttft_s=None)
    last = None
    async with contextlib.aclosing(engine.generate(request)) as chunks:
        async for chunk in chunks:
            if chunk.finish_reason == "error":
                raise RuntimeError(f"{request.request_id}: {chunk.error}")
            now = time.perf_counter()
            if chunk.token_ids:
                if rec["first"] is None:
                    rec["first"], rec["ttft_s"] = now, now - start
                elif last is not None:
                    rec["gaps"] += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
                rec["stamps"] += [now] * len(chunk.token_ids)
                last = now
            rec["tokens"] += chunk.token_ids
            rec["cached"] = chunk.cached_tokens
    return rec


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


def stream_prompts(tokenizer, args) -> tuple[list[list[int]], random.Random]:
    """The interference run's decoding streams' prompts, and the generator the long prompt
    is drawn from next: the same for the run with the prompt and for the control."""
    rng = random.Random(args.seed + 1)
    return [text_tokens(tokenizer, rng, 32) for _ in range(args.streams)], rng


def gap_numbers(stream: dict, start: float, end: float) -> range:
    """The numbers k of a `timed` stream's gaps (gap k: from its token k to token k+1) whose
    token k+1 arrived in [start, end); its stamps only grow, so they form a range."""
    stamps = stream["stamps"]
    skip = len(stamps) - len(stream["gaps"])    # tokens without a gap: the first chunk's (1 unless it held more)
    return range(bisect.bisect_left(stamps, start, skip) - 1, bisect.bisect_left(stamps, end, skip) - 1)


def gap_at(stream: dict, k: int) -> float | None:
    """A `timed` stream's gap k (from token k to token k+1), None where it has none."""
    m = k - (len(stream["stamps"]) - len(stream["gaps"]) - 1)    # gaps[0] is gap number skip - 1
    return stream["gaps"][m] if 0 <= m < len(stream["gaps"]) else None


def match_control(streams: list[dict], control: list[dict], start: float, end: float) -> dict:
    """Each stream's gaps whose token arrived in [start, end) of the run with the prompt
    ("during"), the same stream's gaps of the same numbers in the control run (by token
    index: the control's own times mean nothing here), the count of those the control lacks,
    and each stream's span of gap numbers ([first, last], None where empty)."""
    out = {"during": [], "control": [], "missing": 0, "spans": []}
    for stream, alone in zip(streams, control, strict=True):
        ks = gap_numbers(stream, start, end)
        out["spans"].append([ks.start, ks.stop - 1] if ks else None)
        for k in ks:
            out["during"].append(gap_at(stream, k))
            matched = gap_at(alone, k)
            if matched is None:
                out["missing"] += 1
            else:
                out["control"].append(matched)
    return out


async def control_streams(engine, tokenizer, args, max_tokens: int) -> list[dict]:
    """The interference run's decoding streams, `max_tokens` each, with no long prompt arriving
    (module doc, 2.): all decode to the same length, so the batch stays whole to the end."""
    prompts, _ = stream_prompts(tokenizer, args)
    return list(await asyncio.gather(*(timed(engine, request(f"d{i}", p, max_tokens, "off", 1))
                                       for i, p in enumerate(prompts))))


async def with_prompt(engine, tokenizer, args) -> tuple[list[dict], dict, float]:
    """`--streams` decoding streams and one long prompt arriving `--settle-s` after every stream
    decodes; the streams are stopped once it answers. Returns (the streams, the prompt's record,
    when the settled stretch began)."""
    prompts, rng = stream_prompts(tokenizer, args)
    streams = [{"stamps": []} for _ in prompts]
    decoding = [asyncio.create_task(timed(engine, request(f"d{i}", p, args.decode_tokens, "off", 1), streams[i]))
                for i, p in enumerate(prompts)]
    while not all(len(s["stamps"]) >= 2 for s in streams):       # every stream decoding, then a settled stretch
        await asyncio.sleep(0.01)
    settled = time.perf_counter()                   # "before" counts from here: not the streams' own start
    await asyncio.sleep(args.settle_s)
    long = await timed(engine, request("long", text_tokens(tokenizer, rng, args.long_prompt), 2, "off", 1))
    for task in decoding:                           # what comes after the prompt's answer is not compared
        task.cancel()
    await asyncio.gather(*decoding, return_exceptions=True)
    return streams, long, settled


def p99_figures(before: list[float], during: list[float], control: list[float]) -> dict:
    """The p99 ITLs of the three sets of gaps, "during" over "before" (`ratio`) and over the
    control (`ratio_control`), and how many gaps each held: one pair's, or pairs' pooled."""
    p99 = {k: percentile(g, 99) for k, g in (("before", before), ("during", during), ("control", control))}
    return {"p99_itl_before_s": p99["before"], "p99_itl_during_s": p99["during"],
            "p99_itl_control_s": p99["control"], "ratio": common.ratio(p99["during"], p99["before"]),
            "ratio_control": common.ratio(p99["during"], p99["control"]), "gaps_before": len(before),
            "gaps_during": len(during), "gaps_control": len(control)}


def compare(streams: list[dict], long: dict, settled: float, control: list[dict]) -> dict:
    """One pair's figures: "during" (the prompt's arrival to its first token) against the
    control at the same gap numbers, and against the settled stretch before it arrived."""
    arrived, answered = long["start"], long["first"]
    before = [gap_at(s, k) for s in streams for k in gap_numbers(s, settled, arrived)]
    matched = match_control(streams, control, arrived, answered)
    during, alone = matched["during"], matched["control"]
    return {"long_ttft_s": long["ttft_s"], **p99_figures(before, during, alone),
            "gaps_control_missing": matched["missing"],
            "during_gap_numbers": matched["spans"], "gaps": {"before": before, "during": during, "control": alone},
            "control_gaps": [s["gaps"] for s in control],    # per stream; control_gaps[s][i] is gap first + i
            "control_first_gap": [len(s["stamps"]) - len(s["gaps"]) - 1 for s in control]}


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
    if result["conversations"]:
        left.legend()
    names, xs = list(result["interference"]), range(len(result["interference"]))
    bars = {"p99_itl_before_s": "before the long prompt", "p99_itl_control_s": "control: no prompt, same token indices",
            "p99_itl_during_s": "while it is prefilled"}
    for i, (key, label) in enumerate(bars.items()):
        p99 = [(result["interference"][n][key] or 0) * 1e3 for n in names]
        right.bar([x + (i - 1) * 0.27 for x in xs], p99, 0.27, label=label)
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
    ms = [f"p99_itl_{k}_s" for k in ("before", "control", "during")]
    rows = [[name, *(common.cell(r[k] and r[k] * 1e3, ".1f") for k in ms), common.cell(r["ratio_control"], ".2f"),
             common.cell(r["ratio"], ".2f"), f"{r['gaps_during']}/{r['gaps_control']}",
             common.cell(r["long_ttft_s"] * 1e3, ".0f")] for name, r in result["interference"].items()]
    return out + "\n\n" + common.markdown_table(
        ["prefill", "p99 ITL before ms", "p99 ITL control ms", "p99 ITL during ms", "during/control",
         "during/before", "gaps during/control", "long prompt TTFT ms"], rows)


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
    if "interference" in args.parts:
        result["interference"] = await interference_runs(target, draft, args)
    return result


async def interference_pair(target: str, draft: str | None, args, chunk: int, share: float) -> dict:
    """The run with the prompt in a fresh engine of the configuration, then its control in a
    fresh engine with chunking off (with no prompt arriving, chunking has nothing to cut but the
    streams' own 32-token prompts, prefilled before the first gap compared), the streams decoding
    as far as the last gap compared; back to back, so both see the machine of the same minutes."""
    engine, tokenizer = engine_for(target, draft, False, chunk, args, share)
    try:
        streams, long, settled = await with_prompt(engine, tokenizer, args)
        prefill = {k: v for k, v in (await engine.stats()).items() if k.startswith("prefill_")}
    finally:
        engine.shutdown()
    spans = [gap_numbers(s, long["start"], long["first"]) for s in streams]
    needed = max((ks.stop + 1 for ks in spans if ks), default=2)      # tokens up to the last gap compared
    engine, tokenizer = engine_for(target, draft, False, 0, args)
    try:
        control = await control_streams(engine, tokenizer, args, needed)
    finally:
        engine.shutdown()
    return {**compare(streams, long, settled, control), "engine": prefill}


async def interference_runs(target: str, draft: str | None, args) -> dict:
    """Each `--prefill` configuration, `--repeats` pairs of a run with the prompt and its control
    (module doc, 2.): the p99s over every pair's gaps pooled, and each pair's own figures."""
    runs = {"one shot": (0, 0.0), f"chunks of {args.chunk}": (args.chunk, 0.0),
            f"budget {args.share:g} of a step": (args.chunk, args.share)}
    runs = {name: run for name, run, key in zip(runs, runs.values(), PREFILL_RUNS) if key in args.prefill}
    out = {}
    for name, (chunk, share) in runs.items():
        pairs = [await interference_pair(target, draft, args, chunk, share) for _ in range(args.repeats)]
        pooled = [[g for p in pairs for g in p["gaps"][k]] for k in ("before", "during", "control")]
        out[name] = {**p99_figures(*pooled),
                     "ratio_control_per_pair": [p["ratio_control"] for p in pairs],
                     "long_ttft_s": statistics.median(p["long_ttft_s"] for p in pairs),
                     "gaps_control_missing": sum(p["gaps_control_missing"] for p in pairs),
                     "engine": pairs[-1]["engine"], "pairs": pairs}
    return out


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
                        help="at most this many tokens a decoding stream (it must outlast the long prompt)")
    parser.add_argument("--settle-s", type=common.positive_float, default=3.0,
                        help="seconds the streams decode before the long prompt arrives")
    parser.add_argument("--chunk", type=common.positive_int, default=128)
    parser.add_argument("--repeats", type=common.positive_int, default=1,
                        help="pairs (a run with the long prompt, then its control) per configuration")
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
