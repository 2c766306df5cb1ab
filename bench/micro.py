"""Engine overhead on a micro pair: what a step costs besides its forwards (issue 23, item 4).

    python bench/micro.py                              # off, sync and the pipeline, 3 rounds of 6 requests
    python bench/micro.py --requests 12 --rounds 5 --max-tokens 96 --spec-len 4 --out micro.json

On the embedded pair a step's forwards take 40-80 ms on this CPU and hide whatever the engine
spends around them. Here the target is `random:tiny` (2 layers, 64 wide, models/presets.py)
and the draft the same weights, so every draft token is accepted and each forward costs ~1 ms:
the time left over is the engine's. Greedy requests one after another (batch 1), in three
modes: `off` (the target alone in process), `sync` (the in-process engine, a chain of K) and
`pipeline` (drafter and verifier actors on a local Ray, mode chain K; a lone stream beside its
drafter runs in lockstep, its turns drafted in the verifier's process by default:
`--remote-turns` keeps them on the drafter actor). Per mode: tokens/s,
steps/s, and per step the target's forward, the draft's passes and the rest (wall time minus
both: scheduling, the exchange between drafter and verifier, Python), which the issue asks to
be at most 1 ms above sync's for the pipeline. `--no-pipeline` skips Ray. The machine's speed
drifts by a third within minutes here, so the modes run in turn for `--rounds` rounds on the
same engines, and the pipeline's overhead is its step minus sync's within each round, the
median over rounds reported. `--plain-threads 1` keeps the verifier's lockstep turns on one
thread instead of lending it the idle drafter's core.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

TARGET = DRAFT = "random:tiny:0"      # one set of weights for both: every draft token accepted


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def request(rid: str, prompt: list[int], mode: str, args):
    from models.sampling import SamplingParams
    from speculation.requests import GenerationRequest, SpeculationOptions

    spec = SpeculationOptions(mode=mode, spec_len=None if mode == "off" else args.spec_len)
    return GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                         ignore_eos=True), spec)


def in_process(args):
    """`off` and `sync` on the in-process engine, as a function of the prompts: each mode's row
    (wall, steps and forward seconds over its requests)."""
    from cluster.local import InProcessEngine
    from models.presets import load

    from speculation.settings import EngineSettings

    target, draft = load(TARGET), load(DRAFT)

    def engine_on(threads: int) -> InProcessEngine:
        return InProcessEngine(target, draft, settings=EngineSettings(
            spec_len=args.spec_len, lookup=False, num_cpus=threads, stream_interval=args.stream_interval))

    # `off` on --threads; sync once per --sync-threads count (a row each when more than one)
    modes = [("off", "off", engine_on(args.threads))] + [
        ("sync" if len(args.sync_threads) == 1 else f"sync-{n}t", "chain", engine_on(n)) for n in args.sync_threads]
    for _, spec_mode, engine in modes:
        engine.generate([request("warm", [1, 2, 3], spec_mode, args)])

    def run(ps: list[list[int]], tag: str) -> list[dict]:
        rows = []
        for mode, spec_mode, engine in modes:
            wall = steps = tokens = verify = draft = 0.0
            for i, p in enumerate(ps):
                start = time.perf_counter()
                out = engine.generate([request(f"{mode}{tag}-{i}", p, spec_mode, args)])[0]
                wall += time.perf_counter() - start
                st = out.stats
                steps, tokens, verify, draft = steps + st.num_steps, tokens + len(out.token_ids), \
                    verify + st.verify_s, draft + st.draft_s
            rows.append(row(mode, wall, steps, tokens, verify, draft))
        return rows

    return run


@contextlib.contextmanager
def pipeline(args):
    """The pipeline on a local Ray (two actors, one CPU each), as a function of the prompts (run
    one at a time): its row, in a list as `in_process`'s."""
    import ray

    from cluster.pipeline import build_pipeline_engine

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    engine = None
    try:
        engine = build_pipeline_engine(None, target_dir=TARGET, draft_dir=DRAFT, spec_len=args.spec_len,
                                       lookup=False, num_blocks=256, lockstep_in_verifier=not args.remote_turns,
                                       plain_threads=args.plain_threads, stream_interval=args.stream_interval,
                                       output_socket=not args.ray_streams, exchange=args.exchange)
        drafter = engine.pipelines[0].drafters[0]

        async def one(rid, p) -> int:
            n = 0
            async for chunk in engine.generate(request(rid, p, "chain", args)):
                n += len(chunk.token_ids)
            return n

        def run(ps: list[list[int]], tag: str) -> list[dict]:
            before, d_before = asyncio.run(engine.stats()), ray.get(drafter.info.remote())
            async def each() -> int:      # one event loop for the round, as a server has
                return sum([await one(f"p{tag}-{i}", p) for i, p in enumerate(ps)])

            start = time.perf_counter()
            tokens = asyncio.run(each())
            wall = time.perf_counter() - start
            after, d_after = asyncio.run(engine.stats()), ray.get(drafter.info.remote())
            d = {k: after[k] - before[k] for k in ("num_steps", "verifier_busy_s")}
            drafting = sum(x["draft_s"] for x in [d_after] + after["local_drafters"]) - \
                sum(x["draft_s"] for x in [d_before] + before["local_drafters"])    # the actor's, and the stand-in's
            return [row("pipeline", wall, d["num_steps"], tokens, d["verifier_busy_s"], drafting)]

        asyncio.run(one("warm", [1, 2, 3]))
        yield run
    finally:
        if engine is not None:
            engine.kill_pipeline_actors()
        ray.shutdown()


def summary(rounds: list[list[dict]]) -> dict:
    """Each mode's median row over the rounds, and the pipeline's step minus the fastest sync
    row's, per round and its median (ms): the overhead the issue bounds, paired within a round."""
    modes = [r["mode"] for r in rounds[0]]
    medians = []
    for mode in modes:
        rows = [r for rnd in rounds for r in rnd if r["mode"] == mode]
        medians.append({"mode": mode, **{k: statistics.median(r[k] for r in rows)
                                         for k in rows[0] if k not in ("mode", "steps")},
                        "steps": sum(r["steps"] for r in rows)})
    overhead = []
    for rnd in rounds:
        by = {r["mode"]: r for r in rnd}
        fastest_sync = max(r["steps_per_s"] for r in rnd if r["mode"].startswith("sync"))
        if "pipeline" in by:
            overhead.append(1e3 / by["pipeline"]["steps_per_s"] - 1e3 / fastest_sync)
    return {"medians": medians, "overhead_ms_per_round": overhead,
            "overhead_ms": statistics.median(overhead) if overhead else None}


def row(mode: str, wall: float, steps: float, tokens: float, verify_s: float, draft_s: float) -> dict:
    steps = max(steps, 1)
    return {"mode": mode, "tokens_per_s": tokens / wall, "steps_per_s": steps / wall, "steps": int(steps),
            "tokens_per_step": tokens / steps, "forward_ms_per_step": 1e3 * verify_s / steps,
            "draft_ms_per_step": 1e3 * draft_s / steps,
            "other_ms_per_step": 1e3 * (wall - verify_s - draft_s) / steps}


def table(rows: list[dict]) -> str:
    return common.markdown_table(
        ["mode", "tokens/s", "steps/s", "tokens/step", "target forward ms/step", "draft ms/step",
         "other ms/step"],
        [[r["mode"], f"{r['tokens_per_s']:.0f}", f"{r['steps_per_s']:.0f}", f"{r['tokens_per_step']:.2f}",
          f"{r['forward_ms_per_step']:.2f}", f"{r['draft_ms_per_step']:.2f}", f"{r['other_ms_per_step']:.2f}"]
         for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=common.positive_int, default=6, help="greedy requests per mode and round")
    p.add_argument("--rounds", type=common.positive_int, default=3,
                   help="rounds of every mode in turn (the machine's speed drifts: modes are compared within a round)")
    p.add_argument("--max-tokens", type=common.positive_int, default=64)
    p.add_argument("--prompt-len", type=common.positive_int, default=16)
    p.add_argument("--spec-len", type=common.positive_int, default=4)
    p.add_argument("--threads", type=common.positive_int, default=2, help="torch threads of the in-process `off`")
    p.add_argument("--sync-threads", type=common.comma_list(common.positive_int), default=[2],
                   help="torch threads of the in-process sync engine, a row each (e.g. 1,2); the pipeline's "
                        "overhead is taken against the fastest")
    p.add_argument("--stream-interval", type=common.positive_int, default=1,
                   help="the engines' `stream_interval`: tokens a streamed chunk carries at least")
    p.add_argument("--no-pipeline", action="store_true", help="skip the Ray pipeline")
    p.add_argument("--remote-turns", action="store_true",
                   help="the drafter actor drafts a lone stream's turns (lockstep_in_verifier off)")
    p.add_argument("--plain-threads", type=int, default=-1, choices=(-1, 0, 1, 2),
                   help="the pipeline's `plain_threads` setting: -1 (the default) lends the idle drafter's core "
                        "to the verifier's lockstep turns, 1 keeps them on one thread")
    p.add_argument("--ray-streams", action="store_true",
                   help="the pipeline's chunks through Ray streams instead of its output socket (output_socket off)")
    p.add_argument("--exchange", choices=("socket", "actor"), default="socket",
                   help="the pipeline's `exchange` setting: the drafter's exchanges over a socket or by actor call "
                        "(on a lockstep step's path with --remote-turns)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    import torch

    from models.presets import random_config

    torch.set_num_threads(args.threads)
    ps = prompts(args.requests, args.prompt_len, random_config(TARGET).vocab_size)
    rounds = []
    with contextlib.ExitStack() as stack:
        runs = [in_process(args)] + ([] if args.no_pipeline else [stack.enter_context(pipeline(args))])
        for k in range(args.rounds):
            rows = [r for run in runs for r in run(ps, str(k))]
            rounds.append(rows)
            print(f"round {k + 1}:\n{table(rows)}", flush=True)
    result = summary(rounds)
    print(f"medians of {args.rounds} rounds:\n{table(result['medians'])}")
    if result["overhead_ms"] is not None:
        print("pipeline step minus sync step, per round: " +
              ", ".join(f"{x:+.2f}" for x in result["overhead_ms_per_round"]) +
              f" ms; median {result['overhead_ms']:+.2f} ms")
    if args.out:
        common.write_json(args.out, {"date": common.utc(), "machine": common.machine(), "args": vars(args) | {
            "out": str(args.out)}, "rounds": rounds, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
