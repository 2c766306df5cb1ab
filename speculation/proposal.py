"""What a proposer is asked and gives, and prompt lookup, shared by both sides (DESIGN.md §2-§3).

A proposer turns the committed tokens of a sequence into a `TokenTree` whose nodes carry the
draft distributions they were drawn from, and keeps whatever state it has (a draft KV cache)
in step with the verifier's accept / rollback signal. The proposers are in drafter/; prompt
lookup (Saxena 2023: the tokens that followed the latest earlier occurrence of the last few
tokens) is here because the verifier drafts its own lookup chains too (verifier/lookup.py).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from models.sampling import SamplingParams
from models.tree import TokenTree


@dataclass
class DraftRequest:
    seq_id: Hashable
    token_ids: Sequence[int]        # committed tokens, prompt + output; the last one is the root
    params: SamplingParams
    generator: torch.Generator      # per request, shared with the verifier's draws
    max_depth: int                  # deepest node worth drafting (tokens left to generate - 1)
    epoch: int = 0
    tree_width: int | None = None   # per-request override of the proposer's width


class Proposer(Protocol):
    def propose(self, batch: Sequence[DraftRequest]) -> list[TokenTree]: ...

    def on_verified(self, seq_id: Hashable, tree: TokenTree, accepted_nodes: Sequence[int]) -> None:
        """The verifier accepted `accepted_nodes` of `tree`: keep their state, drop the rest."""

    def release(self, seq_id: Hashable) -> None:
        """The sequence is finished: free its state."""


def point_mass_chain(token_ids: Sequence[int], prefix_len: int, epoch: int = 0, with_q: bool = True) -> TokenTree:
    """A deterministic chain of K >= 1 tokens; `with_q` (an unseeded sampled request): its q,
    row i one-hot at token i and the last row 0, over the chain's distinct tokens alone
    (`TokenTree.draft_columns`): [K+1, distinct] rather than [K+1, V]."""
    if not len(token_ids):
        raise ValueError("point_mass_chain: a chain of at least one token")
    tokens = torch.tensor(list(token_ids), dtype=torch.long)
    if not with_q:
        return TokenTree.chain(tokens, None, prefix_len, epoch)
    columns, at = torch.unique(tokens, sorted=True, return_inverse=True)
    rows = torch.zeros(len(tokens) + 1, len(columns))
    rows[torch.arange(len(tokens)), at] = 1.0
    return TokenTree.chain(tokens, rows, prefix_len, epoch, columns)


@dataclass
class BridgeChain:
    """The draft's own greedy chain after a committed prefix, as a bridge step verifies it."""

    tree: TokenTree                 # the chain cut to the depth asked
    outcome: list[int] | None       # what it announces: the chain plus the draft's next token
                                    # (None where the draft stopped short)


def check_ngrams(max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")


def lookup(token_ids: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram."""
    tokens = list(token_ids)
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):          # latest match first; it must end before L
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramIndex:
    """`lookup` for one growing token list in O(max_ngram) a call instead of a scan of it.

    It keeps the latest start of every n-gram (`min_ngram`..`max_ngram`) that has a token
    after it, adding those the list gained since the last call. The list may only grow
    (a sequence's committed tokens); a shorter one starts the index over. Same answers
    as `lookup` (tests/speculation/test_proposal.py)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        check_ngrams(max_ngram, min_ngram)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._latest: dict[int, dict[tuple, int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._done = 0          # n-grams ending at or before this index are in `_latest`

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix n-gram."""
        L = len(token_ids)
        if L < self._done + 1:                   # not the list we indexed: start over
            self._latest = {n: {} for n in self._latest}
            self._done = 0
        for end in range(self._done + 1, L):     # n-grams [end - n, end) followed by token `end`
            for n, latest in self._latest.items():
                if end >= n:
                    latest[tuple(token_ids[end - n:end])] = end - n
        self._done = max(self._done, L - 1)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(token_ids[L - n:]))
            if start is not None:
                return list(token_ids[start + n:start + n + k])
        return []
