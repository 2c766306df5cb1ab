"""The synchronous in-process engine: prefill, then draft-and-verify until done.

Modes per request (`SpeculationOptions.mode`): "off" is the target decoding
alone (trees of zero nodes); "chain" and "tree" are classic draft-then-verify
(Leviathan et al. 2023; Chen et al. 2023), with an EAGLE-2 tree (Li et al.
2024) when the width is above 1, or prompt lookup decoding with the n-gram
proposer. "auto" with the draft model chooses each sequence's depth every step
(`speculation.planner`, with draft and verify costs added since they take turns
here): a sequence whose drafts are rarely accepted decodes alone, probed now
and then, so speculation that does not pay costs little; in a step where the
model drafts for no sequence, an "auto" sequence may verify a prompt-lookup
chain instead, where its own running acceptance says that pays (`lookup=False`
turns this off). "auto" with the n-gram proposer drafts at full depth wherever
the prompt has a match. Requests of one `generate` call step in lockstep:
one batched draft pass and one batched target forward per step.

No Ray here: `cluster/` wraps this in actors and the Serve app.
Stats follow vLLM's convention: the mean accepted length includes the bonus
token; the acceptance rate is accepted / drafted nodes.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from speculation.planner import AdaptiveSpeculation, VerifyCosts, one_off_costs, plan_lookups
from speculation.requests import GenerationRequest, SpeculationOptions
from drafter import DraftRequest, EagleProposer, ModelProposer, NgramProposer
from models.transformer import few_row_limit
from models.tree import TokenTree
from verifier import Verifier, VerifyRequest

MAX_SPEC_LEN = 16
MAX_TREE_WIDTH = 8


class EngineError(ValueError):
    """Bad input for the engine (prompt too long, speculation out of range, ...)."""


@dataclass
class SpecStats:
    num_steps: int = 0          # target verifications
    num_drafted: int = 0        # tree nodes proposed
    num_accepted: int = 0       # tree nodes accepted (bonus tokens not counted)
    num_generated: int = 0      # tokens returned to the caller
    num_rejected_steps: int = 0  # steps whose walk ended at a rejection (not at a leaf)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    elapsed_s: float = 0.0      # wall time of the whole request(s), prefill included

    def observe_step(self, num_drafted: int, num_accepted: int, rejected: bool = False) -> None:
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_rejected_steps += int(rejected)

    def observe_generated(self, n: int) -> None:
        self.num_generated += n

    def observe_time(self, kind: str, seconds: float) -> None:
        setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds)

    def merge(self, other: "SpecStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def level_acceptance(self) -> float:
        """Per-level acceptance, the gamma of Eq. 3.2 (Leviathan et al. 2023): of the levels the
        walk tried, the share it passed (maximum likelihood under a constant gamma)."""
        tried = self.num_accepted + self.num_rejected_steps
        return self.num_accepted / tried if tried else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens committed per verification, the bonus / corrected token included."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"drafted": self.num_drafted, "accepted": self.num_accepted,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_len": self.mean_accepted_len,
                "tokens_per_s": self.tokens_per_s}


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                 # generated tokens only
    finish_reason: str                   # "stop" | "length"
    stats: SpecStats


@dataclass
class _Sequence:
    request: GenerationRequest
    generator: torch.Generator
    stop_ids: set[int]
    token_ids: list[int] = field(default_factory=list)    # prompt + output (committed)
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    def commit(self, new_token_ids: Iterable[int], max_context: int) -> int:
        """Append verified tokens until a stop condition; returns how many were kept."""
        kept = 0
        for t in new_token_ids:
            self.token_ids.append(t)
            self.output.append(t)
            kept += 1
            if t in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.output) >= self.request.sampling.max_tokens or len(self.token_ids) >= max_context:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return kept


class Engine:
    def __init__(self, target, draft=None, *, spec_len: int = 4, tree_width: int = 1,
                 max_nodes: int | None = None, draft_logit_rows: Sequence[int] | None = None,
                 eos_token_ids: Sequence[int] | None = None, block_size: int = 16,
                 lookup: bool = True) -> None:
        check_speculation(spec_len, tree_width)
        self.target, self.draft = target, draft           # models.Transformer
        self.spec_len, self.tree_width, self.max_nodes = spec_len, tree_width, max_nodes
        self.draft_logit_rows = draft_logit_rows
        self.vocab_size = target.config.vocab_size
        self.max_context = target.config.max_position_embeddings
        self.eos_token_ids = set(target.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.block_size = block_size
        self.ngram = NgramProposer(self.vocab_size, MAX_SPEC_LEN)
        self._capacity = 0                                  # tokens the current caches hold
        self.verifier: Verifier | None = None
        self.proposer: ModelProposer | None = None
        # per-sequence depths of "auto" requests; draft and verify take turns here (no overlap)
        self.adaptive = AdaptiveSpeculation(max_spec_len=MAX_SPEC_LEN, overlap=False)
        self.adaptive.costs.one_off = one_off_costs(target)
        self._planned: dict[str, tuple[int, int]] = {}
        # prompt lookup for "auto" sequences while the draft model is off for every sequence
        # of a step (`_lookup_trees`): its own γ per sequence, verify costs only (no drafting)
        self.lookup_enabled = lookup
        self.lookup = AdaptiveSpeculation(max_spec_len=MAX_SPEC_LEN, overlap=False)
        self.lookup.costs = VerifyCosts(self.adaptive.costs)
        self.adaptive.row_limit = self.lookup.row_limit = few_row_limit(target)
        self._looked_up: set[str] = set()              # sequences whose tree this step is a lookup

    # -- public -------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Run the requests to completion, in lockstep; outputs in request order."""
        if len({r.request_id for r in requests}) != len(requests):
            raise EngineError("request ids must be unique within one generate call")
        for r in requests:
            self._check_request(r)
        self._ensure_caches(requests)
        try:
            seqs = self._prefill(requests)
            active = list(seqs)
            while active:
                self.step(active)
                active = [s for s in active if not s.finish_reason]
        finally:
            for r in requests:
                self._release(r.request_id)
        return [GenerationOutput(s.seq_id, list(s.request.prompt_token_ids), s.output,
                                 s.finish_reason or "length", s.stats) for s in seqs]

    def step(self, seqs: Sequence[_Sequence]) -> None:
        """One speculative step for every sequence: draft, verify, commit."""
        start = time.perf_counter()
        planned = [s.seq_id for s in seqs if s.seq_id in self.adaptive.seqs]
        self._planned = self.adaptive.plan(planned) if planned else {}
        trees = self._propose(seqs)
        self._lookup_trees(seqs, trees)
        drafted = time.perf_counter()
        results = self.verifier.verify([
            VerifyRequest(s.seq_id, s.token_ids[-1], tree, s.request.sampling, s.generator)
            for s, tree in zip(seqs, trees)])
        verified = time.perf_counter()
        self._observe_costs(seqs, trees, results, drafted - start, verified - drafted)
        for s, tree, res in zip(seqs, trees, results):
            if res.features is not None and self._wants_features(s):
                self.proposer.observe_features(s.seq_id, tree.prefix_len - 1, res.features)
            if s.seq_id in self._looked_up:      # the draft model drafted nothing this step
                self._proposer_of(s).on_verified(s.seq_id, TokenTree.empty(tree.prefix_len), [])
            else:
                self._proposer_of(s).on_verified(s.seq_id, tree, res.accepted_nodes)
            last = res.accepted_nodes[-1] if res.accepted_nodes else -1
            s.stats.observe_step(tree.num_nodes, res.num_accepted,
                                 rejected=bool((tree.parent_ids == last).any()))
            s.stats.observe_generated(s.commit(res.token_ids, self.max_context))
            s.stats.observe_time("draft", (drafted - start) / len(seqs))
            s.stats.observe_time("verify", (verified - drafted) / len(seqs))
            s.stats.observe_time("elapsed", (verified - start) / len(seqs))

    def _observe_costs(self, seqs, trees, results, draft_s: float, verify_s: float) -> None:
        """Feed the adaptive planner: each auto sequence's acceptance, and the step's costs."""
        if not self._planned:
            return
        levels = 0
        for s, tree, res in zip(seqs, trees, results):
            depth = int(tree.depths.max()) if tree.num_nodes else 0
            if s.seq_id in self._looked_up:
                self.lookup.observe(s.seq_id, depth, res.num_accepted)
            elif s.seq_id in self._planned:
                self.adaptive.observe(s.seq_id, depth, res.num_accepted)
                levels = max(levels, depth)
        self.adaptive.costs.observe_verify(sum(1 + t.num_nodes for t in trees), verify_s)
        self.adaptive.costs.observe_draft(levels, draft_s)

    # -- steps --------------------------------------------------------------------------
    def _prefill(self, requests: Sequence[GenerationRequest]) -> list[_Sequence]:
        """Per-request generators and stop sets, then one batched target prefill."""
        start = time.perf_counter()
        seqs = []
        for r in requests:
            seed = r.sampling.seed
            generator = torch.Generator().manual_seed(
                seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
            stop_ids = set(r.sampling.stop_token_ids)
            if not r.sampling.ignore_eos:
                stop_ids |= self.eos_token_ids
            seqs.append(_Sequence(r, generator, stop_ids, list(r.prompt_token_ids)))
            spec = r.speculation
            if spec.mode == "auto" and spec.proposer == "model":
                self.adaptive.add(r.request_id, "auto", spec.spec_len or self.spec_len,
                                  spec.tree_width or self.tree_width)
                if self.lookup_enabled:
                    self.lookup.add(r.request_id, "auto", spec.spec_len or self.spec_len, 1)
        features = self.verifier.prefill_batch([s.seq_id for s in seqs], [s.token_ids for s in seqs])
        for s in seqs:
            if features is not None and self._wants_features(s):
                self.proposer.observe_features(s.seq_id, 0, features[s.seq_id])
        seconds = (time.perf_counter() - start) / len(seqs)
        for s in seqs:
            s.stats.observe_time("prefill", seconds)
            s.stats.observe_time("elapsed", seconds)
        return seqs

    def _propose(self, seqs: Sequence[_Sequence]) -> list[TokenTree]:
        """Trees for every sequence, one batched call per proposer."""
        trees: list[TokenTree | None] = [None] * len(seqs)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            if s.request.speculation.mode == "off":
                trees[i] = TokenTree.empty(len(s.token_ids))
            else:
                groups.setdefault(id(self._proposer_of(s)), []).append(i)
        for members in groups.values():
            proposer = self._proposer_of(seqs[members[0]])
            batch = [self._draft_request(seqs[i]) for i in members]
            for i, tree in zip(members, proposer.propose(batch)):
                trees[i] = tree
        return trees

    def _lookup_trees(self, seqs: Sequence[_Sequence], trees: list[TokenTree]) -> None:
        """Where no sequence of the step drafts with the model (its planner chose depth 0 for
        every "auto" one), an "auto" sequence may verify a prompt-lookup chain instead: the
        tokens that followed the latest earlier occurrence of its last n-gram
        (`drafter.ngram.lookup`), as many as `self.lookup` finds worth a longer forward."""
        self._looked_up = set()
        if not self.lookup_enabled or any(t.num_nodes for t in trees):
            return
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        candidates = [(s.seq_id, s.token_ids, self._draft_request(s, planned=False).max_depth,
                       s.request.sampling.greedy) for s in seqs if s.seq_id in self.lookup.seqs]
        chains = plan_lookups(self.lookup, candidates, len(seqs) - len(candidates), self.vocab_size)
        for sid, tree in chains.items():
            trees[index[sid]] = tree
        self._looked_up = set(chains)

    def _draft_request(self, s: _Sequence, planned: bool = True) -> DraftRequest:
        spec = s.request.speculation
        remaining = s.request.sampling.max_tokens - len(s.output)
        depth = spec.spec_len or self.spec_len
        width = 1 if spec.mode == "chain" else (spec.tree_width or self.tree_width)
        if planned and s.seq_id in self._planned:     # "auto": the planner's depth (0 = decode alone)
            depth, planned_width = self._planned[s.seq_id]
            width = planned_width or width
        depth = min(depth, remaining - 1, self.max_context - len(s.token_ids) - 1)
        return DraftRequest(s.seq_id, s.token_ids, s.request.sampling, s.generator, depth,
                            tree_width=width)

    def _wants_features(self, s: _Sequence) -> bool:
        """A feature-conditioned draft needs the target's features of every committed token of
        a sequence it may draft for (an "auto" one too, while it decodes alone)."""
        spec = s.request.speculation
        return getattr(self.proposer, "needs_features", False) and spec.mode != "off" and spec.proposer == "model"

    def _proposer_of(self, s: _Sequence):
        if s.request.speculation.mode == "off" or s.request.speculation.proposer == "ngram":
            return self.ngram
        return self.proposer

    # -- checks and memory --------------------------------------------------------------
    def _check_request(self, r: GenerationRequest) -> None:
        n = len(r.prompt_token_ids)
        if n == 0:
            raise EngineError("the prompt is empty: it must hold at least one token")
        if n >= self.max_context:
            raise EngineError(f"the prompt is {n} tokens long; the target's context is "
                              f"{self.max_context} tokens (room is needed for at least one more)")
        bad = [t for t in r.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        spec = r.speculation
        check_speculation(spec.spec_len or self.spec_len, spec.tree_width or self.tree_width)
        if spec.mode != "off" and spec.proposer == "model" and self.draft is None:
            raise EngineError("speculation with the model proposer needs a draft model; "
                              "none was loaded (use mode 'off' or the ngram proposer)")

    def _ensure_caches(self, requests: Sequence[GenerationRequest]) -> None:
        """Caches big enough for every request at its longest, allocated once and reused."""
        tree = (self.max_nodes or MAX_SPEC_LEN * MAX_TREE_WIDTH) + MAX_SPEC_LEN + 2
        need = sum(-(-(len(r.prompt_token_ids) + r.sampling.max_tokens + tree) // self.block_size) + 1
                   for r in requests) * self.block_size
        if need <= self._capacity:
            return
        blocks = need // self.block_size
        eagle = getattr(self.draft, "needs_features", False)
        self.verifier = Verifier(self.target, self.target.new_cache(blocks, self.block_size), features=eagle)
        if self.draft is not None:
            # the draft's first catch-up pads every row to the longest prompt of the batch
            longest = max(len(r.prompt_token_ids) for r in requests)
            draft_blocks = blocks + len(requests) * (-(-longest // self.block_size) + 1)
            proposer_class = EagleProposer if eagle else ModelProposer
            self.proposer = proposer_class(self.draft, self.draft.new_cache(draft_blocks, self.block_size),
                                           MAX_SPEC_LEN, self.tree_width, self.max_nodes,
                                           self.draft_logit_rows, self.vocab_size)
        self._capacity = need

    def _release(self, seq_id: str) -> None:
        self.adaptive.remove(seq_id)
        self.lookup.remove(seq_id)
        self._looked_up.discard(seq_id)
        self._planned.pop(seq_id, None)
        self.verifier.release(seq_id)
        if self.proposer is not None:
            self.proposer.release(seq_id)


def check_speculation(spec_len: int, tree_width: int) -> None:
    if not isinstance(spec_len, int) or not 1 <= spec_len <= MAX_SPEC_LEN:
        raise EngineError(f"spec-len (K) must be an integer in [1, {MAX_SPEC_LEN}], got {spec_len!r}")
    if not isinstance(tree_width, int) or not 1 <= tree_width <= MAX_TREE_WIDTH:
        raise EngineError(f"tree-width must be an integer in [1, {MAX_TREE_WIDTH}], got {tree_width!r}")


def speculation_for(mode: str, spec_len: int, tree_width: int, proposer: str = "model") -> SpeculationOptions:
    """CLI-style flags (--mode off|sync, --spec-len, --tree-width, --proposer) as per-request options."""
    if mode == "off":
        return SpeculationOptions(mode="off", proposer=proposer)
    if mode != "sync":
        raise EngineError(f"mode must be 'off' or 'sync' in the in-process engine, got {mode!r}")
    check_speculation(spec_len, tree_width)
    return SpeculationOptions(mode="tree" if tree_width > 1 else "chain", spec_len=spec_len,
                              tree_width=tree_width, proposer=proposer)


# -- building an engine from checkpoint directories ---------------------------------------
DRAFT_META = "specflash_draft.json"   # optional: {"logit_rows": [...]} (a reduced draft LM head)


@dataclass
class LoadedPair:
    engine: Engine
    tokenizer: object                     # transformers tokenizer of the target
    target_dir: str
    draft_dir: str | None


def build_engine(target_dir, draft_dir=None, *, spec_len: int = 4, tree_width: int = 1,
                 max_nodes: int | None = None, load_draft: bool = True) -> LoadedPair:
    """Load and check a (target, draft) pair of local HF checkpoint directories.

    Raises `EngineError` / `models.ModelLoadError` with a message fit for a user:
    missing or non-HF directories, vocabularies or tokenizers that disagree,
    speculation settings out of range.
    """
    from pathlib import Path

    from models import load_model, load_tokenizer
    from models.loader import load_config

    check_speculation(spec_len, tree_width)
    target_dir = str(Path(target_dir).expanduser().resolve())
    target_config = load_config(target_dir)
    try:
        tokenizer = load_tokenizer(target_dir)
    except (OSError, ValueError, TypeError) as e:
        raise EngineError(f"cannot load the tokenizer of {target_dir}: {e}") from e
    draft, logit_rows = None, None
    if draft_dir is not None:
        draft_dir = str(Path(draft_dir).expanduser().resolve())
        draft_config = load_config(draft_dir)
        check_vocabularies(target_dir, target_config, tokenizer, draft_dir, draft_config)
        logit_rows = read_logit_rows(draft_dir, target_config.vocab_size)
        if load_draft:
            draft = load_model(draft_dir)
    target = load_model(target_dir)
    eos = set(target_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    engine = Engine(target, draft, spec_len=spec_len, tree_width=tree_width, max_nodes=max_nodes,
                    draft_logit_rows=logit_rows, eos_token_ids=sorted(eos))
    return LoadedPair(engine, tokenizer, target_dir, draft_dir)


def check_vocabularies(target_dir, target_config, tokenizer, draft_dir, draft_config) -> None:
    """The draft must speak the target's vocabulary: same size, same tokenizer if it has one."""
    from pathlib import Path

    from models import load_tokenizer

    if draft_config.vocab_size != target_config.vocab_size:
        raise EngineError(f"draft and target vocabularies differ: the draft {draft_dir} has "
                          f"{draft_config.vocab_size} tokens, the target {target_dir} has "
                          f"{target_config.vocab_size}")
    if any((Path(draft_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        if load_tokenizer(draft_dir).get_vocab() != tokenizer.get_vocab():
            raise EngineError(f"draft and target tokenizers differ ({draft_dir} vs {target_dir}): "
                              f"the same token id must mean the same text in both")


def read_logit_rows(draft_dir, vocab_size: int) -> list[int] | None:
    """The draft's reduced LM head rows from specflash_draft.json, if it has one."""
    import json
    from pathlib import Path

    meta = Path(draft_dir) / DRAFT_META
    if not meta.is_file():
        return None
    try:
        rows = json.loads(meta.read_text()).get("logit_rows")
    except json.JSONDecodeError as e:
        raise EngineError(f"{meta} is not valid JSON ({e})") from e
    if rows is not None and (not rows or not all(isinstance(r, int) and 0 <= r < vocab_size for r in rows)):
        raise EngineError(f"{meta}: logit_rows must be a non-empty list of token ids in [0, {vocab_size})")
    return rows
