"""Fault-injection soak of the Ray pipeline (issue 7; DESIGN.md §3, §7).

Starts a local multi-node Ray cluster on loopback (`ray.cluster_utils.Cluster`:
a head node, a node that hosts the drafter, nodes that may host the verifier), builds a
`PipelineEngine` and drives a steady load of streaming requests (greedy and
sampled; chains, trees and adaptive) while it kills, at random moments, the
drafter actor, the verifier actor and the raylet of the drafter's node, then
restarts them (Ray restarts the actors; the node is added back), and removes the
verifier's node for good (Ray restarts the verifier on a spare verifier node;
a new node joins in place of the lost one, `--verifier-nodes`).

Every request must end in exactly one of:
- *complete*: finish "length" with `max_tokens` tokens; a greedy one must also
  be *exact*, equal to the target decoding alone (Hugging Face `generate`);
- a *clear error*: finish "error" with a message that starts "retryable: "
  (every fault here is one a client may retry), the tokens streamed before it
  still the target's.
Anything else is *lost*; a request still running at its timeout is *hung*.
After the load the pipeline must serve again with speculation, and every KV
block, ring slot and stream of the verifier and the drafter must be free, and
the resident memory of the driver and of the actors back within a margin of its
level after the warm-up.

    python bench/chaos.py --duration 60 --max-requests 300      # tiny random pair, one minute
    python bench/chaos.py --duration 600 --max-requests 5000    # the long soak (bench/README.md)
    python bench/chaos.py --duration 60 --restart-depth 1       # with restart trees (or --bridge-depth 2)
    python bench/chaos.py --duration 60 --faults verifier_node,verifier   # the verifier's node lost
    python bench/chaos.py --target DIR --draft DIR --json

Prints the counts (and `--json` the report); writes JSON under bench/results/;
exits 1 when anything was lost, hung or leaked. `run_soak` runs the same soak
on a cluster the caller owns (tests/cluster/test_chaos.py).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)
from bench.chaos_faults import (MB, FaultInjector, actor_states, held_state, print_report,  # noqa: E402
                                process_rss, wait_until)

FAULTS = ("drafter", "verifier", "raylet", "verifier_node")
VERIFIER_RESOURCE = "specflash_verifier"
DRAFTER_RESOURCE = "specflash_drafter"
RETRYABLE = "retryable: "


@dataclass
class SoakConfig:
    duration_s: float = 60.0          # load phase length
    max_requests: int = 300           # stop sending after this many (load phase)
    concurrency: int = 4              # streaming clients
    request_timeout_s: float = 60.0   # a request still running after this is hung
    fault_every_s: float = 8.0        # mean gap between faults (uniform 0.5x - 1.5x)
    faults: tuple[str, ...] = FAULTS
    node_down_s: float = 3.0          # the drafter's node stays down this long
    min_tokens: int = 8
    max_tokens: int = 48
    sampled_share: float = 0.3        # share of requests sampled (temperature 0.8) rather than greedy
    warmup_requests: int = 8          # before the memory baseline, no faults
    after_requests: int = 8           # after recovery, no faults: all must be exact
    settle_s: float = 90.0            # time allowed to recover and drain after the load
    max_extra_s: float = 120.0        # the load goes on past its bounds, this long at most, until
                                      # every fault kind was injected once (a slow machine)
    rss_margin_mb: float = 64.0       # allowed growth of each process's resident memory
    seed: int = 0


SPECULATION_COUNTERS = ("num_spec_steps", "drafter_rollbacks", "restarts", "restart_trees", "bridge_chains",
                        "fallback_steps")


@dataclass
class SoakReport:
    sent: int = 0
    exact: int = 0                    # greedy, complete, equal to the target alone
    complete_sampled: int = 0         # sampled, complete (max_tokens tokens in the vocabulary)
    clear_errors: int = 0             # finish "error" with a message, tokens before it correct
    retryable_errors: int = 0         # of those, marked retryable
    lost: int = 0
    hung: int = 0
    leaked_blocks: int = 0            # verifier KV blocks not free after the run
    leaked_ring_slots: int = 0
    leaked_draft_blocks: int = 0      # drafter KV blocks not free
    leaked_state: int = 0             # streams, queues, reservations, routes still held
    after_exact: int = 0              # of the post-recovery requests
    recovered_s: float | None = None  # from the last fault to health ok with speculation
    faults: dict = field(default_factory=dict)
    rss_mb: dict = field(default_factory=dict)    # process -> {before, after, delta, restarted}
    tokens: int = 0
    wall_s: float = 0.0
    errors: dict = field(default_factory=dict)    # error message (shortened) -> count
    fault_log: list = field(default_factory=list) # (seconds into the load, fault, outcome)
    actors: dict = field(default_factory=dict)    # actor -> Ray's state and restart count, at the end
    outcomes: dict = field(default_factory=dict)  # phase -> outcome -> count
    lost_examples: list = field(default_factory=list)
    config: dict = field(default_factory=dict)
    # the verifier's speculation counters at the end (since its last restart): what the soak ran
    speculation: dict = field(default_factory=dict)
    verifier_health: str | None = None            # /health's "verifier" once recovered: its last restart

    def count(self, rid: str, outcome: str) -> None:
        phase = self.outcomes.setdefault(rid.split("-")[0], {})
        phase[outcome] = phase.get(outcome, 0) + 1

    def note_lost(self, rid: str, why: str, hung: bool = False) -> None:
        self.count(rid, "hung" if hung else "lost")
        if hung:
            self.hung += 1
        else:
            self.lost += 1
        if len(self.lost_examples) < 20:
            self.lost_examples.append(f"{rid}: {why}")

    def problems(self, rss_margin_mb: float) -> list[str]:
        out = [f"{n} {what}" for n, what in [
            (self.lost, "lost"), (self.hung, "hung"), (self.leaked_blocks, "leaked KV blocks"),
            (self.leaked_ring_slots, "leaked ring slots"), (self.leaked_draft_blocks, "leaked draft KV blocks"),
            (self.leaked_state, "leaked streams / routes"),
            (self.clear_errors - self.retryable_errors, "errors not marked retryable")] if n]
        if self.recovered_s is None:
            out.append("the pipeline did not recover (health ok with speculation)")
        after = self.config.get("after_requests", 0)
        if self.after_exact < after:
            out.append(f"only {self.after_exact} of {after} requests after recovery were exact")
        out += [f"{p} resident memory grew {m['delta']:.0f} MB (> {rss_margin_mb:.0f})"
                for p, m in self.rss_mb.items() if m["delta"] > rss_margin_mb]
        return out


# ---------------------------------------------------------------- the load
@dataclass
class Workload:
    prompts: list[list[int]]
    references: list[list[int]]       # the target's greedy continuation of each prompt
    vocab_size: int
    rng: random.Random
    n: int = 0

    def next(self, cfg: SoakConfig, phase: str):
        from speculation.requests import GenerationRequest, SpeculationOptions
        from models.sampling import SamplingParams

        self.n += 1
        i = self.rng.randrange(len(self.prompts))
        max_tokens = self.rng.randint(cfg.min_tokens, cfg.max_tokens)
        sampled = phase == "load" and self.rng.random() < cfg.sampled_share
        params = SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.95 if sampled else 1.0,
                                seed=self.n, max_tokens=max_tokens, ignore_eos=True)
        mode = self.rng.choice(["chain", "tree", "auto"])
        spec = SpeculationOptions(mode=mode, spec_len=self.rng.choice([2, 3, 4]),
                                  tree_width=2 if mode == "tree" else None)
        req = GenerationRequest(f"{phase}-{self.n}", list(self.prompts[i]), params, spec)
        return req, (None if sampled else self.references[i][:max_tokens])


async def one_request(engine, req, reference, cfg: SoakConfig, report: SoakReport, vocab: int) -> bool:
    """Send one request, classify how it ended; True when it completed (exactly, if greedy)."""
    tokens, last, rid = [], None, req.request_id
    report.sent += 1

    async def consume():
        nonlocal last
        async with contextlib.aclosing(engine.generate(req)) as stream:
            async for chunk in stream:
                tokens.extend(chunk.token_ids)
                last = chunk

    try:
        await asyncio.wait_for(consume(), cfg.request_timeout_s)
    except asyncio.TimeoutError:
        report.note_lost(rid, f"no end within {cfg.request_timeout_s:.0f} s ({len(tokens)} tokens)", hung=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(engine.abort(rid), 10)
        return False
    except Exception as e:          # the engine must answer with a chunk, never raise
        report.note_lost(rid, f"raised {type(e).__name__}: {e}")
        return False
    report.tokens += len(tokens)
    correct = (tokens == reference[:len(tokens)]) if reference is not None else all(
        0 <= t < vocab for t in tokens)
    if last is None or not last.finished:
        report.note_lost(rid, "the stream ended without a final chunk")
    elif not correct:
        report.note_lost(rid, f"wrong tokens ({last.finish_reason}): {tokens[:12]}...")
    elif last.finish_reason == "error":
        if not last.error:
            report.note_lost(rid, "an error without a message")
            return False
        report.clear_errors += 1
        report.retryable_errors += last.error.startswith(RETRYABLE)
        report.count(rid, "error")
        key = last.error[:90]
        report.errors[key] = report.errors.get(key, 0) + 1
    elif last.finish_reason == "length" and len(tokens) == req.sampling.max_tokens:
        if reference is None:
            report.complete_sampled += 1
        else:
            report.exact += 1
        report.count(rid, "complete")
        return True
    else:
        report.note_lost(rid, f"finish {last.finish_reason!r} after {len(tokens)} of "
                              f"{req.sampling.max_tokens} tokens")
    return False


async def drive(engine, work: Workload, cfg: SoakConfig, report: SoakReport, phase: str,
                num_requests: int, deadline: float, bar=None, extend=None) -> int:
    """`cfg.concurrency` clients, each sending requests back to back; returns how many completed.
    `extend()`, if given, keeps them going past `num_requests` / `deadline` while it is true."""
    sent, done = 0, 0

    def more() -> bool:
        within = sent < num_requests and time.monotonic() < deadline
        return within or (extend is not None and extend())

    async def client():
        nonlocal sent, done
        while more():
            sent += 1
            req, ref = work.next(cfg, phase)
            ok = await one_request(engine, req, ref, cfg, report, work.vocab_size)
            done += ok      # not `done += await ...`: that reads `done` before the await
            if bar is not None:
                bar.update(1)
                bar.set_postfix(lost=report.lost, hung=report.hung, errors=report.clear_errors)

    await asyncio.gather(*(client() for _ in range(cfg.concurrency)))
    return done


# ---------------------------------------------------------------- the faults
def soak(engine, injector: FaultInjector, work: Workload, cfg: SoakConfig, progress: bool) -> SoakReport:
    """Warm-up, load under faults, recovery, post-recovery requests, drain; the requests run on an
    event loop in a thread of their own while this (main) thread injects the faults."""
    report = SoakReport(config=asdict(cfg))
    start = time.monotonic()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="chaos-load", daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    try:
        far = start + 10 * cfg.settle_s
        on_loop(drive(engine, work, cfg, report, "warmup", cfg.warmup_requests, far))
        before = on_loop(process_rss(engine))
        load_under_faults(engine, injector, work, cfg, report, progress, loop)
        held, after = on_loop(recover(engine, injector, work, cfg, report, far))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    report.leaked_blocks, report.leaked_ring_slots = held["blocks"], held["ring"]
    report.leaked_draft_blocks, report.leaked_state = held["draft_blocks"], held["state"]
    report.actors = actor_states(engine)
    if held.get("drafters_unreachable"):
        report.recovered_s = None
    report.rss_mb = {p: {"before": round(before[p][0], 1), "after": round(after[p][0], 1),
                         "delta": round(after[p][0] - before[p][0], 1),
                         "restarted": before[p][1] != after[p][1]} for p in before if p in after}
    report.faults = dict(injector.counts)
    report.fault_log = injector.log
    report.wall_s = time.monotonic() - start
    return report


def load_under_faults(engine, injector: FaultInjector, work: Workload, cfg: SoakConfig, report: SoakReport,
                      progress: bool, loop) -> None:
    """The load phase on `loop` (another thread) while this thread injects faults; it runs past
    its bounds (at most `max_extra_s`) until every fault kind happened once."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_requests, desc="chaos", unit="req", file=sys.stderr)
    hard_stop = time.monotonic() + cfg.duration_s + cfg.max_extra_s
    load = asyncio.run_coroutine_threadsafe(drive(
        engine, work, cfg, report, "load", cfg.max_requests, time.monotonic() + cfg.duration_s, bar,
        extend=lambda: not injector.round_done() and time.monotonic() < hard_stop), loop)
    injector.run(load)        # a fault in progress finishes first (a node comes back)
    load.result()
    if bar is not None:
        bar.close()


async def recover(engine, injector: FaultInjector, work: Workload, cfg: SoakConfig, report: SoakReport,
                  far: float) -> tuple[dict, dict]:
    """After the load: wait for health with speculation, send the post-recovery requests, wait
    for the pipeline to free everything; (what it still holds, resident memory)."""
    async def serving_with_speculation():
        h = await engine.health()
        return h if h["ok"] and h["speculation"] else None

    health = await wait_until(serving_with_speculation, cfg.settle_s)
    if health:
        report.recovered_s = time.monotonic() - (injector.last_fault or time.monotonic())
        report.verifier_health = health.get("verifier")
    report.after_exact = await drive(engine, work, cfg, report, "after", cfg.after_requests, far)

    async def drained():
        held = await held_state(engine)
        return held if not any(held.values()) else None

    held = await wait_until(drained, cfg.settle_s) or await held_state(engine)
    after = await process_rss(engine)
    stats = await engine.stats()
    report.speculation = {k: stats.get(k, 0) for k in SPECULATION_COUNTERS}
    return held, after


def greedy_references(target_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target alone, greedy, through Hugging Face `generate`: what every greedy request must equal."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=[], pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    del hf
    gc.collect()
    return out


def run_soak(cluster, drafter_node, node_args: dict, app_args, target_dir: str, draft_dir: str,
             cfg: SoakConfig, progress: bool = False, num_prompts: int = 12, verifier_nodes: list | None = None,
             verifier_args: dict | None = None, **engine_kw) -> SoakReport:
    """The soak on a running cluster (`ray.init` done) whose node `drafter_node`, started with
    `node_args`, is the only one offering the drafter's resource in `app_args.placement`;
    `verifier_nodes` (started with `verifier_args`), the only ones offering the verifier's, for
    the fault "verifier_node"."""
    from cluster.pipeline import build_pipeline_engine
    from models.loader import load_config

    rng = random.Random(cfg.seed)
    vocab = load_config(target_dir).vocab_size
    prompts = [[rng.randrange(min(vocab, 256)) for _ in range(1 + (7 * i + 3) % 40)] for i in range(num_prompts)]
    work = Workload(prompts, greedy_references(target_dir, prompts, cfg.max_tokens), vocab, rng)
    engine_kw = {"drafter_max_restarts": -1, "verifier_max_restarts": -1, "num_blocks": 512,
                 "drafter_timeout_s": 1.0, "chunk_timeout_s": cfg.request_timeout_s / 2, **engine_kw}
    engine = build_pipeline_engine(app_args, target_dir=target_dir, draft_dir=draft_dir, **engine_kw)
    injector = FaultInjector(cluster, drafter_node, node_args, engine, cfg, rng, verifier_nodes, verifier_args)
    try:
        return soak(engine, injector, work, cfg, progress)
    finally:
        engine.kill_pipeline_actors()


# ---------------------------------------------------------------- command line
def tiny_pair(root: Path) -> tuple[str, str]:
    """A random 2-layer Llama (260 tokens) and a close draft (its weights plus 2% noise)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
                         bos_token_id=256, eos_token_id=257)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(root / "target", safe_serialization=True)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.02 * p.std() * torch.randn_like(p))
    target.save_pretrained(root / "draft", safe_serialization=True)
    return str(root / "target"), str(root / "draft")


def placement_args(drafter_resource: str = DRAFTER_RESOURCE, verifier_resource: str = VERIFIER_RESOURCE):
    """AppArgs pinning the verifier and the drafter to their nodes by custom resource."""
    from cluster.config import ActorPlacement, AppArgs, PlacementConfig

    return AppArgs(placement=PlacementConfig(
        drafter=ActorPlacement(num_cpus=1, resources={drafter_resource: 1}),
        verifier=ActorPlacement(num_cpus=1, resources={verifier_resource: 1}), strategy="NONE"))


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, SoakConfig, dict]:
    """(arguments, soak config, the recovery policy's EngineSettings) from the command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = SoakConfig()
    ap.add_argument("--duration", type=common.positive_float, default=d.duration_s, help="load phase, seconds")
    ap.add_argument("--max-requests", type=common.positive_int, default=d.max_requests)
    ap.add_argument("--concurrency", type=common.positive_int, default=d.concurrency)
    ap.add_argument("--request-timeout", type=common.positive_float, default=d.request_timeout_s)
    ap.add_argument("--fault-every", type=common.positive_float, default=d.fault_every_s,
                    help="mean seconds between faults")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {FAULTS}")
    ap.add_argument("--node-down", type=float, default=d.node_down_s)
    ap.add_argument("--verifier-nodes", type=common.positive_int, default=2,
                    help="worker nodes offering the verifier's resource (the fault 'verifier_node' removes "
                         "the verifier's and adds a new one; Ray restarts the verifier on another)")
    ap.add_argument("--max-extra", type=float, default=d.max_extra_s,
                    help="seconds the load may run past its bounds until every fault kind happened once")
    ap.add_argument("--max-tokens", type=common.positive_int, default=d.max_tokens)
    ap.add_argument("--sampled-share", type=float, default=d.sampled_share)
    ap.add_argument("--rss-margin-mb", type=float, default=d.rss_margin_mb)
    ap.add_argument("--seed", type=int, default=d.seed)
    common.add_model_pair(ap, default="a tiny random Llama and a close draft")
    ap.add_argument("--restart-depth", type=int, default=None,
                    help="EngineSettings.restart_depth: restart trees instead of bridges (-1: a lone "
                         "overlapped stream's; default: its own)")
    ap.add_argument("--bridge-depth", type=int, default=None,
                    help="EngineSettings.bridge_depth: bridge chains of this depth (default: its own)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--out", default=str(common.RESULTS), help="the folder for chaos-<time>.json")
    args = ap.parse_args(argv)
    faults = tuple(f for f in args.faults.split(",") if f)
    if not set(faults) <= set(FAULTS):
        ap.error(f"--faults must name some of {FAULTS}")
    common.model_pair(ap, args, embedded=False)         # neither: the tiny random pair, made below
    policy = {k: v for k, v in (("restart_depth", args.restart_depth), ("bridge_depth", args.bridge_depth))
              if v is not None}
    from pydantic import ValidationError

    from speculation.settings import SpeculationSettings

    try:                        # the cluster config's own bounds and its one-policy rule
        SpeculationSettings(**policy)
    except ValidationError as e:
        ap.error("--restart-depth and --bridge-depth as the cluster config takes them (restart depth at least "
                 "-1, bridge depth at least 0, at most one of them above 0): "
                 + "; ".join(err["msg"] for err in e.errors()))
    cfg = SoakConfig(duration_s=args.duration, max_requests=args.max_requests, concurrency=args.concurrency,
                     request_timeout_s=args.request_timeout, fault_every_s=args.fault_every, faults=faults,
                     node_down_s=args.node_down, max_tokens=max(args.max_tokens, d.min_tokens),
                     sampled_share=args.sampled_share, rss_margin_mb=args.rss_margin_mb, seed=args.seed,
                     max_extra_s=args.max_extra)
    return args, cfg, policy


def soak_on_local_cluster(args: argparse.Namespace, cfg: SoakConfig, policy: dict) -> SoakReport:
    """A head node (no actor of the pipeline on it: it cannot be removed), the drafter's node and
    `--verifier-nodes` nodes for the verifier, on loopback; the soak on them; all shut down after."""
    import ray
    from ray.cluster_utils import Cluster

    store = 128 * MB
    node_args = {"num_cpus": 2, "resources": {DRAFTER_RESOURCE: 4}, "object_store_memory": store}
    verifier_args = {"num_cpus": 2, "resources": {VERIFIER_RESOURCE: 4}, "object_store_memory": store}
    with tempfile.TemporaryDirectory(prefix="specflash-chaos-") as tmp:
        target, draft = (args.target, args.draft) if args.target else tiny_pair(Path(tmp))
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "object_store_memory": store, "include_dashboard": False,
            # a dead raylet is noticed in ~3 s rather than Ray's default ~15-30 s
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
        try:
            node = cluster.add_node(**node_args)
            verifier_nodes = [cluster.add_node(**verifier_args) for _ in range(args.verifier_nodes)]
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            return run_soak(cluster, node, node_args, placement_args(), target, draft, cfg,
                            progress=sys.stderr.isatty(), verifier_nodes=verifier_nodes,
                            verifier_args=verifier_args, **policy)
        finally:
            ray.shutdown()
            cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    args, cfg, policy = parse(argv)
    report = soak_on_local_cluster(args, cfg, policy)
    problems = report.problems(cfg.rss_margin_mb)
    out = {**asdict(report), "problems": problems, "target": args.target or "tiny random Llama", "settings": policy,
           "when": common.utc(common.ISO)}
    path = common.write_json(Path(args.out) / f"chaos-{common.utc(common.STAMP)}.json", out, indent=2)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_report(report, problems)
        print(f"wrote {path}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
