"""The in-process engine: the one scheduler with its drafter in the same process (no Ray).

`InProcessEngine` is `verifier.loop.EngineLoop` over a `verifier.scheduler.Scheduler` whose
drafter (`drafter.runtime.Drafter`) is pumped before each step (`verifier.inprocess`):
classic draft-then-verify (Leviathan et al. 2023; Chen et al. 2023), with EAGLE-2 trees (Li
et al. 2024) when the width is above 1, an EAGLE draft head reading the target's features,
or prompt lookup. It serves two ways:

- `generate(requests)`: blocking, every request to its end in one batch (the CLI's
  `--mode sync`, the benchmarks), on the caller's thread, with caches sized for the batch;
- the `speculation.requests.Engine` protocol (`generate(request)` as an async iterator,
  `abort`, `health`, `stats`): continuous batching on the caller's event loop, forwards on a
  model thread (`specflash serve --engine local`).

Modes per request: "off" is the target alone, "chain" / "tree" fixed shapes, "auto" the
planner's depth per sequence each step (speculation/planner.py, draft and verification
taking turns), with the verifier's own prompt lookup where the draft model is off
(verifier/lookup.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from models.kv_cache import prefix_report
from speculation.requests import GenerationChunk, GenerationOutput, GenerationRequest, InvalidRequest, \
    SpeculationOptions, error_chunk, resolve_speculation
from speculation.settings import MAX_SPEC_LEN, MAX_TREE_WIDTH, EngineSettings, check_speculation


class InProcessEngine:
    def __init__(self, target, draft=None, *, settings: EngineSettings | None = None, spec_len: int = 4,
                 tree_width: int = 1, max_nodes: int | None = None, draft_logit_rows: Sequence[int] | None = None,
                 eos_token_ids: Sequence[int] | None = None, lookup: bool = True, num_blocks: int | None = None,
                 block_size: int = 16) -> None:
        """`target` / `draft`: loaded `models.Transformer`s (the draft may be an EAGLE head).
        `settings`: the whole engine settings (else built from the keywords); `num_blocks`:
        fixed KV caches (None: sized for each blocking `generate` call)."""
        from drafter.draft_side import DraftSide, model_proposer
        from drafter.runtime import Drafter
        from verifier.inprocess import InProcessDrafters
        from verifier.loop import EngineLoop
        from verifier.scheduler import Scheduler
        from verifier.target import TargetSide

        check_speculation(spec_len, tree_width)
        base = dict(spec_len=spec_len, tree_width=tree_width, lookup=lookup, block_size=block_size,
                    num_cpus=torch.get_num_threads(), num_blocks=num_blocks or 1)
        settings = settings or EngineSettings(**base)
        # a drafter in this process drafts while the target waits: one tree in flight, and a
        # tree not there after the drafter's turn is not coming
        settings = settings.model_copy(update=dict(ring_slots=1, max_tree_wait_s=0.0,
                                                   proposers=("model", "ngram") if draft is not None else ("ngram",)))
        self.settings, self.fixed_blocks = settings, num_blocks is not None
        self.target, self.draft, self.draft_logit_rows = target, draft, draft_logit_rows
        eagle = bool(getattr(draft, "needs_features", False))
        vocab = target.config.vocab_size
        self.max_context = target.config.max_position_embeddings
        self.side = TargetSide("", settings.num_blocks, settings.block_size, features=eagle, model=target,
                               prefix_caching=settings.prefix_caching, feature_layers=getattr(draft, "aux_layers", ()))
        model = None if draft is None else model_proposer(draft, vocab, settings, logit_rows=draft_logit_rows,
                                                          tree_width=tree_width, max_nodes=max_nodes)
        side = DraftSide.build(None, vocab, settings, model)
        self.proposer = side.model
        self.drafter = Drafter(0, side, settings)
        eos = target.config.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.scheduler = Scheduler(self.side, settings, eos_ids=eos)
        self.drafters = InProcessDrafters([self.drafter], settings.num_cpus)
        self.loop = EngineLoop(self.scheduler, self.drafters)
        self.drafters.attach(self.scheduler)
        if self.fixed_blocks:    # warm up now (a GPU captures every planner shape too); caches sized
            # per call would drop the graphs with the cache they were captured on: those stay lazy
            self.side.warm_up(settings.spec_len, width=settings.tree_width)
            side.warm_up(settings.spec_len)

    @property
    def eos_token_ids(self) -> set[int]:
        return self.scheduler.eos_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.scheduler.eos_ids = set(ids)

    # -- blocking --------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Run the requests to completion as one batch; outputs in request order. Raises
        `InvalidRequest` (nothing runs) when any request cannot be served."""
        if len({r.request_id for r in requests}) != len(requests):
            raise InvalidRequest("request ids must be unique within one generate call")
        if self.scheduler.streams:
            raise RuntimeError("the engine is serving requests; a blocking generate must wait for them")
        if not self.fixed_blocks:
            self._size_caches(requests)
        return asyncio.run(self._run_all(requests))

    async def _run_all(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        self.loop.inline = True
        streams = []
        try:
            for r in requests:
                streams.append(self.scheduler.add(r.request_id, list(r.prompt_token_ids), r.sampling,
                                                  r.speculation, lambda chunk: None, r.prefix_cache))
            while any(s.request_id in self.scheduler.streams for s in streams):
                await self.loop.step()
        finally:
            for s in streams:
                self.scheduler.abort(s.request_id)
            await self.loop.admit()         # free what the last step finished
            self.drafters.settle(self.scheduler)
            self.loop.inline = False
        return [GenerationOutput(s.request_id, list(s.prompt), s.output, s.finish_reason or "length", s.stats,
                                 logprobs=s.logprobs if s.params.logprobs is not None else None,
                                 prompt_logprobs=s.prompt_logprobs)
                for s in streams]

    def _size_caches(self, requests: Sequence[GenerationRequest]) -> None:
        """Caches big enough for every request of the batch at its longest, grown when needed."""
        bs = self.settings.block_size
        tree = MAX_SPEC_LEN * MAX_TREE_WIDTH + MAX_SPEC_LEN + 2
        need = sum(-(-(len(r.prompt_token_ids) + r.sampling.max_tokens + tree) // bs) + 1 for r in requests)
        if need <= self.side.cache.num_blocks:
            return
        self.side.verifier.cache = self.target.new_cache(need, bs, self.side.cache.prefix_caching)
        self.settings.num_blocks = need
        if self.proposer is not None:
            # the draft's first catch-up pads every row to the longest prompt of the batch
            longest = max(len(r.prompt_token_ids) for r in requests)
            self.proposer.cache = self.draft.new_cache(need + len(requests) * (-(-longest // bs) + 1), bs,
                                                       self.proposer.cache.prefix_caching)

    # -- the Engine protocol ----------------------------------------------------------------
    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        async for chunk in self.loop.generate(request.request_id, list(request.prompt_token_ids),
                                              request.sampling, request.speculation, request.prefix_cache):
            yield chunk

    async def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    async def health(self) -> dict:
        h = self.scheduler.health()
        return {**h, "speculation": self.draft is not None or h["speculation"], "engine": "local",
                "max_context": self.max_context, "running": len(self.scheduler.active()),
                "waiting": len(self.scheduler.joins)}

    async def stats(self) -> dict:
        out = self.scheduler.report()
        cache = self.side.cache
        out.update(kv_blocks_free=cache.num_free_blocks, kv_blocks_total=cache.num_blocks,
                   drafters=[{"index": 0, **self.drafter.stats.as_dict()}])
        if self.proposer is not None:
            out.update(prefix_report([self.proposer.cache.prefix_stats()], "draft_"))
        return out

    def shutdown(self) -> None:
        self.loop.close()


class LocalEngine:
    """An `InProcessEngine` behind the `speculation.requests.Engine` protocol (serving/).

    The engine runs on an `verifier.loop.EngineThread`, as the verifier actor's does: its steps
    (forwards included) never hold up the caller's loop, and its work (freeing an aborted
    request's KV blocks, say) goes on whatever the callers' loops do. Chunks cross to the
    caller's loop as they come. `build()` makes the engine on that thread, which then runs its
    models: one OpenMP team (verifier/loop.py)."""

    def __init__(self, build: Callable[[], InProcessEngine]) -> None:
        from verifier.loop import EngineThread

        self.thread = EngineThread("specflash-local-engine")
        self.engine = self.thread.build(self._build(build))

    @staticmethod
    async def _build(build: Callable[[], InProcessEngine]) -> InProcessEngine:
        engine = build()
        engine.loop.inline = True            # this thread is the model's
        return engine

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Refuses at once (`InvalidRequest`) a request naming a proposer this engine lacks; any
        other request it cannot serve ends with one error chunk."""
        e = self.engine
        resolve_speculation(request.speculation, e.settings, e.settings.proposers)
        return self.thread.stream(self._chunks(request))

    async def _chunks(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The request's chunks, on the engine's loop."""
        try:
            async for chunk in self.engine.generate_stream(request):
                yield chunk
        except InvalidRequest as err:
            yield error_chunk(request.request_id, str(err))

    async def abort(self, request_id: str) -> None:
        await self.thread.run(self.engine.abort(request_id))

    async def health(self) -> dict:
        return await self.thread.run(self.engine.health())

    async def stats(self) -> dict:
        return await self.thread.run(self.engine.stats())

    def shutdown(self) -> None:
        """The engine's loop task ended, then its thread."""
        self.thread.close(self.engine.loop)


def speculation_for(mode: str, spec_len: int, tree_width: int, proposer: str = "model") -> SpeculationOptions:
    """CLI-style flags (--mode off|sync, --spec-len, --tree-width, --proposer) as per-request options."""
    if mode == "off":
        return SpeculationOptions(mode="off", proposer=proposer)
    if mode != "sync":
        raise ValueError(f"mode must be 'off' or 'sync' in the in-process engine, got {mode!r}")
    check_speculation(spec_len, tree_width)
    return SpeculationOptions(mode="tree" if tree_width > 1 else "chain", spec_len=spec_len,
                              tree_width=tree_width, proposer=proposer)


# -- building an engine from checkpoint directories ---------------------------------------
@dataclass
class LoadedPair:
    engine: InProcessEngine
    tokenizer: object                     # transformers tokenizer of the target
    target_dir: str
    draft_dir: str | None


def build_engine(target_dir, draft_dir=None, *, spec_len: int = 4, tree_width: int = 1,
                 max_nodes: int | None = None, load_draft: bool = True,
                 settings: EngineSettings | None = None) -> LoadedPair:
    """Load and check a (target, draft) pair of local HF checkpoint directories.

    Raises `models.ModelLoadError` / ValueError with a message fit for a user: missing or
    non-HF directories, vocabularies or tokenizers that disagree, speculation settings out
    of range. `settings`: the engine's settings (a served engine: fixed caches of
    `settings.num_blocks`); None = sized per blocking call.
    """
    from models import load_model, load_tokenizer
    from models.loader import ModelLoadError, load_config
    from models.pair import check_vocabularies, eos_token_ids, read_logit_rows

    check_speculation(spec_len, tree_width)
    target_dir = str(Path(target_dir).expanduser().resolve())
    target_config = load_config(target_dir)
    try:
        tokenizer = load_tokenizer(target_dir)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {target_dir}: {e}") from e
    draft, logit_rows = None, None
    if draft_dir is not None:
        draft_dir = str(Path(draft_dir).expanduser().resolve())
        draft_config = load_config(draft_dir)
        check_vocabularies(target_dir, target_config, tokenizer, draft_dir, draft_config)
        logit_rows = read_logit_rows(draft_dir, target_config.vocab_size)
        if load_draft:
            draft = load_model(draft_dir)
    target = load_model(target_dir)
    engine = InProcessEngine(target, draft, settings=settings, spec_len=spec_len, tree_width=tree_width,
                             max_nodes=max_nodes, draft_logit_rows=logit_rows,
                             eos_token_ids=eos_token_ids(target_dir),
                             num_blocks=None if settings is None else settings.num_blocks)
    return LoadedPair(engine, tokenizer, target_dir, draft_dir)


def build_local_engine(target_dir: str, draft_dir: str | None, settings: EngineSettings | None = None,
                       ) -> tuple[LocalEngine, object]:
    """(LocalEngine, tokenizer) for a checkpoint pair, loaded in this process, with fixed caches
    of `settings.num_blocks` (default: `EngineSettings()`)."""
    settings = (settings or EngineSettings()).model_copy(update=dict(num_cpus=torch.get_num_threads()))
    pairs = []

    def build() -> InProcessEngine:
        pairs.append(build_engine(target_dir, draft_dir, spec_len=settings.spec_len, tree_width=settings.tree_width,
                                  load_draft=draft_dir is not None, settings=settings))
        return pairs[0].engine

    engine = LocalEngine(build)
    return engine, pairs[0].tokenizer
