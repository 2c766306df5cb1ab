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

from models.tree import TokenTree
from speculation.proposal import DraftRequest, check_ngrams, lookup, point_mass_chain


class NgramProposer:
    def __init__(self, vocab_size: int, spec_len: int, max_ngram: int = 3, min_ngram: int = 2) -> None:
        check_ngrams(max_ngram, min_ngram)
        self.vocab_size, self.spec_len = vocab_size, spec_len
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, batch: Sequence[DraftRequest]) -> list[TokenTree]:
        trees = []
        for r in batch:
            k = min(self.spec_len, r.max_depth)
            draft_token_ids = lookup(r.token_ids, k, self.max_ngram, self.min_ngram) if k > 0 else []
            if draft_token_ids:
                trees.append(point_mass_chain(draft_token_ids, len(r.token_ids), r.epoch, r.params.reads_q))
            else:
                trees.append(TokenTree.empty(len(r.token_ids), r.epoch))
        return trees

    def on_verified(self, seq_id: Hashable, tree: TokenTree, accepted_nodes: Sequence[int]) -> None:
        pass   # stateless: the committed tokens are the whole state

    def release(self, seq_id: Hashable) -> None:
        pass
