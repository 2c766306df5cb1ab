"""Engine overhead on a micro pair: what a step costs besides its forwards (issue 23, item 4).

    python bench/micro.py                              # off, sync and the pipeline, 6 requests each
    python bench/micro.py --requests 12 --max-tokens 96 --spec-len 4 --out micro.json

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
be at most 1 ms above sync's for the pipeline. `--no-pipeline` skips Ray.
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


def in_process(args, ps: list[list[int]]) -> dict[str, dict]:
    """`off` and `sync` on the in-process engine: wall, steps and forward seconds per request."""
    from cluster.local import InProcessEngine
    from models.presets import load

    engine = InProcessEngine(load(TARGET), load(DRAFT), spec_len=args.spec_len, lookup=False)
    rows = {}
    for mode, spec_mode in (("off", "off"), ("sync", "chain")):
        engine.generate([request("warm", ps[0], spec_mode, args)])
        wall = steps = tokens = verify = draft = 0.0
        for i, p in enumerate(ps):
            start = time.perf_counter()
            out = engine.generate([request(f"{mode}{i}", p, spec_mode, args)])[0]
            wall += time.perf_counter() - start
            st = out.stats
            steps, tokens, verify, draft = steps + st.num_steps, tokens + len(out.token_ids), \
                verify + st.verify_s, draft + st.draft_s
        rows[mode] = row(mode, wall, steps, tokens, verify, draft)
    return rows


def pipeline(args, ps: list[list[int]]) -> dict:
    """The pipeline on a local Ray (two actors, one CPU each): the same requests, one at a time."""
    import ray

    from cluster.pipeline import build_pipeline_engine

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    engine = None
    try:
        engine = build_pipeline_engine(None, target_dir=TARGET, draft_dir=DRAFT, spec_len=args.spec_len,
                                       lookup=False, num_blocks=256, lockstep_in_verifier=not args.remote_turns)
        drafter = engine.pipelines[0].drafters[0]

        async def run(rid, p) -> int:
            n = 0
            async for chunk in engine.generate(request(rid, p, "chain", args)):
                n += len(chunk.token_ids)
            return n

        asyncio.run(run("warm", ps[0]))
        before, d_before = asyncio.run(engine.stats()), ray.get(drafter.info.remote())
        start = time.perf_counter()
        tokens = sum(asyncio.run(run(f"p{i}", p)) for i, p in enumerate(ps))
        wall = time.perf_counter() - start
        after, d_after = asyncio.run(engine.stats()), ray.get(drafter.info.remote())
    finally:
        if engine is not None:
            engine.kill_pipeline_actors()
        ray.shutdown()
    d = {k: after[k] - before[k] for k in ("num_steps", "verifier_busy_s")}
    drafting = sum(x["draft_s"] for x in [d_after] + after["local_drafters"]) - \
        sum(x["draft_s"] for x in [d_before] + before["local_drafters"])    # the actor's, and the verifier's stand-in
    return row("pipeline", wall, d["num_steps"], tokens, d["verifier_busy_s"], drafting)


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
    p.add_argument("--requests", type=common.positive_int, default=6, help="greedy requests per mode")
    p.add_argument("--max-tokens", type=common.positive_int, default=64)
    p.add_argument("--prompt-len", type=common.positive_int, default=16)
    p.add_argument("--spec-len", type=common.positive_int, default=4)
    p.add_argument("--threads", type=common.positive_int, default=2, help="torch threads of the in-process engine")
    p.add_argument("--no-pipeline", action="store_true", help="skip the Ray pipeline")
    p.add_argument("--remote-turns", action="store_true",
                   help="the drafter actor drafts a lone stream's turns (lockstep_in_verifier off)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    import torch

    from models.presets import random_config

    torch.set_num_threads(args.threads)
    ps = prompts(args.requests, args.prompt_len, random_config(TARGET).vocab_size)
    rows = list(in_process(args, ps).values())
    if not args.no_pipeline:
        rows.append(pipeline(args, ps))
    print(table(rows))
    if args.out:
        common.write_json(args.out, {"date": common.utc(), "machine": common.machine(), "args": vars(args) | {
            "out": str(args.out)}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
