"""The asynchronous Ray pipeline against the target alone and classic sync speculation (issue 4).

    python bench/e2e_async.py                          # the embedded pair, greedy chat prompts
    python bench/e2e_async.py --target DIR --draft DIR --max-tokens 64 --spec-len 4
    python bench/e2e_async.py --sweep 0,0.02,0.05,0.1  # + speedup vs acceptance (draft noise levels)
    python bench/e2e_async.py --draft-noise 1.0        # a draft far from the target: speculation must stop

Methods, interleaved prompt by prompt (order rotating), one run, same prompts:
- `off`: the in-process engine, target alone (the baseline of every speedup);
- `sync`: the in-process engine, draft-then-verify with a chain of K (and `sync-k<K>`
  with each other chain length `--sync-spec-lens` names, to compare the pipeline
  with sync at its best K, printed last);
- `async`: `cluster.pipeline.PipelineEngine` on a local Ray, the drafter and the
  verifier each an actor given **one core** (`num_cpus=1`, one torch thread;
  a plain step taken while the drafter has nothing to draft runs on both cores,
  `EngineSettings.plain_threads`); mode `auto` (adaptive) unless
  `--async-mode` says otherwise.
Columns: tokens/s (prefill included), speedup over `off`, acceptance rate,
mean accepted length (bonus included), verifier idle fraction (time the
verifier waited for a tree with a sequence active, over its wall time).

`--sweep` makes drafts of decreasing quality (the draft's weights plus Gaussian
noise of the given relative size) and plots speedup against the measured
per-level acceptance γ beside Eq. 3.2's model, E = (1 - γ^(K+1)) / (1 - γ),
divided by a step's cost in target steps: the verification of K+1 tokens alone
(the async ideal: drafting fully hidden), K draft forwards plus it (sync), and
K times the wait per level the verifier measured in the main run plus it (lockstep,
what a lone stream's pipeline does on a CPU node). Costs on `--threads` threads.
PNG and JSON go to bench/results/.

`--one-core-each` gives every model one core and lends none: the in-process methods
run on one thread (the target alone, as on one device; sync with draft and target
taking turns on it) and the pipeline's actors keep to their own core, its lone
stream overlapped (`EngineSettings.lockstep_alone` off) and a verifier step never
run on the drafter's core (`plain_threads` 0): the CPU stand-in for one device per
model, the shape the pipeline is built for.

`measure_async(...)` is the `async` method alone, for bench/e2e.py to call.
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

import torch  # noqa: E402

RESULTS = common.RESULTS


def start_local_ray(num_cpus: int = 2) -> bool:
    """A local Ray for a run's pipelines, two logical CPUs a pipeline; False where one is up already."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    return True


def stop_local_ray() -> None:
    import ray

    ray.shutdown()


class AsyncMethod:
    """`method(prompt_ids, max_tokens) -> dict` in bench/e2e.py's `Run` fields, over a local pipeline."""

    def __init__(self, target_dir: str, draft_dir: str | None, spec_len: int = 4, tree_width: int = 1,
                 mode: str = "auto", proposer: str = "model", start_ray: bool = True, **settings) -> None:
        from cluster.pipeline import build_pipeline_engine
        from speculation.requests import SpeculationOptions

        self.owns_ray = start_ray and start_local_ray()     # closing it stops that Ray
        self.engine = build_pipeline_engine(None, target_dir=target_dir, draft_dir=draft_dir,
                                            spec_len=spec_len, tree_width=tree_width, mode=mode,
                                            proposer=proposer, **settings)
        width = None if mode == "chain" else tree_width
        self.spec = SpeculationOptions(mode=mode, spec_len=spec_len, tree_width=width, proposer=proposer)
        self._n = 0

    def __call__(self, prompt_ids: list[int], max_tokens: int) -> dict:
        from speculation.requests import GenerationRequest
        from models.sampling import SamplingParams

        self._n += 1
        request = GenerationRequest(f"bench-{self._n}", list(prompt_ids),
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens), self.spec)
        before = self.stats()
        start = time.perf_counter()
        tokens, last = asyncio.run(_collect(self.engine, request))
        seconds = time.perf_counter() - start
        after = self.stats()
        delta = {k: after[k] - before[k] for k in ("num_spec_steps", "num_rejected_steps", "num_steps",
                                                   "verifier_idle_s", "verifier_wall_s", "verifier_busy_s")}
        return dict(token_ids=tokens, seconds=seconds, drafted=last.num_drafted, accepted=last.num_accepted,
                    steps=delta["num_spec_steps"], rejected_steps=delta["num_rejected_steps"],
                    verify_s=delta["verifier_busy_s"], idle_s=delta["verifier_idle_s"],
                    wall_s=delta["verifier_wall_s"])

    def stats(self) -> dict:
        return asyncio.run(self.engine.stats())

    def close(self) -> None:
        self.engine.kill_pipeline_actors()
        if self.owns_ray:
            stop_local_ray()


# the pipeline with each actor kept to its own core (`--one-core-each`, module doc)
ONE_CORE_EACH = {"lockstep_alone": False, "plain_threads": 0}


def pipeline_settings(one_core_each: bool = False, bridge_depth: int | None = None,
                      restart_depth: int | None = None, **settings) -> dict:
    """EngineSettings overrides of the `async` method from the benches' shared flags
    (`--one-core-each`, `--bridge-depth`, `--restart-depth`), on top of `settings`."""
    if one_core_each:
        settings.update(ONE_CORE_EACH)
    if bridge_depth is not None:
        settings["bridge_depth"] = bridge_depth
    if restart_depth is not None:
        settings["restart_depth"] = restart_depth
    return settings


def pipeline_methods(target_dir: str, drafts: dict, spec_len: int, settings: dict) -> dict:
    """bench/e2e.py's pipelines, name -> `AsyncMethod` over each draft directory (`async-eagle`: an
    EAGLE head, no bridge chains; `async-actor`: exchanges by actor call), on one local Ray (two
    logical CPUs each: one runs at a time); closing the last one stops that Ray, if it was
    started here."""
    own = start_local_ray(num_cpus=2 * len(drafts))
    own_settings = {"async-eagle": {"bridge_depth": 0}, "async-actor": {"exchange": "actor"}}
    methods = {m: measure_async(target_dir, draft, spec_len, 1, "auto", start_ray=False,
                                **(settings | own_settings.get(m, {})))
               for m, draft in drafts.items()}
    methods[list(methods)[-1]].owns_ray = own       # (bench/e2e.py closes them in this order)
    return methods


def measure_async(target_dir: str, draft_dir: str | None, spec_len: int = 4, tree_width: int = 1,
                  mode: str = "auto", **kw) -> AsyncMethod:
    """The `async` column of bench/e2e.py: call it per prompt, `.close()` at the end."""
    return AsyncMethod(target_dir, draft_dir, spec_len, tree_width, mode, **kw)


async def _collect(engine, request):
    tokens, last = [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        last = chunk
    if last is None or last.finish_reason == "error":
        raise RuntimeError(f"async request failed: {last.error if last else 'no output'}")
    return tokens, last


# ---------------------------------------------------------------- in-process baselines
def sync_methods(target_dir: str, draft_dir: str, spec_len: int, threads: int,
                 other_spec_lens: tuple[int, ...] = ()) -> dict:
    """`off` and `sync` (a chain of `spec_len`), plus `sync-k<K>` for each other chain length."""
    from cluster.local import build_engine, speculation_for
    from speculation.requests import GenerationRequest
    from models import SamplingParams

    torch.set_num_threads(threads)
    pair = build_engine(target_dir, draft_dir, spec_len=spec_len)

    def method(mode: str, k: int = spec_len):
        spec = speculation_for(mode, k, 1)

        def run(prompt_ids: list[int], max_tokens: int) -> dict:
            req = GenerationRequest("bench", prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                    spec)
            start = time.perf_counter()
            out = pair.engine.generate([req])[0]
            st = out.stats
            return dict(token_ids=out.token_ids, seconds=time.perf_counter() - start, drafted=st.num_drafted,
                        accepted=st.num_accepted, steps=st.num_steps, draft_s=st.draft_s,
                        rejected_steps=getattr(st, "num_rejected_steps", 0))
        return run

    methods = {"off": method("off"), "sync": method("sync")}
    for k in other_spec_lens:
        if k != spec_len:
            methods[f"sync-k{k}"] = method("sync", k)
    return methods, pair


def best_sync(rows: list[dict]) -> dict:
    """The fastest sync row (`sync` or a `sync-k<K>`): the pipeline's fair baseline."""
    return max((r for r in rows if r["method"] == "sync" or r["method"].startswith("sync-k")),
               key=lambda r: r["tokens_per_s"])


def chat_prompts(tokenizer, per_category: int) -> list[tuple[str, list[int]]]:
    from bench.e2e import PROMPTS, prompt_ids   # bench/e2e.py (issue 2): the shared prompt set

    return [(c, prompt_ids(tokenizer, t)) for c, texts in PROMPTS.items() for t in texts[:per_category]]


# ---------------------------------------------------------------- the run
def run_interleaved(methods: dict, work: list[tuple[str, list[int]]], max_tokens: int) -> dict[str, list]:
    from tqdm import tqdm

    names = list(methods)
    for name in names:                      # warm-up: first calls pay one-off costs
        methods[name](work[0][1], 4)
    runs: dict[str, list] = {n: [] for n in names}
    with tqdm(total=len(work) * len(names), desc="e2e-async", unit="run") as bar:
        for k, (category, ids) in enumerate(work):
            for name in names[k % len(names):] + names[:k % len(names)]:
                bar.set_postfix_str(f"{category} {name}")
                runs[name].append({"category": category, **methods[name](ids, max_tokens)})
                bar.update()
    return runs


def summarize(runs: dict[str, list]) -> list[dict]:
    def tps(rs):
        return sum(len(r["token_ids"]) for r in rs) / max(sum(r["seconds"] for r in rs), 1e-9)

    base = tps(runs["off"])
    categories = list(dict.fromkeys(r["category"] for r in runs["off"]))
    rows = []
    for name, rs in runs.items():
        drafted, accepted = sum(r.get("drafted", 0) for r in rs), sum(r.get("accepted", 0) for r in rs)
        steps, rejected = sum(r.get("steps", 0) for r in rs), sum(r.get("rejected_steps", 0) for r in rs)
        wall = sum(r.get("wall_s", 0.0) for r in rs)
        draft_s = sum(r.get("draft_s", 0.0) for r in rs)      # in process only (the pipeline's is its drafter's)
        rows.append({
            "method": name, "tokens_per_s": tps(rs), "speedup": tps(rs) / base if base else 0.0,
            # {category: speedup over off on that category's prompts}
            "by_category": {c: tps([r for r in rs if r["category"] == c]) /
                            max(tps([r for r in runs["off"] if r["category"] == c]), 1e-9) for c in categories},
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_len": (accepted + steps) / steps if steps else None,
            "gamma": accepted / (accepted + rejected) if accepted + rejected else None,
            # a sync chain's draft level (a node of a chain is one draft forward), prefills left out
            "draft_ms_per_node": 1e3 * draft_s / drafted if draft_s and drafted else None,
            "verifier_idle_fraction": sum(r.get("idle_s", 0.0) for r in rs) / wall if wall else None,
            "exact_vs_off": sum(a["token_ids"] == b["token_ids"] for a, b in zip(rs, runs["off"])) / len(rs),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    f = common.cell
    return common.markdown_table(
        ["method", "tokens/s", "speedup vs off", "acceptance", "mean accepted len", "γ", "verifier idle",
         "exact vs off"],
        [[r["method"], f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}×", f(r["acceptance_rate"], ".2f"),
          f(r["mean_accepted_len"], ".2f"), f(r["gamma"], ".2f"), f(r["verifier_idle_fraction"], ".1%"),
          f"{r['exact_vs_off']:.0%}"] for r in rows])


def noisy_draft(draft_dir: str, noise: float, out: Path) -> str:
    """A copy of the draft with Gaussian noise of relative size `noise` on its layer weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(draft_dir, out)
    g = torch.Generator().manual_seed(0)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if "layers." in name and t.is_floating_point():
                t32 = t.float()
                tensors[name] = (t32 + noise * t32.std() * torch.randn(t32.shape, generator=g)).to(t.dtype)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return str(out)


def plot(points: list[dict], K: int, verify_ratio: float, sync_ratio: float, path: Path,
         lockstep_ratio: float | None = None) -> None:
    import matplotlib

    from speculation.planner import expected_tokens as eq32     # Eq. 3.2

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = [i / 100 for i in range(0, 100)]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(g, [eq32(x, K) / verify_ratio for x in g], label=f"Eq. 3.2, async ideal (K={K})")
    ax.plot(g, [eq32(x, K) / sync_ratio for x in g], "--", label="Eq. 3.2, sync (K drafts + verify)")
    if lockstep_ratio is not None:
        ax.plot(g, [eq32(x, K) / lockstep_ratio for x in g], ":",
                label="Eq. 3.2, lockstep (K measured waits + verify)")
    for name, marker in (("async", "o"), ("sync", "s")):
        pts = [p for p in points if p["method"] == name and p["gamma"] is not None]
        ax.scatter([p["gamma"] for p in pts], [p["speedup"] for p in pts], marker=marker, label=f"measured {name}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("per-token acceptance γ")
    ax.set_ylabel("speedup over the target alone")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--max-tokens", type=common.positive_int, default=64)
    p.add_argument("--spec-len", type=common.positive_int, default=4)
    p.add_argument("--prompts", type=common.positive_int, default=3, help="prompts per category (at most 3)")
    p.add_argument("--categories", default="code,math,chat")
    p.add_argument("--threads", type=common.positive_int, default=2, help="torch threads of the in-process methods")
    p.add_argument("--async-mode", default="auto", choices=("auto", "chain"))
    p.add_argument("--sweep", default="", help="draft noise levels for the speedup-vs-acceptance plot")
    p.add_argument("--draft-noise", type=float, default=0.0,
                   help="run every method with the draft plus Gaussian noise of this relative size "
                        "(1.0: a draft far from the target, where speculation must switch off)")
    p.add_argument("--ring-slots", type=common.positive_int, default=None,
                   help="trees in flight per sequence in the pipeline (default: EngineSettings')")
    p.add_argument("--no-lockstep-alone", action="store_true",
                   help="keep a lone stream overlapped (EngineSettings.lockstep_alone off): the "
                        "asynchronous protocol itself, one request at a time")
    p.add_argument("--bridge-depth", type=int, default=None,
                   help="EngineSettings.bridge_depth: draft tokens a bridge step verifies (default: its own)")
    p.add_argument("--restart-depth", type=int, default=None,
                   help="EngineSettings.restart_depth: depth of the restart tree after a contradicted "
                        "outcome, 0 = bridge, -1 = a lone overlapped stream restarts with up to 3 "
                        "(default: its own)")
    p.add_argument("--exchange", choices=("socket", "actor"), default=None,
                   help="EngineSettings.exchange: how the drafter exchanges with its verifier")
    p.add_argument("--one-core-each", action="store_true",
                   help="every model on one core, none lent: the in-process methods on one thread, the "
                        "pipeline overlapped with no verifier step on the drafter's core (module doc)")
    p.add_argument("--sync-spec-lens", default="",
                   help="also sync with these chain lengths in the same run (comma list; rows sync-k<K>), "
                        "so the pipeline is compared with sync at its best K")
    p.add_argument("--tag", default="cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        other_ks = tuple(int(x) for x in args.sync_spec_lens.split(",") if x.strip())
    except ValueError:
        p.error(f"--sync-spec-lens: a comma list of chain lengths, not {args.sync_spec_lens!r}")
    if any(k < 1 for k in other_ks):
        p.error("--sync-spec-lens: chain lengths of at least 1")
    if args.one_core_each:
        args.threads = 1
    target_dir, draft_dir = common.model_pair(p, args)
    from models import load_tokenizer

    work = [w for w in chat_prompts(load_tokenizer(target_dir), args.prompts)
            if w[0] in args.categories.split(",")]
    if args.draft_noise:
        import tempfile

        draft_dir = noisy_draft(draft_dir, args.draft_noise, Path(tempfile.mkdtemp()) / "draft")
    methods, pair = sync_methods(target_dir, draft_dir, args.spec_len, args.threads, other_ks)
    settings = {} if args.ring_slots is None else {"ring_slots": args.ring_slots}
    if args.no_lockstep_alone:
        settings["lockstep_alone"] = False
    if args.exchange:
        settings["exchange"] = args.exchange
    settings = pipeline_settings(args.one_core_each, args.bridge_depth, args.restart_depth, **settings)
    methods["async"] = measure_async(target_dir, draft_dir, args.spec_len, 1, args.async_mode, **settings)
    try:
        runs = run_interleaved(methods, work, args.max_tokens)
        final = methods["async"].stats()
        costs = pipeline_costs(final)
    finally:
        methods["async"].close()
    result = report(args, runs, final, costs)
    if args.sweep:
        result["sweep"] = sweep(args, target_dir, draft_dir, work, methods, runs, costs)
    out = common.write_json(RESULTS / f"e2e_async_{args.tag}.json", result, default=str)
    print(f"wrote {out}")
    return 0


def report(args, runs: list, final: dict, costs: dict) -> dict:
    """Print the table and what the pipeline's own counters say; the results file's contents."""
    rows = summarize(runs)
    print(markdown(rows))
    best = best_sync(rows)
    async_row = next(r for r in rows if r["method"] == "async")
    print(f"async ÷ the fastest sync ({best['method']}): {async_row['tokens_per_s'] / best['tokens_per_s']:.2f}")
    by_category = {c: async_row["by_category"][c] / best["by_category"][c] for c in best["by_category"]}
    print("  by category: " + ", ".join(f"{c} {v:.2f}" for c, v in by_category.items()))
    print("pipeline step costs (ms, fitted by the verifier as it ran): " +
          ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    # plain steps that ran on the idle drafter's core too (warm-up included)
    borrowed = {"borrowed_steps": final.get("borrowed_steps", 0), "target_forwards": final.get("num_batches", 0)}
    print(f"verifier forwards on borrowed cores: {borrowed['borrowed_steps']} of {borrowed['target_forwards']}")
    # the drafter's own time: what a step in lockstep waits for besides the forward
    drafters = [{k: d.get(k) for k in ("trees_drafted", "nodes_drafted", "draft_s", "exchanges", "socket_exchanges",
                                       "exchanges_by_call")}
                for d in final.get("drafters", [])]
    trees = sum(d["trees_drafted"] or 0 for d in drafters)
    if trees:
        print(f"drafter: {trees} trees, {1e3 * sum(d['draft_s'] or 0 for d in drafters) / trees:.1f} ms "
              f"drafting each")
    # what each sequence-step of the pipeline was: a drafter's tree, a prompt-lookup chain, or
    # decoding alone (by plan, or because its tree was late: fallback)
    steps = {k: final.get(k, 0) for k in STEP_COUNTERS}
    print("pipeline sequence-steps: " + ", ".join(f"{k} {v}" for k, v in steps.items()))
    result = {"args": vars(args), "rows": rows, "pipeline_costs_ms": costs, **borrowed, "drafters": drafters,
              "fastest_sync": best["method"], "async_over_fastest_sync": async_row["tokens_per_s"] / best["tokens_per_s"],
              "async_over_fastest_sync_by_category": by_category,
              "steps": steps, "date": common.utc(), "machine": common.machine()}
    return result


STEP_COUNTERS = ("num_steps", "num_batches", "spec_on_decisions", "spec_off_decisions", "joins_speculating",
                 "fallback_steps", "drafter_absent_steps", "lookup_trees", "bridge_chains", "bridge_chain_drafted",
                 "bridge_chain_accepted", "restarts", "restart_trees", "restart_drafted", "restart_accepted",
                 "trees_dropped", "rollbacks")


def pipeline_costs(stats: dict) -> dict:
    """The verifier's own cost model after the run (what its planner uses): a + b * rows per step,
    fitted on each step's time after admission; the wait for trees per speculating step
    (overlapped); d per draft level."""
    c = (stats.get("costs") or [{}])[0]
    a, b, d = c.get("verify_cost_a_s", 0.0), c.get("verify_cost_b_s", 0.0), c.get("draft_level_s", 0.0)
    out = {"step_1_row": 1e3 * (a + b), "step_4_rows": 1e3 * (a + 4 * b), "draft_level": 1e3 * d,
           "wait_per_speculating_step": 1e3 * c.get("overlap_wait_s", 0.0)}
    if c.get("ms_per_token_by_regime"):      # a lone stream's regime, measured (verifier/regime.py)
        out.update({f"regime_{k}_ms_per_token": v for k, v in c["ms_per_token_by_regime"].items()})
        out["regime_lockstep_at_end"] = float(c.get("regime") == "lockstep")
    if c.get("lockstep_draft_level_s") is not None:     # the wait per level while in lockstep
        out["lockstep_draft_level"] = 1e3 * c["lockstep_draft_level_s"]
        out["lockstep_draft_fixed"] = 1e3 * (c.get("lockstep_draft_fixed_s") or 0.0)    # and per tree
    # the target's own forward per batch shape inside the verifier actor (rows: 1 = plain step)
    for rows, ms in sorted((int(r), ms) for r, ms in c.get("forward_ms_by_rows", {}).items()):
        out[f"forward_{rows}_rows"] = ms
    # the same on the idle drafter's cores too (plain steps, EngineSettings.plain_threads)
    for rows, ms in sorted((int(r), ms) for r, ms in c.get("borrowed_forward_ms_by_rows", {}).items()):
        out[f"borrowed_forward_{rows}_rows"] = ms
    return out


def sweep(args, target_dir, draft_dir, work, methods, runs, costs: dict) -> dict:
    """Speedup vs acceptance: drafts of decreasing quality, async (chain) and sync, vs Eq. 3.2."""
    import tempfile

    from bench.e2e import forward_ms
    from models.pair import read_logit_rows
    from models import load_model
    from models.linear import use_draft_weights

    # the model lines' step costs on the in-process baselines' threads, the draft as its
    # proposer runs it (int8 layers, the reduced head selected once)
    torch.set_num_threads(args.threads)
    target = load_model(target_dir)
    t1, tk = forward_ms(target, 128, 1), forward_ms(target, 128, args.spec_len + 1)
    draft = load_model(draft_dir)
    use_draft_weights(draft)
    rows = read_logit_rows(draft_dir, target.config.vocab_size)
    d1 = forward_ms(draft, 128, 1, logit_rows=None if rows is None else torch.tensor(rows))
    # a lone stream's pipeline takes turns (lockstep): each level costs the wait the verifier
    # measured for its drafter's trees in the main run (the draft beside a cold cache, two Ray hops)
    level_ms = costs.get("lockstep_draft_level")
    points = [{"noise": 0.0, **{k: v for k, v in r.items() if k != "by_category"}}
              for r in summarize(runs) if r["method"] in ("async", "sync")]
    off = [r for r in summarize(runs) if r["method"] == "off"][0]["tokens_per_s"]
    with tempfile.TemporaryDirectory() as tmp:
        for noise in [float(x) for x in args.sweep.split(",") if float(x) > 0]:
            noisy = noisy_draft(draft_dir, noise, Path(tmp) / f"draft-{noise}")
            sync_m, _ = sync_methods(target_dir, noisy, args.spec_len, args.threads)
            am = measure_async(target_dir, noisy, args.spec_len, 1, "chain")
            try:
                sub = run_interleaved({"off": lambda ids, n: {"token_ids": [], "seconds": 1.0},
                                       "sync": sync_m["sync"], "async": am}, work, args.max_tokens)
            finally:
                am.close()
            for r in summarize(sub):
                if r["method"] != "off":
                    r["speedup"] = r["tokens_per_s"] / off
                    points.append({"noise": noise, **r})
    png = RESULTS / f"e2e_async_speedup_vs_acceptance_{args.tag}.png"
    lockstep = None if level_ms is None else (args.spec_len * level_ms + tk) / t1
    plot(points, args.spec_len, tk / t1, (args.spec_len * d1 + tk) / t1, png, lockstep)
    print(f"wrote {png}")
    return {"points": points, "target_1_ms": t1, "verify_ms": tk, "draft_1_ms": d1,
            "lockstep_draft_level_ms": level_ms, "threads": args.threads}


if __name__ == "__main__":
    sys.exit(main())
