"""The drafter's proposers driven on assumed prefixes (draft-ahead) with explicit rollback.

`DraftSide` holds the proposers a drafter drafts with, one per name: "model" (the draft
model, `ModelProposer`, or an EAGLE head, `EagleProposer`, each with its own KV cache) and
"ngram" (prompt lookup); each stream names its own. It drafts one level deeper than the tree
it sends: the extra level gives the drafter its guess of the bonus token (DESIGN.md §3 step 2)
and its K/V is needed for the next tree anyway, so it costs no extra forward in steady state.

`BridgeDraft` is the verifier's copy of the draft, for bridge chains (drafter/streams.py).
Both are built from checkpoint directories (or `random:` presets) inside the process that
drafts, so weights never travel.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from drafter.streams import cut_tree, greedy_outcome, reroot
from speculation.proposal import BridgeChain, DraftRequest
from speculation.settings import MAX_BRIDGE_DEPTH, MAX_SPEC_LEN, EngineSettings


DRAFT_LEVELS = MAX_SPEC_LEN + MAX_BRIDGE_DEPTH + 2   # a tree, its bonus guess, a bridge chain and its guess


def model_proposer(model, vocab: int, settings: EngineSettings, levels: int = DRAFT_LEVELS,
                   logit_rows=None, tree_width: int = 1, max_nodes: int | None = None):
    """A loaded draft model as a proposer with its own KV cache of `settings.num_blocks`, drafting
    up to `levels` deep: a `drafter.ModelProposer`, or a `drafter.EagleProposer` for a
    feature-conditioned head. `logit_rows`: its reduced LM head (`models.pair.read_logit_rows`)."""
    from drafter.eagle_proposer import EagleProposer
    from drafter.model_proposer import ModelProposer

    # an EAGLE head's K/V of a position depend on features, not only on the tokens before it
    # (predicted ones while it drafts ahead): its cache shares no prefixes
    eagle = getattr(model, "needs_features", False)
    cls = EagleProposer if eagle else ModelProposer
    cache = model.new_cache(settings.num_blocks, settings.block_size,
                            prefix_caching=settings.prefix_caching and not eagle)
    return cls(model, cache, levels, tree_width, max_nodes, logit_rows, vocab)


def draft_proposer(draft_dir: str, vocab: int, settings: EngineSettings, levels: int = DRAFT_LEVELS):
    """The draft checkpoint (or `random:` preset) `model_proposer` drafts with, read as every
    engine reads it: its reduced head, fp16 copies on a CPU."""
    from models.pair import read_logit_rows
    from models.presets import is_random, load

    model = load(draft_dir, settings.device, settings.dtype)
    rows = None if is_random(draft_dir) else read_logit_rows(draft_dir, vocab)
    return model_proposer(model, vocab, settings, levels, rows)


@dataclass
class DraftItem:
    """One stream's next tree, as the drafter's loop asks for it."""

    stream: str
    tokens: list[int]              # the prefix it is drafted after (committed + assumed tokens)
    params: object                 # models.SamplingParams
    generator: torch.Generator     # the drafter's own randomness for the stream
    depth: int                     # the tree's depth K (the budget)
    width: int                     # children per node
    epoch: int
    bridge: int = 0                # tokens the verifier's bridge step is assumed to commit first (0: none)
    proposer: str = "model"        # "model" | "ngram"


@dataclass
class Drafted:
    tree: object               # models.tree.TokenTree cut to the requested depth
    outcome: list[int] | None  # assumed committed tokens: greedy path + bonus guess
    bridge_tokens: list[int] | None = None   # bridge: the guessed tokens the tree is drafted after
    cached: list[int] | None = None   # tokens whose draft K/V were kept (the assumed path)


class DraftSide:
    """Proposers by name, drafted on assumed prefixes."""

    def __init__(self, proposers: dict, settings: EngineSettings) -> None:
        self.proposers = proposers        # {"model": ModelProposer | EagleProposer, "ngram": NgramProposer}
        self.settings = settings
        model = proposers.get("model")
        self.graphs = getattr(getattr(model, "model", None), "graphs", None)
        self.needs_features = bool(getattr(model, "needs_features", False))

    @classmethod
    def build(cls, draft_dir: str | None, vocab: int, settings: EngineSettings, model_proposer=None,
              wrap: Callable | None = None) -> DraftSide:
        """The proposers of `settings.proposers`: prompt lookup always, the draft model from
        `draft_dir` (or `model_proposer`, already built) where "model" is among them. `wrap`:
        applied to the model proposer (a benchmark's instrumented proposer, bench/replay.py)."""
        from drafter.ngram import NgramProposer

        proposers = {"ngram": NgramProposer(vocab, MAX_SPEC_LEN + 1)}
        if "model" in settings.proposers and (draft_dir is not None or model_proposer is not None):
            proposer = model_proposer if model_proposer is not None else draft_proposer(draft_dir, vocab, settings)
            proposers["model"] = wrap(proposer) if wrap is not None else proposer
        return cls(proposers, settings)

    @property
    def vocab_size(self) -> int:
        """V, the target's vocabulary, which every proposer drafts over."""
        return self.proposers["ngram"].vocab_size

    @property
    def model(self):
        """The model proposer (None when this side drafts by prompt lookup only)."""
        return self.proposers.get("model")

    @property
    def cache(self):
        return getattr(self.model, "cache", None)

    def propose(self, items: list[DraftItem], assume: bool = True) -> tuple[list[Drafted], float]:
        """One batched call per proposer drafts every item to depth + 1 (+ `bridge` more); each
        tree is cut to its depth and the extra level gives the bonus guess. A bridge tree is the
        subtree under the `bridge`-th node of the first-child path from the root, drafted after
        prefix + that path's tokens (drafter/streams.py). With `assume=False` (lockstep:
        nothing is drafted past a tree in flight) trees are drafted to their depth and carry
        no outcome. Returns the drafts, in item order, and the seconds the batch took."""
        start = time.perf_counter()
        out: list[Drafted | None] = [None] * len(items)
        groups: dict[str, list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault(it.proposer, []).append(i)
        for name, members in groups.items():
            batch = [DraftRequest(items[i].stream, items[i].tokens, items[i].params, items[i].generator,
                                  items[i].depth + int(assume) + int(items[i].bridge), epoch=items[i].epoch,
                                  tree_width=items[i].width) for i in members]
            for i, tree in zip(members, self.proposers[name].propose(batch)):
                out[i] = self._assume(self.proposers[name], items[i], tree)
        return out, time.perf_counter() - start

    def _assume(self, proposer, item: DraftItem, tree) -> Drafted:
        """Cut the tree, work out its assumed outcome, and keep the assumed path's draft K/V."""
        full, bridge_tokens, prefix_nodes, index = tree, None, [], None
        if item.bridge and tree.num_nodes:
            lead, lead_tokens, _ = greedy_outcome(tree, int(item.bridge))
            if len(lead) < int(item.bridge):         # the draft stopped short: nothing to assume
                return Drafted(cut_tree(tree, 0), None)
            bridge_tokens, prefix_nodes = lead_tokens, lead
            tree, index = reroot(tree, lead[-1])
        path, path_tokens, guess = greedy_outcome(tree, item.depth)
        # the draft keeps the K/V of the assumed path, exactly what full acceptance leaves
        full_path = prefix_nodes + (path if index is None else [index[i] for i in path])
        proposer.on_verified(item.stream, full, full_path)
        outcome = None if guess is None else path_tokens + [guess]
        return Drafted(cut_tree(tree, item.depth), outcome, bridge_tokens, path_tokens)

    def rollback(self, stream: str, keep_len: int) -> None:
        """Forget draft state past the first keep_len tokens (epoch change, DESIGN §3 step 4)."""
        for proposer in self.proposers.values():
            if hasattr(proposer, "rollback"):
                proposer.rollback(stream, keep_len)

    def observe_features(self, stream: str, start: int, features) -> None:
        """The target's features of committed positions start... (a feature-conditioned draft)."""
        if self.needs_features:
            self.model.observe_features(stream, start, features)

    def release(self, stream: str, committed: list[int] | None = None) -> None:
        """Forget the stream; `committed`: its whole committed sequence, whose full blocks a
        prefix-caching draft leaves cached first (`ModelProposer.cache_committed`)."""
        for proposer in self.proposers.values():
            if committed and hasattr(proposer, "cache_committed"):
                proposer.cache_committed(stream, committed)
            proposer.release(stream)

    def warm_up(self, spec_len: int, prompt_len: int = 32, *, max_len: int | None = None) -> float:
        """Before serving (as `verifier.target.TargetSide.warm_up`, whose reasons hold here:
        Triton's compiles on a GPU, the first forwards' one-off work on a CPU): draft for one
        dummy sequence at every depth up to `spec_len` (+ the bonus and bridge levels), with and
        without an assumed outcome, each twice (an EAGLE head reading zero features); then on a
        GPU the CUDA graphs of every draft shape the planner's trees can cost
        (`speculation.planner.draft_rows`) at every block-table width up to `max_len` tokens
        (None: what the cache holds). The dummy prompt is shortened to fit the cache, the dummy
        skipped where not even that fits (`speculation.planner.warm_up_prompt_len`). Returns
        the seconds it took (0 without a draft model, or when skipped)."""
        from speculation.planner import draft_rows, warm_up_prompt_len

        cache = self.cache
        if self.model is None or cache is None:
            return 0.0
        start = time.perf_counter()
        prompt_len = warm_up_prompt_len(cache, prompt_len, spec_len + 2,    # depth, bonus, bridge
                                        self.model.model.config.max_position_embeddings)
        if prompt_len:
            self._warm_up_drafts([1] * prompt_len, spec_len)
        if self.graphs is not None:
            st = self.settings
            self.graphs.warm_up(cache, draft_rows(spec_len, st.tree_width, st.bridge_depth), max_len=max_len)
        return time.perf_counter() - start if prompt_len or self.graphs is not None else 0.0

    def _warm_up_drafts(self, prefix: list[int], spec_len: int) -> None:
        """`warm_up`'s dummy drafts, each rolled back to the prefix; the stream released after."""
        from models.sampling import SamplingParams

        sid, params, gen = "__warm_up__", SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
        model = self.model.model
        zeros = torch.zeros(len(prefix) - 1, getattr(model, "target_feature_width", model.config.hidden_size))
        with self.cache.uncounted():       # the dummy's lookups are not the clients' hit rate
            try:
                for k in range(1, spec_len + 1):
                    for assume, bridge in ((True, 0), (True, 1), (False, 0)):
                        for _ in (0, 1):
                            self.observe_features(sid, 0, zeros)   # the target's features, were it EAGLE
                            self.propose([DraftItem(sid, prefix, params, gen, k, 1, 0, bridge)], assume)
                            self.rollback(sid, len(prefix) - 1)
            finally:
                self.release(sid)


class BridgeDraft:
    """The verifier's copy of the draft model, for bridge chains (`bridge_depth`,
    drafter/streams.py): after a step whose outcome contradicted what the drafter assumed,
    the verifier verifies the draft's own greedy chain instead of decoding one token alone,
    drafted here in one batched pass with its own KV cache (caught up on the committed
    tokens at each use). The drafter drafts the same greedy path, and its restart tree after
    it, at the same time on its own device."""

    def __init__(self, draft_dir: str, target: str, settings: EngineSettings) -> None:
        from models.presets import config_of

        # as the drafter's proposer reads it: the same greedy path
        self.proposer = draft_proposer(draft_dir, config_of(target).vocab_size, settings, MAX_BRIDGE_DEPTH + 1)

    def chains(self, requests: list[DraftRequest]) -> list[BridgeChain]:
        """Per request (its `max_depth` the chain's depth r): the chain cut to r and the
        outcome it announces, the chain plus the draft's next token."""
        batch = [DraftRequest(r.seq_id, r.token_ids, r.params, r.generator, r.max_depth + 1, epoch=0,
                              tree_width=1) for r in requests]
        out = []
        for r, tree in zip(requests, self.proposer.propose(batch)):
            _, tokens, guess = greedy_outcome(tree, r.max_depth)
            out.append(BridgeChain(cut_tree(tree, r.max_depth), None if guess is None else tokens + [guess]))
            # keep the committed prefix but its root, which the next chain feeds afresh
            self.proposer.rollback(r.seq_id, len(r.token_ids) - 1)
        return out

    def release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)

    def warm_up(self, depth: int, prompt_len: int = 32) -> float:
        """Before the verifier serves, as `DraftSide.warm_up`: chains of 1..`depth` for a dummy
        sequence (shortened to fit the cache, skipped where even that does not fit), each
        twice, then on a GPU the CUDA graphs of a chain's forwards
        (`speculation.planner.draft_rows(depth)`). Returns the seconds taken (0 when skipped)."""
        from models.sampling import SamplingParams
        from speculation.planner import draft_rows, warm_up_prompt_len

        cache = self.proposer.cache
        start, sid = time.perf_counter(), "__warm_up__"
        params, gen = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
        prompt_len = warm_up_prompt_len(cache, prompt_len, depth + 1,      # the chain and the guess
                                        self.proposer.model.config.max_position_embeddings)
        with cache.uncounted():            # the dummy's lookups are not the clients' hit rate
            try:
                for r in [r for r in range(1, depth + 1) for _ in (0, 1)] if prompt_len else []:
                    self.chains([DraftRequest(sid, [1] * prompt_len, params, gen, r)])
            finally:
                self.release(sid)
        graphs = getattr(self.proposer.model, "graphs", None)
        if graphs is not None:
            graphs.warm_up(cache, draft_rows(depth))
        return time.perf_counter() - start if prompt_len or graphs is not None else 0.0
