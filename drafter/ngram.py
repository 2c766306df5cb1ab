"""N-gram proposer: prompt lookup decoding (Saxena 2023), no model needed.

Find the most recent earlier occurrence of the last n tokens of prompt + output
(n from `max_ngram` down to `min_ngram`, the longest match wins) and propose
the tokens that followed it as a chain. Its q is a point mass on each proposed
token, so stochastic verification (Leviathan et al. 2023) accepts token x with
probability p(x) and otherwise samples from p with x removed: still exact.
Strong where the output copies its input (code edits, summaries, extraction).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

from drafter.base import DraftRequest, point_mass_rows
from models.tree import TokenTree


class NgramProposer:
    def __init__(self, vocab_size: int, spec_len: int, max_ngram: int = 3, min_ngram: int = 2) -> None:
        _check_ngrams(max_ngram, min_ngram)
        self.vocab_size, self.spec_len = vocab_size, spec_len
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, batch: Sequence[DraftRequest]) -> list[TokenTree]:
        trees = []
        for r in batch:
            k = min(self.spec_len, r.max_depth)
            draft_token_ids = lookup(r.token_ids, k, self.max_ngram, self.min_ngram) if k > 0 else []
            draft_probs = None
            if draft_token_ids and not r.params.greedy:
                draft_probs = point_mass_rows(draft_token_ids, self.vocab_size)     # [K+1, V]
            if draft_token_ids:
                trees.append(TokenTree.chain(draft_token_ids, draft_probs, len(r.token_ids), r.epoch))
            else:
                trees.append(TokenTree.empty(len(r.token_ids), r.epoch))
        return trees

    def on_verified(self, seq_id: Hashable, tree: TokenTree, accepted_nodes: Sequence[int]) -> None:
        pass   # stateless: the committed tokens are the whole state

    def release(self, seq_id: Hashable) -> None:
        pass


def _check_ngrams(max_ngram: int, min_ngram: int) -> None:
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
    as `lookup` (tests/drafter/test_ngram.py)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        _check_ngrams(max_ngram, min_ngram)
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
