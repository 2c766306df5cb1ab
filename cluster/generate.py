"""`specflash generate`: one request, in every mode, with the same flags and the same JSON.

`--mode off` is the target alone and `--mode sync` draft-then-verify, both in process
(`cluster.local.InProcessEngine`); `--mode async` starts a local Ray and one pipeline of
drafter and verifier actors (`cluster.pipeline`). Every mode drafts with a draft model, an
EAGLE head (`--proposer eagle`: the embedded one; or name one with --draft) or prompt lookup. Without --target / --draft it uses the
embedded pair (`models.embedded`). Errors are raised as ValueError / OSError / RuntimeError
with a message fit for a user (cluster/cli.py prints them).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass

from models.sampling import SamplingParams
from speculation.requests import GenerationRequest, SpeculationOptions


class CliError(Exception):
    """A user-facing error: printed as `error: <message>`."""


@dataclass
class _Plan:
    target_dir: str
    draft_dir: str | None
    needs_draft: bool


def run_generate(args) -> int:
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    if args.mode == "async":
        return _run_async(args, params)
    from cluster.local import build_engine, speculation_for

    speculation = speculation_for(args.mode, args.spec_len, args.tree_width,
                                  "model" if args.proposer == "eagle" else args.proposer)
    plan = _resolve_dirs(args)
    pair = build_engine(plan.target_dir, plan.draft_dir, spec_len=args.spec_len,
                        tree_width=args.tree_width, load_draft=plan.needs_draft)
    prompt_ids = _tokenize(pair.tokenizer, args.prompt, args.chat)
    out = pair.engine.generate([GenerationRequest("cli", prompt_ids, params, speculation)])[0]
    text = pair.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    _print(args, text, out.token_ids, pair.target_dir, pair.draft_dir, out.stats.summary(), out.finish_reason)
    return 0


def _run_async(args, params: SamplingParams) -> int:
    """A local Ray, one pipeline, one request."""
    import ray

    from cluster.pipeline import build_pipeline_engine
    from models import load_tokenizer

    proposer = "model" if args.proposer == "eagle" else args.proposer
    spec = SpeculationOptions(mode="tree" if args.tree_width > 1 else "chain", spec_len=args.spec_len,
                              tree_width=args.tree_width, proposer=proposer)
    plan = _resolve_dirs(args)
    target_dir, draft_dir = plan.target_dir, plan.draft_dir
    tokenizer = load_tokenizer(target_dir)
    prompt_ids = _tokenize(tokenizer, args.prompt, args.chat)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    engine = None
    try:
        # the text is printed when the request ends: no chunk between its first and its last
        # (each costs the verifier's step: `EngineSettings.stream_interval`)
        engine = build_pipeline_engine(None, target_dir=target_dir, draft_dir=draft_dir,
                                       spec_len=args.spec_len, tree_width=args.tree_width, proposer=proposer,
                                       stream_interval=max(1, args.max_tokens))
        start = time.perf_counter()
        tokens, last = asyncio.run(_collect(engine, GenerationRequest("cli", prompt_ids, params, spec)))
        seconds = time.perf_counter() - start
        if last is not None and last.finish_reason == "error":
            raise RuntimeError(last.error)
        stats = asyncio.run(engine.stats())
    finally:
        if engine is not None:
            engine.kill_pipeline_actors()
        ray.shutdown()
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    drafted, accepted = last.num_drafted, last.num_accepted
    summary = {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0,
               "mean_accepted_len": stats["mean_accepted_len"],
               "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0,
               "verifier_idle_fraction": stats["verifier_idle_fraction"]}
    _print(args, text, tokens, target_dir, draft_dir, summary, last.finish_reason)
    return 0


def _print(args, text: str, token_ids: list[int], target_dir, draft_dir, stats: dict, finish: str) -> None:
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "target": target_dir, "draft": draft_dir,
                          "stats": stats}))
        return
    print(text)
    extra = "".join(f", {k.replace('_', ' ')} {stats[k]:.2f}" for k in ("mean_accepted_len", "verifier_idle_fraction")
                    if k in stats)
    print(f"[{len(token_ids)} tokens, {stats['tokens_per_s']:.1f} tokens/s, mode {args.mode}, acceptance "
          f"{stats['acceptance_rate']:.2f}{extra}, finish: {finish}]", file=sys.stderr)


async def _collect(engine, request: GenerationRequest):
    tokens, last = [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        last = chunk
    return tokens, last


def _resolve_dirs(args) -> _Plan:
    """The checkpoint directories to use; the embedded pair when none is named."""
    needs_draft = args.mode in ("sync", "async") and args.proposer in ("model", "eagle")
    if args.proposer == "eagle" and (args.target is not None or args.draft is not None):
        raise CliError("--proposer eagle picks the embedded EAGLE draft head; with --target, name an EAGLE "
                       "head with --draft and keep --proposer model")
    if args.target is None and args.draft is not None:
        raise CliError("--draft needs --target (the draft must match a named target)")
    if args.target is not None:
        if needs_draft and args.draft is None:
            raise CliError(f"--mode {args.mode} with the model proposer needs --draft; "
                           "or use --proposer ngram, or --mode off")
        return _Plan(args.target, args.draft, needs_draft)
    from models import embedded

    try:
        if needs_draft and args.proposer == "eagle":
            return _Plan(str(embedded.target_dir()), str(embedded.eagle_dir()), True)
        if needs_draft:
            target, draft = embedded.default_pair()
            return _Plan(str(target), str(draft), True)
        return _Plan(str(embedded.target_dir()), None, False)
    except embedded.EmbeddedModelError as e:
        raise CliError(f"the embedded model pair is not available: {e}") from e


def _tokenize(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise CliError("--chat: the target's tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
