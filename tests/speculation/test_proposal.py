"""Proposals (speculation/proposal.py): n-gram prompt lookup, by a scan and by the incremental
index, which answers exactly as the scan."""
from __future__ import annotations

import random

import pytest

from speculation.proposal import NgramIndex, lookup


@pytest.mark.parametrize("tokens,k,expected", [
    ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, [8, 1]),          # latest match of the longest n-gram
    ([1, 2, 3, 4, 5, 0, 2, 3], 3, [4, 5, 0]),                # falls back to a shorter n-gram
    ([1, 2, 3, 4], 3, []),                                   # no earlier match
    ([7, 7], 4, []),                                         # min n-gram 2: nothing to match
    ([5, 6, 5, 6], 5, [5, 6]),                               # continuation runs to the end
])
def test_ngram_lookup(tokens, k, expected):
    assert lookup(tokens, k, max_ngram=3, min_ngram=2) == expected


@pytest.mark.parametrize("seed", range(4))
def test_index_matches_the_scan_as_the_list_grows(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]   # a small vocabulary: many matches
    index = NgramIndex(3, 2)
    hits = 0
    for _ in range(120):
        k = rng.randrange(1, 6)
        expected = lookup(tokens, k, 3, 2)
        assert index.lookup(tokens, k) == expected, (tokens, k)
        hits += bool(expected)
        tokens = tokens + [rng.randrange(5) for _ in range(rng.randrange(1, 5))]   # steps commit 1-4
    assert hits > 50                   # the comparison saw matches, not only empty answers


def test_latest_longest_match_wins_and_a_shorter_list_starts_over():
    index = NgramIndex(3, 2)
    assert index.lookup([1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]       # latest occurrence of (1, 2)
    # (3, 1, 2) at 4 beats the later (1, 2) at 5
    assert NgramIndex(3, 2).lookup([7, 1, 2, 5, 3, 1, 2, 6, 1, 2, 9, 3, 1, 2], 3) == [6, 1, 2]
    assert index.lookup([4, 4], 2) == []         # shorter: rebuilt; only the suffix itself matches
    assert index.lookup([4, 4, 4], 2) == [4]
    with pytest.raises(ValueError):
        NgramIndex(2, 3)
