"""The verifier's state of one request (DESIGN.md §3): committed tokens, stop conditions,
the budget it asks of its drafter, what that drafter has heard, and the request's stats."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from speculation.requests import GenerationChunk
from speculation.stats import SpecStats
from speculation.step import commit_tokens


@dataclass
class VerifyStream:
    request_id: str
    prompt: list[int]
    params: object                      # models.SamplingParams
    generator: torch.Generator
    stop_ids: set[int]
    mode: str                           # "off" | "chain" | "tree" | "auto"
    spec_len: int
    tree_width: int
    max_context: int
    proposer: str = "model"             # what its drafter drafts with: "model" | "ngram"
    seed: int = 0                       # of `generator`; the drafter's own is seed + 1 (`draft_seed`), or the
                                        # seed itself if coupled
    emit: Callable[[GenerationChunk], None] | None = None   # where its chunks go
    drafter: int | None = None          # index of the drafter feeding it
    committed: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)          # with params.logprobs: one TokenLogprob per output token
    prompt_logprobs: list | None = None   # with params.prompt_logprobs (the first chunk carries them)
    stats: SpecStats = field(default_factory=SpecStats)     # this request's own
    started: float = 0.0                # perf_counter seconds when it arrived
    admitted: bool = False              # has its ring, budget and drafter (set before the prefill)
    prefilled: bool = False
    finish_reason: str | None = None
    waiting_since: float | None = None  # waiting for a tree since (monotonic seconds)
    bridge: bool = False                # decode the next token alone at once (drafter/streams.py)
    restarting: bool = False            # its next tree is a restart tree (`restart_depth`)
    first_tree: bool = True             # no tree verified since the drafter was (re)synced
    budget: tuple[int, int] = (0, 0)
    sent_budget: tuple[int, int] = (0, 0)   # the budget the drafter was last told
    unsent: list[int] = field(default_factory=list)   # committed tokens the drafter has not heard of
    # a feature-conditioned drafter (EAGLE) reads the target's hidden states of every committed
    # position but the last: [n_i, hidden] pieces, `features_sent` rows of them told already
    features: list = field(default_factory=list)
    features_sent: int = 0
    prefix_cache: bool = True           # may start on cached KV blocks and leave its own cached
    cached_tokens: int = 0              # prompt tokens its prefill found in the target's prefix cache

    @property
    def num_drafted(self) -> int:
        return self.stats.num_drafted

    @property
    def num_accepted(self) -> int:
        return self.stats.num_accepted

    def commit(self, token_ids: list[int]) -> list[int]:
        """Append verified tokens up to a stop condition; returns the tokens kept."""
        kept, reason = commit_tokens(self.committed, self.output, token_ids, self.stop_ids,
                                     self.params.max_tokens, self.max_context)
        self.finish_reason = self.finish_reason or reason
        return kept

    def observe_prefill(self, seconds: float, cached: int, stats: SpecStats, done: bool = True) -> None:
        """Its prefill (or a chunk of it, `done` at the last) took `seconds` and found `cached`
        prompt tokens in the target's prefix cache: counted in its stats and in `stats` (the
        scheduler's)."""
        self.stats.observe_time("prefill", seconds)
        if not done:
            return
        self.cached_tokens = cached
        for st in (stats, self.stats):
            st.observe_prefix_cache(len(self.prompt) - 1 if self.prefix_cache else 0, cached)

    def cacheable(self, settings) -> list[int]:
        """What its "leave" signal carries: with prefix caching, its committed tokens (its drafter
        leaves their full blocks cached); else nothing."""
        return list(self.committed) if settings.prefix_caching and self.prefix_cache else []

    @property
    def under_way(self) -> bool:
        """Admitted, its prompt not wholly prefilled yet: chunks of it remain to be fed."""
        return self.admitted and not self.prefilled

    def capped(self, planned: tuple[int, int]) -> tuple[int, int]:
        """A planned (depth, width) within what is worth verifying (`max_depth`); (0, 0) = none."""
        k, w = planned
        k = min(k, self.max_depth())
        return (k, w) if k > 0 else (0, 0)

    def max_depth(self) -> int:
        """Deepest draft node worth verifying (tokens left - 1; context room)."""
        left = self.params.max_tokens - len(self.output)
        return max(0, min(left - 1, self.max_context - len(self.committed) - 1))

    def chunk(self, tokens: list[int], error: str | None = None, logprobs: list | None = None) -> GenerationChunk:
        return GenerationChunk(self.request_id, tokens, self.finish_reason is not None, self.finish_reason,
                               self.num_drafted, self.num_accepted, error, cached_tokens=self.cached_tokens,
                               logprobs=logprobs,
                               prompt_logprobs=self.prompt_logprobs if len(self.output) == len(tokens) else None)

    def unsent_features(self):
        """The target features the drafter has not been told (None without any), and their
        first position; marks them told."""
        total = sum(len(f) for f in self.features)
        if not self.features or total == self.features_sent:
            return None
        start, self.features_sent = self.features_sent, total
        return start, torch.cat(self.features)[start:]
