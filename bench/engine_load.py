"""Many concurrent requests through the pipeline engine in process, mode `off` against `auto`.

    python bench/engine_load.py                                   # the embedded pair, 16 clients
    python bench/engine_load.py --concurrency 16 --seconds 25 --rounds 2
    python bench/engine_load.py --target DIR --draft DIR --concurrency 4 --seconds 5

bench/load.py measures the same through `specflash serve` (Ray Serve, HTTP); this one
drives `cluster.pipeline.PipelineEngine` directly on a local Ray, so a difference between
the modes at high load can be told apart from the serving layer's. N clients send greedy
requests back to back (the chat-code-math questions of bench/load.py, `--max-tokens`
each) for `--seconds`, the modes alternating per round. Per window: tokens streamed per
second, the verifier's forwards (those on an idle drafter's cores, those that
speculated), its busy time per forward, and what the drafter did (trees drafted, seconds
drafting, exchange calls). Prints one line a window; `--out` writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

VERIFIER_COUNTERS = ("num_batches", "borrowed_steps", "num_spec_steps", "verifier_busy_s", "verifier_wall_s")
DRAFTER_COUNTERS = ("trees_drafted", "draft_s", "exchanges", "rollbacks")


def chat_prompts(tokenizer) -> list[list[int]]:
    """bench/load.py's chat-code-math questions in the model's chat template (bench/e2e.py's)."""
    from bench import e2e, load

    return [e2e.prompt_ids(tokenizer, text) for text in load.CHAT_PROMPTS]


async def _client(engine, i: int, mode: str, prompts, max_tokens: int, stop: float, counted: list[int]) -> None:
    from speculation.requests import GenerationRequest, SpeculationOptions
    from models.sampling import SamplingParams

    n = 0
    while time.monotonic() < stop:
        request = GenerationRequest(f"{mode}-{i}-{n}-{time.monotonic_ns()}", prompts[(i + n) % len(prompts)],
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                    SpeculationOptions(mode=mode))
        n += 1
        async for chunk in engine.generate(request):
            if chunk.finish_reason == "error":
                raise RuntimeError(f"request {request.request_id} failed: {chunk.error}")
            if time.monotonic() < stop:
                counted[0] += len(chunk.token_ids)


async def window(engine, mode: str, prompts, concurrency: int, seconds: float, max_tokens: int) -> dict:
    """One window of `concurrency` clients in `mode`: counters over it (module doc)."""
    import ray

    drafters = engine.pipelines[0].drafters
    before, d_before = await engine.stats(), ray.get([d.info.remote() for d in drafters])
    counted = [0]
    stop = time.monotonic() + seconds
    await asyncio.gather(*[_client(engine, i, mode, prompts, max_tokens, stop, counted)
                           for i in range(concurrency)])
    after, d_after = await engine.stats(), ray.get([d.info.remote() for d in drafters])
    row = {"mode": mode, "concurrency": concurrency, "tokens_per_s": counted[0] / seconds,
           **{k: after.get(k, 0) - before.get(k, 0) for k in VERIFIER_COUNTERS},
           **{f"drafter_{k}": sum(a.get(k, 0) - b.get(k, 0) for a, b in zip(d_after, d_before))
              for k in DRAFTER_COUNTERS}}
    row["busy_ms_per_forward"] = 1e3 * row["verifier_busy_s"] / max(1, row["num_batches"])
    return row


def line(row: dict) -> str:
    return (f"{row['mode']:>4} x{row['concurrency']}: {row['tokens_per_s']:.1f} tokens/s, "
            f"{row['num_batches']} forwards ({row['borrowed_steps']} on borrowed cores, "
            f"{row['num_spec_steps']} speculating), {row['busy_ms_per_forward']:.1f} ms busy a forward; "
            f"drafter: {row['drafter_trees_drafted']} trees, {row['drafter_draft_s']:.2f} s drafting, "
            f"{row['drafter_exchanges']} exchanges")


async def run(engine, prompts, args) -> list[dict]:
    rows = []
    await window(engine, "off", prompts, args.concurrency, min(args.seconds, 5.0), args.max_tokens)   # warm-up
    for r in range(args.rounds):
        for mode in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
            row = {"round": r, **await window(engine, mode, prompts, args.concurrency, args.seconds,
                                              args.max_tokens)}
            print(line(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--concurrency", type=common.positive_int, default=16)
    p.add_argument("--seconds", type=common.positive_float, default=25.0, help="each window")
    p.add_argument("--rounds", type=common.positive_int, default=2, help="windows per mode, the modes alternating")
    p.add_argument("--max-tokens", type=common.positive_int, default=64)
    p.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    args = p.parse_args(argv)
    target, draft = common.model_pair(p, args)
    import ray

    from cluster.pipeline import build_pipeline_engine
    from models import load_tokenizer

    prompts = chat_prompts(load_tokenizer(target))
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    engine = build_pipeline_engine(None, target_dir=target, draft_dir=draft)
    try:
        rows = asyncio.run(run(engine, prompts, args))
    finally:
        engine.kill_pipeline_actors()
        if own_ray:
            ray.shutdown()
    if args.out:
        common.write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                     "date": common.utc(), "machine": common.machine()})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
