"""Fused rejection sampler: bit-equal to the torch reference, and exact in distribution.

The Triton kernel runs under TRITON_INTERPRET=1 (tests/kernels/conftest.py),
which costs ~0.1 s per row; the large-sample statistical tests therefore run
the reference over many draws and the kernel over a slice of the very same
draws, asserting `torch.equal` on that slice.
"""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import ref
from kernels.testing import random_parents

CHI2_DF4_P1E4 = 23.51  # chi-square critical value, 4 degrees of freedom, p = 1e-4


def random_batch(B, T, V, chain, greedy, gen):
    """Trees whose tokens are drawn without replacement from q (or near-argmax for greedy)."""
    target_probs = torch.softmax(torch.randn(B, T + 1, V, generator=gen) * 2, -1)
    noise = torch.randn(B, T + 1, V, generator=gen)
    draft_probs = torch.softmax(target_probs.log() + noise, -1)  # q near p: varied acceptance
    parent_ids = torch.empty(B, T, dtype=torch.int64)
    draft_token_ids = torch.empty(B, T, dtype=torch.int64)
    for b in range(B):
        parents = list(range(-1, T - 1)) if chain else random_parents(T, gen)
        parent_ids[b] = torch.tensor(parents, dtype=torch.int64)
        for u in range(-1, T):
            kids = [i for i in range(T) if parents[i] == u]
            if not kids:
                continue
            row = draft_probs[b, u + 1]
            picks = torch.multinomial(row, len(kids), replacement=False, generator=gen)
            for i, x in zip(kids, picks.tolist()):
                if greedy and float(torch.rand(1, generator=gen)) < 0.7:
                    x = int(target_probs[b, u + 1].argmax())
                draft_token_ids[b, i] = x
    num_nodes = torch.randint(0, T + 1, (B,), generator=gen)
    num_nodes[0] = T
    uniform = torch.rand(B, T, generator=gen)
    exp_noise = torch.empty(B, V).exponential_(generator=gen)
    return (draft_token_ids, parent_ids, num_nodes, target_probs,
            None if greedy else draft_probs, uniform, exp_noise)


def assert_bit_equal(args):
    got = kernels.rejection_sample(*args)
    want = ref.rejection_sample(*args)
    for name, g, w in zip(("accepted_nodes", "num_accepted", "next_token_ids"), got, want):
        assert g.dtype == torch.int64 and torch.equal(g, w), name
    return got


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "tree"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "stochastic"])
@pytest.mark.parametrize("T,V", [(5, 7), (9, 1500)])  # V = 1500: two tiles, the last partial
def test_kernel_equals_reference(chain, greedy, T, V):
    gen = torch.Generator().manual_seed(T * 100 + V + 2 * chain + greedy)
    args = random_batch(5, T, V, chain, greedy, gen)
    accepted, num_accepted, next_ids = assert_bit_equal(args)
    assert num_accepted.max() > 0, "draws must exercise acceptance"
    for b in range(5):  # accepted path is a root-to-node path, -1 padded
        k = int(num_accepted[b])
        assert (accepted[b, k:] == -1).all()
        parents = args[1][b]
        prev = -1
        for node in accepted[b, :k].tolist():
            assert int(parents[node]) == prev
            prev = node


def test_greedy_semantics():
    V = 10
    p = torch.zeros(1, 4, V)
    p[0, 0, 3] = p[0, 1, 5] = p[0, 2, 7] = p[0, 3, 1] = 1.0
    p += 0.01
    tokens = torch.tensor([[3, 5, 2]])      # chain: node 2 proposes 2, target wants 7
    args = (tokens, torch.tensor([[-1, 0, 1]]), torch.tensor([3]), p, None,
            torch.rand(1, 3), torch.ones(1, V))
    accepted, num_accepted, next_ids = assert_bit_equal(args)
    assert accepted.tolist() == [[0, 1, -1]] and num_accepted.item() == 2
    assert next_ids.item() == 7
    # tree: two children of the root, the second carries the target's token
    args = (torch.tensor([[4, 3, 7]]), torch.tensor([[-1, -1, 1]]), torch.tensor([3]),
            p, None, torch.rand(1, 3), torch.ones(1, V))
    accepted, num_accepted, next_ids = assert_bit_equal(args)
    assert accepted.tolist() == [[1, 2, -1]] and next_ids.item() == 1  # bonus token


@pytest.mark.parametrize("greedy", [True, False])
def test_plain_decoding_without_nodes(greedy):
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, 1, 50, generator=gen), -1)
    e = torch.empty(3, 50).exponential_(generator=gen)
    empty = torch.empty(3, 0, dtype=torch.int64)
    args = (empty, empty, torch.zeros(3, dtype=torch.int64), p, None if greedy else p,
            torch.empty(3, 0), e)
    accepted, num_accepted, next_ids = assert_bit_equal(args)
    assert accepted.shape == (3, 0) and (num_accepted == 0).all()
    expect = p[:, 0].argmax(-1) if greedy else (p[:, 0] / e).argmax(-1)
    assert torch.equal(next_ids, expect)


def test_zero_draft_prob_where_target_positive():
    """q puts all mass on token 0; p splits 0 and 1: token 1 must come as the correction."""
    V = 6
    p = torch.zeros(2, 2, V)
    p[:, 0, :2] = 0.5
    p[:, 1] = 1.0 / V
    q = torch.zeros(2, 2, V)
    q[:, :, 0] = 1.0
    uniform = torch.tensor([[0.7], [0.2]])  # 0.7 * 1 >= 0.5: reject; 0.2 < 0.5: accept
    args = (torch.zeros(2, 1, dtype=torch.int64), torch.full((2, 1), -1),
            torch.ones(2, dtype=torch.int64), p, q, uniform, torch.ones(2, V))
    accepted, num_accepted, next_ids = assert_bit_equal(args)
    assert num_accepted.tolist() == [0, 1]
    assert next_ids[0].item() == 1


def test_equal_target_and_draft_accepts_everything():
    gen = torch.Generator().manual_seed(2)
    B, T, V = 6, 4, 30
    args = list(random_batch(B, T, V, True, False, gen))
    args[4] = args[3].clone()  # q = p
    args[2] = torch.full((B,), T)
    for b in range(B):  # resample the chain's tokens from q = p
        for d in range(T):
            args[0][b, d] = torch.multinomial(args[3][b, d], 1, generator=gen)
    accepted, num_accepted, next_ids = assert_bit_equal(tuple(args))
    assert (num_accepted == T).all()
    assert torch.equal(next_ids, (args[3][:, T] / args[6]).argmax(-1))  # bonus from p


def test_one_hot_target_always_wins():
    gen = torch.Generator().manual_seed(3)
    B, T, V = 8, 3, 12
    args = list(random_batch(B, T, V, False, False, gen))
    args[3] = torch.zeros(B, T + 1, V)
    args[3][:, :, 4] = 1.0
    args[2] = torch.full((B,), T)
    accepted, num_accepted, next_ids = assert_bit_equal(tuple(args))
    tokens = args[0]
    for b in range(B):
        path = accepted[b, : int(num_accepted[b])].tolist()
        assert all(int(tokens[b, i]) == 4 for i in path)
        assert next_ids[b].item() == 4


def _far_off_batch(N, chain, gen):
    """p and q far apart (q = 0 on token 4 where p > 0); trees drawn from q."""
    p0 = torch.tensor([0.40, 0.05, 0.25, 0.10, 0.20])
    q0 = torch.tensor([0.05, 0.55, 0.10, 0.30, 0.00])
    T = 3
    target_probs = p0.expand(N, T + 1, 5).contiguous()
    draft_probs = q0.expand(N, T + 1, 5).contiguous()
    if chain:   # node d's token from q (row d)
        parents = [-1, 0, 1]
        tokens = torch.multinomial(q0.expand(N * T, 5), 1, generator=gen).view(N, T)
    else:       # three children of the root, without replacement
        parents = [-1, -1, -1]
        tokens = torch.multinomial(q0.expand(N, 5), 3, replacement=False, generator=gen)
    return (tokens, torch.tensor(parents).expand(N, T).contiguous(), torch.full((N,), T),
            target_probs, draft_probs, torch.rand(N, T, generator=gen),
            torch.empty(N, 5).exponential_(generator=gen)), p0


def _chi2(samples, probs):
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expect = probs.double() * samples.numel()
    return float(((counts - expect) ** 2 / expect).sum())


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "tree"])
def test_output_distribution_is_target(chain):
    N = 4000
    gen = torch.Generator().manual_seed(10 + chain)
    args, p0 = _far_off_batch(N, chain, gen)
    accepted, num_accepted, next_ids = ref.rejection_sample(*args)
    first = torch.where(num_accepted > 0,
                        args[0].gather(1, accepted[:, :1].clamp_min(0)).squeeze(1), next_ids)
    assert _chi2(first, p0) < CHI2_DF4_P1E4
    # the test has power: the drafted tokens alone are far from p
    assert _chi2(args[0][:, 0], p0) > 50 * CHI2_DF4_P1E4
    if chain:  # the token after an accepted first node follows p too (row 1 = p0)
        ok = num_accepted > 0
        second = torch.where(num_accepted[ok] > 1, args[0][ok][:, 1], next_ids[ok])
        assert _chi2(second, p0) < CHI2_DF4_P1E4
    # the kernel takes exactly the same decisions on a slice of these draws
    k = 32
    sliced = tuple(None if a is None else a[:k].contiguous() for a in args)
    got = kernels.rejection_sample(*sliced)
    for g, w in zip(got, (accepted[:k], num_accepted[:k], next_ids[:k])):
        assert torch.equal(g, w)
