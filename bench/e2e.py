"""End-to-end CPU benchmark of speculative decoding (DESIGN.md §8, issue 2 item 7).

    python bench/e2e.py                                  # the embedded pair
    python bench/e2e.py --target DIR --draft DIR --max-tokens 64 --spec-len 4 --tree-width 2

Same prompts (code, math, chat, wrapped in the chat template), greedy, one run,
methods interleaved prompt by prompt (the order rotates) so that a noisy
machine hurts all of them alike:

- `off`: our engine, the target alone (the baseline of every speedup);
- `sync-chain`, `sync-tree`: draft-then-verify with a chain of K / an EAGLE-2 tree;
- `sync-auto`: the same engine choosing each step's depth (0 = decode alone) from the
  running acceptance and the measured step costs (the server's default mode, "auto");
- `eagle-chain`, `eagle-tree`, `eagle-auto`: the same with the feature-conditioned EAGLE
  draft head (`--eagle`; the embedded one by default) instead of the layered draft;
- `ngram`: prompt lookup decoding (no draft model);
- `hf-target`, `hf-assisted`: Hugging Face `generate`, the target alone and assisted
  generation (`assistant_model`, constant K, no confidence cutoff) on the same checkpoints;
- `async`: the disaggregated pipeline (`cluster.pipeline`) on a local Ray started for the
  run, the drafter and the verifier each an actor given one core, mode `auto`
  (`bench/e2e_async.py`'s method; `--no-async` skips it). Its row adds the verifier's idle
  fraction (time it waited for a tree with a sequence active, over its wall time).
- `async-eagle`: the same pipeline with the EAGLE head as its drafter (no bridge chains:
  a head drafts on the target's features). With `async` beside it both pipelines stand on
  one Ray given four logical CPUs; one runs at a time, the other's actors wait idle.
  `--one-core-each`: every model gets one core and lends none (the in-process methods,
  Hugging Face's included, on one thread; the pipeline overlapped, its verifier never on
  the drafter's core): the CPU stand-in for one device per model.

Columns: tokens/s (generated tokens over wall time, prefill included), speedup
over `off`, acceptance rate (accepted / drafted nodes), mean accepted length
(tokens per verification, bonus included), the per-level acceptance gamma, and
the speedup predicted by Eq. 3.2 of Leviathan et al. 2023, E[tokens/step] =
(1 - gamma^(K+1)) / (1 - gamma), divided by the measured cost of one step (K
draft forwards + one verification of K+1 tokens) in units of one target
decoding step. Trees use their measured mean accepted length instead (no
closed form).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

import torch  # noqa: E402

PROMPTS = {
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a Python function is_palindrome(s) that ignores case and spaces.",
        "Write a Python class Stack with push, pop and peek methods.",
    ],
    "math": [
        "What is 17 multiplied by 23? Explain step by step.",
        "Solve for x: 3x + 7 = 22. Show your work.",
        "A train travels 120 km in 2 hours. What is its average speed in km per hour?",
    ],
    "chat": [
        "Give me three tips for sleeping better.",
        "What is the capital of France, and what is it famous for?",
        "Explain in two sentences why the sky is blue.",
    ],
}


@dataclass
class Run:
    method: str
    category: str
    prompt: int
    token_ids: list[int]
    seconds: float
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    rejected_steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    idle_s: float = 0.0       # async: the verifier waited for a tree (a sequence active)
    wall_s: float = 0.0       # async: the verifier's wall time over the request


# -- methods: each maps (prompt_ids, max_tokens) -> Run fields ---------------------------------
def ours(engine, mode: str, spec_len: int, tree_width: int, proposer: str = "model"):
    from cluster.local import speculation_for
    from speculation.requests import GenerationRequest
    from models import SamplingParams

    if mode == "auto":
        from speculation.requests import SpeculationOptions

        spec = SpeculationOptions(mode="auto", spec_len=spec_len, tree_width=tree_width, proposer=proposer)
    else:
        spec = speculation_for(mode, spec_len, tree_width, proposer)

    def run(prompt_ids: list[int], max_tokens: int) -> dict:
        request = GenerationRequest("bench", prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                    spec)
        start = time.perf_counter()
        out = engine.generate([request])[0]
        seconds = time.perf_counter() - start
        st = out.stats
        return dict(token_ids=out.token_ids, seconds=seconds, drafted=st.num_drafted, accepted=st.num_accepted,
                    steps=st.num_steps, rejected_steps=st.num_rejected_steps, draft_s=st.draft_s,
                    verify_s=st.verify_s)
    return run


class _Calls:
    """Counts forward calls of a Hugging Face model (verification steps, draft steps)."""

    def __init__(self, model) -> None:
        self.n = 0
        model.register_forward_hook(lambda *_: setattr(self, "n", self.n + 1))


def hf(target_hf, draft_hf=None, spec_len: int = 4, eos_token_ids=()):
    target_calls = _Calls(target_hf)
    draft_calls = _Calls(draft_hf) if draft_hf is not None else None
    if draft_hf is not None:
        cfg = draft_hf.generation_config
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = spec_len, "constant"
        cfg.assistant_confidence_threshold = 0.0

    def run(prompt_ids: list[int], max_tokens: int) -> dict:
        ids = torch.tensor([prompt_ids])
        kwargs = dict(do_sample=False, max_new_tokens=max_tokens, attention_mask=torch.ones_like(ids),
                      eos_token_id=list(eos_token_ids) or None, pad_token_id=0)
        if draft_hf is not None:
            kwargs.update(assistant_model=draft_hf)
        t0, d0 = target_calls.n, draft_calls.n if draft_calls else 0
        start = time.perf_counter()
        with torch.inference_mode():
            out = target_hf.generate(ids, **kwargs)[0, len(prompt_ids):].tolist()
        seconds = time.perf_counter() - start
        if draft_hf is None:
            return dict(token_ids=out, seconds=seconds)
        steps, drafted = target_calls.n - t0, draft_calls.n - d0
        return dict(token_ids=out, seconds=seconds, steps=steps, drafted=drafted,
                    accepted=max(len(out) - steps, 0))
    return run


# -- costs of one step, for the Eq. 3.2 prediction ---------------------------------------------
def forward_ms(model, prefix_len: int, num_tokens: int, repeats: int = 7, logit_rows=None) -> float:
    """Median wall time of one forward of `num_tokens` (a chain) after a prefix, in ms.

    With `logit_rows` (a draft's reduced head) the rows are selected once, as the
    proposer does, and applied to the hidden states with the proposer's packed head.
    """
    from models.linear import PackedWeight
    from models.transformer import causal_mask

    head = pack = None
    if logit_rows is not None:
        head, pack = model.lm_head_weight.index_select(0, logit_rows), PackedWeight(transposed_gemv=True)
        one_row = torch.zeros(1, dtype=torch.long)

    cache = model.new_cache(-(-(prefix_len + num_tokens) // 16) + 1, 16)
    cache.add_sequence("c")
    ids = torch.randint(0, model.config.vocab_size, (1, prefix_len + num_tokens))
    feats = {}
    if getattr(model, "needs_features", False):     # an EAGLE head reads a feature per token
        feats = {"features": torch.randn(1, prefix_len + num_tokens, model.config.hidden_size)}
    with torch.inference_mode():
        model(ids[:, :prefix_len], torch.arange(prefix_len)[None], cache, ["c"], causal_mask(1, prefix_len),
              logit_positions=torch.tensor([prefix_len - 1]),
              **{k: v[:, :prefix_len] for k, v in feats.items()})
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            args = (ids[:, prefix_len:], torch.arange(prefix_len, prefix_len + num_tokens)[None], cache, ["c"],
                    causal_mask(1, num_tokens))
            if head is None:
                model(*args, **{k: v[:, prefix_len:] for k, v in feats.items()})
            else:
                _, hidden = model(*args, logit_rows=one_row, logit_positions=one_row, return_hidden=True,
                                  **{k: v[:, prefix_len:] for k, v in feats.items()})
                pack.matmul(hidden, head, None)
            times.append(time.perf_counter() - start)
            cache.truncate("c", prefix_len)
    return 1000 * statistics.median(times)


def measure_costs(engine, spec_len: int, tree_width: int, prefix_len: int, eagle_engine=None) -> dict:
    costs = {"target_1": forward_ms(engine.target, prefix_len, 1),
             "verify_chain": forward_ms(engine.target, prefix_len, spec_len + 1),
             "verify_tree": forward_ms(engine.target, prefix_len, spec_len * tree_width + 1)}
    for prefix, e in (("draft", engine), ("eagle", eagle_engine)):
        if e is not None and e.draft is not None:
            rows = None if e.draft_logit_rows is None else torch.tensor(e.draft_logit_rows)
            costs[f"{prefix}_1"] = forward_ms(e.draft, prefix_len, 1, logit_rows=rows)
            costs[f"{prefix}_level"] = forward_ms(e.draft, prefix_len, tree_width, logit_rows=rows)
    return costs


def predicted_speedup(method: str, gamma: float, mean_len: float, costs: dict, K: int) -> float | None:
    """Eq. 3.2 tokens per step over the step's cost in target decoding steps.

    Not for ngram: it drafts only where a match exists, which Eq. 3.2 does not model.
    """
    from speculation.planner import expected_tokens

    expected = expected_tokens(gamma, K)
    draft = "eagle" if method.startswith("eagle") else "draft"
    if method.endswith("-chain") and f"{draft}_1" in costs:
        step = K * costs[f"{draft}_1"] + costs["verify_chain"]
    elif method.endswith("-tree") and f"{draft}_level" in costs:
        expected = mean_len
        step = costs[f"{draft}_1"] + (K - 1) * costs[f"{draft}_level"] + costs["verify_tree"]
    else:
        return None
    return expected * costs["target_1"] / step


def inrun_prediction(method: str, gamma: float, mean_len: float, mine: list, runs: list, K: int):
    """The same model with the step costs the runs themselves measured (draft_s and verify_s
    per step, against `off`'s time per token): what is left is overhead outside the step."""
    off = [r for r in runs if r.method == "off"]
    steps = sum(r.steps for r in mine)
    if method not in ("sync-chain", "sync-tree", "eagle-chain", "eagle-tree") or not off or not steps:
        return None
    expected = (1 - gamma ** (K + 1)) / (1 - gamma) if method.endswith("-chain") and gamma < 1 else mean_len
    step_s = sum(r.draft_s + r.verify_s for r in mine) / steps
    off_s = sum(r.seconds for r in off) / sum(len(r.token_ids) for r in off)
    return expected * off_s / step_s


# -- summary -----------------------------------------------------------------------------------
def summarize(runs: list[Run], methods: list[str], costs: dict, K: int) -> list[dict]:
    """One row per method: throughput, speedups, acceptance and the Eq. 3.2 predictions."""
    base = {(r.category, r.prompt): r.token_ids for r in runs if r.method == "off"}
    tps_off = _tps([r for r in runs if r.method == "off"])
    rows = []
    for m in methods:
        mine = [r for r in runs if r.method == m]
        drafted, accepted = sum(r.drafted for r in mine), sum(r.accepted for r in mine)
        steps, rejected = sum(r.steps for r in mine), sum(r.rejected_steps for r in mine)
        gamma = accepted / (accepted + rejected) if accepted + rejected else 0.0
        mean_len = (accepted + steps) / steps if steps else 1.0
        tps = _tps(mine)
        pred = predicted_speedup(m, gamma, mean_len, costs, K) if drafted else None
        pred_inrun = inrun_prediction(m, gamma, mean_len, mine, runs, K) if drafted else None
        rows.append({
            "method": m, "tokens_per_s": tps, "speedup": tps / tps_off if tps_off else 0.0,
            "by_category": {c: _tps([r for r in mine if r.category == c]) / max(
                _tps([r for r in runs if r.method == "off" and r.category == c]), 1e-9) for c in PROMPTS},
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_len": mean_len if drafted else None,
            "gamma": gamma if m.startswith(("sync", "eagle", "async")) or m == "ngram" else None,
            "verifier_idle_fraction": (sum(r.idle_s for r in mine) / max(sum(r.wall_s for r in mine), 1e-9)
                                       if m.startswith("async") else None),
            "predicted_speedup": pred,
            "predicted_speedup_inrun": pred_inrun,
            "exact_vs_off": sum(base.get((r.category, r.prompt)) == r.token_ids for r in mine) / len(mine),
            "tokens": sum(len(r.token_ids) for r in mine), "seconds": sum(r.seconds for r in mine),
        })
    return rows


def _tps(runs: list[Run]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(len(r.token_ids) for r in runs) / seconds if seconds else 0.0


def markdown_table(rows: list[dict]) -> str:
    f = common.cell
    header = ["method", "tokens/s", "speedup", "code", "math", "chat", "acceptance", "mean accepted len", "γ",
              "Eq. 3.2 predicted speedup (microbench / in-run costs)", "verifier idle", "exact vs off"]
    return common.markdown_table(header, [
        [r["method"], f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}×",
         *(f"{r['by_category'][c]:.2f}×" for c in ("code", "math", "chat")),
         f(r["acceptance_rate"], ".2f"), f(r["mean_accepted_len"], ".2f"), f(r["gamma"], ".2f"),
         f"{f(r['predicted_speedup'], '.2f')} / {f(r.get('predicted_speedup_inrun'), '.2f')}",
         f(r.get("verifier_idle_fraction"), ".1%"), f"{r['exact_vs_off']:.0%}"] for r in rows])


def load_peer(parser, path: Path, max_tokens: int) -> list[Run]:
    """The runs of a bench/vllm_peer.py file, checked to be on our prompts and token budget."""
    import json

    try:
        info = json.loads(path.read_text())
        runs = [Run(**r) for r in info["runs"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--peer {path}: not a bench/vllm_peer.py results file ({e})")
    theirs = int(info.get("args", {}).get("max_tokens", max_tokens))
    if theirs != max_tokens:
        parser.error(f"--peer {path}: generated {theirs} tokens per prompt, this run --max-tokens {max_tokens}")
    return runs


def peer_line(rows: list[dict], peer_methods: list[str], path: Path) -> str:
    """Our best method against the peer's best speculative one, tokens/s."""
    ours_rows = [r for r in rows if r["method"] not in peer_methods and not r["method"].startswith("hf-")]
    theirs = [r for r in rows if r["method"] in peer_methods and r["method"] != "vllm-target"]
    if not ours_rows or not theirs:
        return f"peer {path.name}: nothing to compare"
    a, b = max(ours_rows, key=lambda r: r["tokens_per_s"]), max(theirs, key=lambda r: r["tokens_per_s"])
    return (f"best of ours {a['method']} {a['tokens_per_s']:.1f} tokens/s against the peer's best speculative "
            f"{b['method']} {b['tokens_per_s']:.1f}: {a['tokens_per_s'] / b['tokens_per_s']:.2f}× "
            f"(the peer's rows from {path.name}, run apart in the same sitting)")


# -- the run -----------------------------------------------------------------------------------
def build_methods(args, pair, hf_target, hf_draft, eagle_engine=None) -> dict:
    """name -> runner; the async pipeline plugs in here as one more entry."""
    engine, eos = pair.engine, sorted(pair.engine.eos_token_ids)
    methods = {"off": ours(engine, "off", args.spec_len, 1)}
    if engine.draft is not None:
        methods["sync-chain"] = ours(engine, "sync", args.spec_len, 1)
        methods["sync-tree"] = ours(engine, "sync", args.spec_len, args.tree_width)
        methods["sync-auto"] = ours(engine, "auto", args.spec_len, 1)
    if eagle_engine is not None:
        methods["eagle-chain"] = ours(eagle_engine, "sync", args.spec_len, 1)
        methods["eagle-tree"] = ours(eagle_engine, "sync", args.spec_len, args.tree_width)
        methods["eagle-auto"] = ours(eagle_engine, "auto", args.spec_len, 1)
    methods["ngram"] = ours(engine, "sync", args.spec_len, 1, "ngram")
    if not args.no_hf:
        methods["hf-target"] = hf(hf_target, eos_token_ids=eos)
        if hf_draft is not None:
            methods["hf-assisted"] = hf(hf_target, hf_draft, args.spec_len, eos_token_ids=eos)
    wanted = lambda m: not args.methods or m in args.methods   # noqa: E731
    pipelines = {"async": args.draft if engine.draft is not None else None,
                 "async-eagle": args.eagle if eagle_engine is not None else None,
                 # the layered pipeline exchanging by actor call instead of its socket: only when named
                 "async-actor": args.draft if engine.draft is not None and "async-actor" in (args.methods or ())
                 else None}
    pipelines = {m: d for m, d in pipelines.items() if d and wanted(m) and not args.no_async}
    if pipelines:
        from bench import e2e_async     # starts a local Ray: two CPUs a pipeline

        settings = e2e_async.pipeline_settings(args.one_core_each, args.bridge_depth,
                                                  getattr(args, 'restart_depth', None))
        methods |= e2e_async.pipeline_methods(args.target, pipelines, args.spec_len, settings)
    return {m: fn for m, fn in methods.items() if wanted(m)}


def prompt_ids(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(chat, add_special_tokens=False)["input_ids"])


def run_all(methods: dict, tokenizer, max_tokens: int, prompts_per_category: int) -> list[Run]:
    from tqdm import tqdm

    work = [(c, i, prompt_ids(tokenizer, text)) for c, texts in PROMPTS.items()
            for i, text in enumerate(texts[:prompts_per_category])]
    names = list(methods)
    for name in names:                                        # warm-up: first calls pay one-off costs
        methods[name](work[0][2], 4)
    runs = []
    with tqdm(total=len(work) * len(names), desc="e2e", unit="run") as bar:
        for k, (category, i, ids) in enumerate(work):
            for name in names[k % len(names):] + names[:k % len(names)]:   # rotate the order
                bar.set_postfix_str(f"{category}#{i} {name}")
                runs.append(Run(name, category, i, **methods[name](ids, max_tokens)))
                bar.update()
    return runs


def update_readme(table: str, info: dict, args) -> None:
    path = ROOT / "README.md"
    tag = "e2e-one-core" if getattr(args, "one_core_each", False) else "e2e"    # a table of its own
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    text = path.read_text() if path.exists() else ""
    block = (f"{begin}\n{table}\n\nMachine: {info['machine']['cpu']}, {info['machine']['threads']} threads, "
             f"torch {info['machine']['torch']}; {info['date']}; K = {args.spec_len}, tree width = "
             f"{args.tree_width}, {args.max_tokens} new tokens per prompt, "
             f"{args.prompts} prompts per category"
             f"{'; every model on one core, none lent (--one-core-each)' if tag != 'e2e' else ''}"
             f"{f'; async bridge_depth {args.bridge_depth}' if getattr(args, 'bridge_depth', None) else ''}"
             f"{f'; async restart_depth {args.restart_depth}' if getattr(args, 'restart_depth', None) is not None else ''}"
             f".\n{end}")
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text += "\n" + block + "\n"
    path.write_text(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--max-tokens", type=common.positive_int, default=64)
    p.add_argument("--spec-len", type=common.positive_int, default=4)
    p.add_argument("--tree-width", type=common.positive_int, default=2)
    p.add_argument("--prompts", type=common.positive_int, default=3, help="prompts per category (at most 3)")
    p.add_argument("--threads", type=common.positive_int, default=2)
    p.add_argument("--methods", nargs="*", help="a subset of the methods (default: all)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    p.add_argument("--no-async", action="store_true", help="skip the async pipeline (no Ray started)")
    p.add_argument("--eagle", help="an EAGLE draft head for the eagle-* methods (default: the embedded one "
                                   "with the embedded pair; 'none' to skip)")
    p.add_argument("--one-core-each", action="store_true",
                   help="every model on one core, none lent: --threads 1 and the pipeline kept overlapped "
                        "(bench/e2e_async.py's module doc)")
    p.add_argument("--bridge-depth", type=int, default=None,
                   help="the pipeline's bridge_depth (draft tokens a bridge step verifies; default: its own)")
    p.add_argument("--restart-depth", type=int, default=None,
                   help="the pipeline's restart_depth (restart tree after a contradicted outcome, 0 = "
                        "bridge, -1 = a lone overlapped stream restarts with up to 3; default: its own)")
    p.add_argument("--out", type=Path, default=common.RESULTS, help="the folder for e2e-<time>.json")
    p.add_argument("--readme", action="store_true", help="write the table into bench/README.md")
    p.add_argument("--peer", type=Path, help="a bench/vllm_peer.py results file: its rows printed beside ours")
    return p


def load_models(args):
    """The engines and Hugging Face models every method is built from: (pair, eagle_engine, hf_target,
    hf_draft), the last three None where not asked for."""
    from cluster.local import build_engine

    pair = build_engine(args.target, args.draft, spec_len=args.spec_len, tree_width=args.tree_width)
    eagle_engine = None
    if args.eagle and args.eagle != "none":
        from cluster.local import InProcessEngine
        from models import load_model
        from models.pair import read_logit_rows

        e = pair.engine             # the same target object: only the draft differs
        eagle_engine = InProcessEngine(e.target, load_model(args.eagle), spec_len=args.spec_len,
                                       tree_width=args.tree_width,
                                       draft_logit_rows=read_logit_rows(args.eagle, e.target.config.vocab_size),
                                       eos_token_ids=sorted(e.eos_token_ids))
    hf_target = hf_draft = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM
        hf_target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        if args.draft:
            hf_draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    return pair, eagle_engine, hf_target, hf_draft


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    peer = load_peer(p, args.peer, args.max_tokens) if args.peer else []
    if args.eagle is None and args.target is None:
        from models import embedded
        args.eagle = str(embedded.eagle_dir()) if (embedded.ASSETS / embedded.EAGLE_WEIGHTS).is_file() else None
    args.target, args.draft = common.model_pair(p, args, draft_optional=True)   # a lone --target: no draft
    if args.one_core_each:
        args.threads = 1
    torch.set_num_threads(args.threads)
    pair, eagle_engine, hf_target, hf_draft = load_models(args)
    methods = build_methods(args, pair, hf_target, hf_draft, eagle_engine)
    pipeline = None
    try:
        runs = run_all(methods, pair.tokenizer, args.max_tokens, args.prompts)
        if "async" in methods:          # how its forwards ran: on its own core or on the drafter's too
            final = methods["async"].stats()
            pipeline = {"borrowed_steps": final.get("borrowed_steps", 0),
                        "target_forwards": final.get("num_batches", 0), "costs": final.get("costs")}
            print(f"async: verifier forwards on the drafter's core too: {pipeline['borrowed_steps']} "
                  f"of {pipeline['target_forwards']}")
    finally:
        for m in ("async", "async-eagle", "async-actor"):
            if m in methods:
                methods[m].close()      # its actors (the last one the Ray started for them)
    report(args, runs, peer, list(methods), pair, eagle_engine, pipeline)
    return 0


def report(args, runs: list, peer: list, method_names: list[str], pair, eagle_engine, pipeline) -> None:
    """Price the steps, print the table (with the peer's rows), write the JSON and, with --readme, the
    README's table."""
    mean_prompt = int(statistics.mean(len(prompt_ids(pair.tokenizer, t)) for ts in PROMPTS.values() for t in ts))
    costs = measure_costs(pair.engine, args.spec_len, args.tree_width, mean_prompt + args.max_tokens // 2,
                          eagle_engine)
    peer_methods = list(dict.fromkeys(r.method for r in peer))
    rows = summarize(runs + peer, method_names + peer_methods, costs, args.spec_len)
    table = markdown_table(rows)
    print(table)
    if peer:
        print(peer_line(rows, peer_methods, args.peer))
    print("costs (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    info = {"date": common.utc(), "machine": common.machine(),
            "args": {k: str(v) for k, v in vars(args).items()}, "costs_ms": costs, "summary": rows,
            "async_pipeline": pipeline, "runs": [asdict(r) for r in runs]}
    suffix = "-one-core" if args.one_core_each else ""
    out = common.write_json(args.out / f"e2e-{common.utc('%Y%m%d-%H%M%S')}{suffix}.json", info)
    print(f"wrote {out}")
    if args.readme:
        update_readme(table, info, args)


if __name__ == "__main__":
    sys.exit(main())
