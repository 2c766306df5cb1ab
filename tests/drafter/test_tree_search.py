"""EAGLE-2 tree growth (drafter/tree_search.py), greedy and without replacement."""
from __future__ import annotations

import torch

from drafter.tree_search import ROOT, TreeBuilder
from models import SamplingParams

V = 12


def logits_with(order: list[int]) -> torch.Tensor:   # [V]: tokens in `order` get descending logits
    logits = torch.full((V,), -10.0)
    for rank, token in enumerate(order):
        logits[token] = 5.0 - rank
    return logits


def test_greedy_tree_children_are_top_k_and_rerank_keeps_a_tree():
    b = TreeBuilder(SamplingParams(temperature=0.0), torch.Generator(), width=2, max_nodes=4, vocab_size=V)
    b.expand([ROOT], logits_with([3, 7, 1])[None])
    assert b.token_ids == [3, 7]
    frontier = b.frontier(1, max_depth=2)
    assert frontier == [0, 1]
    b.expand(frontier, torch.stack([logits_with([4, 5]), logits_with([6, 2])]))
    assert len(b.token_ids) == 6
    tree, kept = b.finish(prefix_len=9, epoch=0)
    assert tree.num_nodes == 4 and tree.draft_probs is None
    parents = tree.parent_ids.tolist()
    assert all(p < i for i, p in enumerate(parents))          # topological, hence ancestor-closed
    scores = [b.scores[i] for i in kept]
    dropped = [b.scores[i] for i in range(6) if i not in kept]
    assert min(scores) >= max(dropped)                         # the most confident nodes were kept


def test_sampled_children_are_distinct_and_follow_q():
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0] + [-float("inf")] * (V - 4))
    q = torch.softmax(logits, -1)
    first = torch.zeros(V)
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        b = TreeBuilder(params, g, width=3, max_nodes=8, vocab_size=V)
        b.expand([ROOT], logits[None])
        assert len(set(b.token_ids)) == 3 and all(t < 4 for t in b.token_ids)
        first[b.token_ids[0]] += 1
    tv = (first / first.sum() - q).abs().sum() / 2
    assert tv < 0.04          # 3000 draws over 4 outcomes: the sampling noise is about 0.01
    tree, _ = b.finish(prefix_len=2, epoch=0)
    assert torch.allclose(tree.draft_probs[0], q)              # row 0: q of the root's children


def test_sampled_tree_respects_budget_and_support():
    params = SamplingParams(temperature=1.0)
    two_tokens = torch.tensor([0.0, 0.0] + [-float("inf")] * (V - 2))
    b = TreeBuilder(params, torch.Generator().manual_seed(1), width=4, max_nodes=5, vocab_size=V)
    b.expand([ROOT], two_tokens[None])
    assert len(b.token_ids) == 2                               # only two tokens have q > 0
    assert len(b.frontier(1, max_depth=3)) == 1                # budget 3 over 2 levels: one node
    b.expand(b.frontier(1, max_depth=2), torch.stack([logits_with(list(range(V)))] * 2))
    assert len(b.token_ids) == 5                               # the budget cut the expansion
    assert b.frontier(2, max_depth=3) == []
    tree, _ = b.finish(prefix_len=2, epoch=0)
    assert tree.draft_probs.shape == (6, V)
    assert tree.draft_probs[3:].sum() == 0                     # leaves: no children, no q


def _grown(params: SamplingParams, rows: torch.Tensor | None, logits: list[torch.Tensor], seed: int = 3):
    """A depth-3 tree grown from per-level logits (each [n, V] or [n, V'] over `rows`)."""
    b = TreeBuilder(params, torch.Generator().manual_seed(seed), width=2, max_nodes=5, vocab_size=V,
                    committed=[1, 2, 3], rows=rows)
    b.expand([ROOT], logits[0][: 1])
    for level, level_logits in enumerate(logits[1:], start=1):
        frontier = b.frontier(level, max_depth=3)
        b.expand(frontier, level_logits[: len(frontier)])
    tree, _ = b.finish(prefix_len=3, epoch=0)
    return tree, b.scores


def test_a_reduced_head_grows_the_tree_its_full_vocabulary_scatter_grows():
    """Logits over a reduced head's rows, expanded as they are, give the tree (tokens, parents,
    scores up to rounding, q) of the same logits scattered into the whole vocabulary with -inf
    elsewhere: greedy and seeded sampling (its noise keyed by token) on the rows alone,
    history-reading transforms over the scatter."""
    rows = torch.tensor([9, 2, 7, 4, 11])
    g = torch.Generator().manual_seed(0)
    reduced = [torch.randn(2, len(rows), generator=g) for _ in range(3)]
    full = []
    for x in reduced:
        f = torch.full((x.shape[0], V), float("-inf"))
        f[:, rows] = x
        full.append(f)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5),
                   SamplingParams(temperature=0.0, repetition_penalty=1.3)):
        got, got_scores = _grown(params, rows, reduced)
        want, want_scores = _grown(params, None, full)
        assert got.token_ids.tolist() == want.token_ids.tolist() and set(got.token_ids.tolist()) <= set(rows.tolist())
        assert got.parent_ids.tolist() == want.parent_ids.tolist()
        # log_softmax over 5 or 12 entries: the same values up to the sum's rounding
        torch.testing.assert_close(torch.tensor(got_scores), torch.tensor(want_scores), rtol=1e-6, atol=1e-6)
        if not params.greedy:
            torch.testing.assert_close(got.draft_probs, want.draft_probs)


def test_unseeded_sampling_over_a_reduced_head_draws_from_q_over_its_rows():
    """An unseeded sampled node over a reduced head draws (over the rows alone) from q, the
    temperature's softmax of those logits, and the tree carries that q over the rows alone, in
    ascending token order (zero at every other token)."""
    rows = torch.tensor([9, 2, 7, 4, 11])
    logits = torch.tensor([[1.5, 0.0, 0.7, -1.0, 0.3]])
    q = torch.softmax(logits[0] / 0.8, -1)
    first, g = torch.zeros(len(rows)), torch.Generator().manual_seed(0)
    for _ in range(3000):
        b = TreeBuilder(SamplingParams(temperature=0.8), g, width=2, max_nodes=4, vocab_size=V, rows=rows)
        b.expand([ROOT], logits)
        assert len(set(b.token_ids)) == 2 and set(b.token_ids) <= set(rows.tolist())
        first[rows.tolist().index(b.token_ids[0])] += 1
    assert (first / first.sum() - q).abs().sum() / 2 < 0.04     # sampling noise about 0.01
    tree, _ = b.finish(prefix_len=2, epoch=0)
    assert tree.draft_columns.tolist() == [2, 4, 7, 9, 11]
    torch.testing.assert_close(tree.draft_probs[0], q[torch.tensor([1, 3, 2, 0, 4])])
    want = torch.zeros(V)
    want[rows] = q
    torch.testing.assert_close(tree.dense_draft_probs(V)[0], want)


def test_a_head_whose_rows_span_the_vocabulary_in_its_own_order_ships_q_by_token():
    """A head's rows may name every token, in the head's own order: q is still over those rows
    as drawn, so the tree's columns are the token ids ascending and q follows them, not the
    head's order (a q row as wide as the vocabulary is not therefore in token order)."""
    rows = torch.randperm(V, generator=torch.Generator().manual_seed(3))
    logits = torch.linspace(-1.0, 1.0, V)[None]
    b = TreeBuilder(SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), width=1, max_nodes=1,
                    vocab_size=V, rows=rows)
    b.expand([ROOT], logits)
    tree, _ = b.finish(prefix_len=2, epoch=0)
    want = torch.zeros(V)
    want[rows] = torch.softmax(logits[0], -1)
    assert tree.draft_columns.tolist() == list(range(V))
    torch.testing.assert_close(tree.dense_draft_probs(V)[0], want)
    torch.testing.assert_close(tree.draft_probs[0], want)
