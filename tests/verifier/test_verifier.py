"""Verification: rejection-sampler edges through the verifier's code path, and the
target cache after accept / rollback equals a cache built from the committed tokens."""
from __future__ import annotations

import pytest
import torch

from models import SamplingParams, load_model
from models.tree import TokenTree
from verifier import StaleTreeError, Verifier, VerifyRequest, rejection_sample

V = 8


def one_step(token: int, p: torch.Tensor, q: torch.Tensor, u: float, seed: int = 0):
    """A one-node chain: (num_accepted, next_token) for draft token `token`."""
    target = torch.stack([p, torch.full((V,), 1.0 / V)])[None]                 # [1, 2, V]
    draft = torch.stack([q, torch.zeros(V)])[None]
    noise = torch.empty(1, V).exponential_(generator=torch.Generator().manual_seed(seed))
    _, n, nxt = rejection_sample(torch.tensor([[token]]), torch.tensor([[-1]]), torch.tensor([1]),
                                 target, draft, torch.tensor([[u]]), noise)
    return int(n[0]), int(nxt[0])


def test_q_zero_where_p_positive_is_always_accepted():
    p = torch.full((V,), 1.0 / V)
    q = torch.zeros(V)
    q[1] = 1.0
    assert one_step(3, p, q, u=0.999)[0] == 1                 # q(3) = 0 < p(3): min(1, p/q) = 1


def test_p_equal_q_is_always_accepted():
    p = torch.softmax(torch.arange(V, dtype=torch.float32), -1)
    for u in (0.0, 0.5, 0.999999):
        for token in (0, 7):
            assert one_step(token, p, p.clone(), u)[0] == 1


def test_one_hot_p_forces_its_token():
    p = torch.zeros(V)
    p[5] = 1.0
    q = torch.full((V,), 1.0 / V)
    for seed in range(20):
        assert one_step(5, p, q, u=0.99, seed=seed)[0] == 1    # u q(5) < p(5) = 1 for any u < 1
        assert one_step(2, p, q, u=0.0, seed=seed) == (0, 5)   # p(2) = 0: rejected, residual is p


def test_rejected_token_is_never_the_correction():
    p = torch.tensor([0.3, 0.3, 0.4] + [0.0] * (V - 3))
    q = torch.tensor([0.9, 0.05, 0.05] + [0.0] * (V - 3))
    corrections = {one_step(0, p, q, u=0.99, seed=s)[1] for s in range(50)}
    assert 0 not in corrections and corrections <= {1, 2}     # residual: max(p - q, 0) on {1, 2}


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


def next_logits(model, cache, seq_id, token, position):   # -> [V]
    from models.transformer import causal_mask

    return model(torch.tensor([[token]]), torch.tensor([[position]]), cache, [seq_id], causal_mask(1, 1))[0, 0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_after_verify_equals_a_fresh_prefill(target, temperature):
    prompt = list(b"speculative ")
    # a branching tree whose first branch is the target's own greedy continuation
    greedy = []
    token, pos = prompt[-1], len(prompt) - 1
    probe = Verifier(target, target.new_cache(32, 16))
    probe.prefill("g", prompt)
    for _ in range(2):
        token = int(next_logits(target, probe.cache, "g", token, pos).argmax())
        greedy.append(token)
        pos += 1
    tree = TokenTree(torch.tensor([greedy[0], 99, greedy[1], 98]), torch.tensor([-1, -1, 0, 0]),
                     torch.tensor([1, 1, 2, 2]), None, prefix_len=len(prompt))
    params = SamplingParams(temperature=temperature)
    if temperature > 0:
        tree.draft_probs = torch.softmax(torch.randn(5, target.config.vocab_size), -1)
    v = Verifier(target, target.new_cache(32, 16))
    v.prefill("s", prompt)
    res, = v.verify([VerifyRequest("s", prompt[-1], tree, params, torch.Generator().manual_seed(0))])
    if temperature == 0:
        assert res.accepted_nodes == [0, 2] and res.token_ids[:2] == greedy
    committed = prompt + res.token_ids
    assert v.cache.seq_len("s") == len(committed) - 1
    fresh = Verifier(target, target.new_cache(32, 16))
    fresh.prefill("f", committed)
    got = next_logits(target, v.cache, "s", committed[-1], len(committed) - 1)
    want = next_logits(target, fresh.cache, "f", committed[-1], len(committed) - 1)
    assert torch.allclose(got, want, atol=1e-5)


def test_q_over_a_reduced_heads_columns_verifies_as_the_same_q_over_the_vocabulary(target):
    """A tree whose q holds only a reduced head's columns (`draft_columns`) is verified exactly
    as the tree carrying that q scattered into the vocabulary: same draws, same tokens."""
    vocab, prompt = target.config.vocab_size, list(b"speculative ")
    columns = torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:vocab // 3]).values
    q = torch.softmax(torch.randn(5, len(columns), generator=torch.Generator().manual_seed(2)) * 3, -1)
    tokens = columns[torch.multinomial(q[:4], 1).squeeze(1)]      # each node drawn from its parent's row
    results = []
    for reduced in (True, False):
        tree = TokenTree.chain(tokens, q, prefix_len=len(prompt), draft_columns=columns) if reduced else \
            TokenTree.chain(tokens, None, prefix_len=len(prompt))
        if not reduced:
            tree.draft_probs = TokenTree.chain(tokens, q, len(prompt), draft_columns=columns).dense_draft_probs(vocab)
        for seed in range(6):
            v = Verifier(target, target.new_cache(32, 16))
            v.prefill("s", prompt)
            res, = v.verify([VerifyRequest("s", prompt[-1], tree, SamplingParams(temperature=1.0),
                                           torch.Generator().manual_seed(seed))])
            results.append((reduced, seed, res.accepted_nodes, res.token_ids))
    assert [r[2:] for r in results[:6]] == [r[2:] for r in results[6:]]
    assert len({tuple(r[3]) for r in results[:6]}) > 1, "the seeds draw different outcomes"


def test_stale_tree_is_refused(target):
    v = Verifier(target, target.new_cache(8, 16))
    v.prefill("s", [1, 2, 3])
    stale = TokenTree.chain([4], None, prefix_len=5)
    with pytest.raises(StaleTreeError):
        v.verify([VerifyRequest("s", 3, stale, SamplingParams(temperature=0.0), torch.Generator())])
    res, = v.verify([VerifyRequest("s", 3, TokenTree.empty(3), SamplingParams(temperature=0.0),
                                   torch.Generator())])
    assert res.accepted_nodes == [] and len(res.token_ids) == 1 and v.cache.seq_len("s") == 3


def test_greedy_walk_equals_the_sampler_with_one_hot_targets():
    """The verifier's greedy path (`greedy_walk` on each row's argmax) against the reference
    sampler fed the one-hot probabilities it used to get, on random trees whose tokens hit
    the argmax often, with ties in the logits (the first maximum wins in both)."""
    from kernels import ref
    from kernels.testing import random_parents
    from models.sampling import logits_to_probs
    from verifier.verifier import greedy_walk

    gen = torch.Generator().manual_seed(5)
    greedy = SamplingParams(temperature=0.0)
    agreed_deep = 0
    for trial in range(300):
        T, vocab = int(torch.randint(1, 9, (1,), generator=gen)), 6
        logits = torch.randint(0, 3, (T + 1, vocab), generator=gen).float()     # many ties
        parents = random_parents(T, gen) if trial % 2 else list(range(-1, T - 1))
        best = logits.argmax(-1).tolist()
        tokens = []
        for i, p in enumerate(parents):
            x = best[p + 1] if float(torch.rand(1, generator=gen)) < 0.6 else int(torch.randint(0, vocab, (1,), generator=gen))
            siblings = [tokens[j] for j in range(i) if parents[j] == p]
            tokens.append(x if x not in siblings else next(t for t in range(vocab) if t not in siblings))
        path, next_id = greedy_walk(parents, tokens, best)
        acc, n, nxt = ref.rejection_sample(torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([T]),
                                           logits_to_probs(logits, greedy)[None], None,
                                           torch.zeros(1, T), torch.ones(1, vocab))
        assert path == acc[0, : int(n[0])].tolist() and next_id == int(nxt[0]), (parents, tokens, best)
        agreed_deep += len(path) >= 2
    assert agreed_deep > 30     # the walks went deep, not only rejected at the root
