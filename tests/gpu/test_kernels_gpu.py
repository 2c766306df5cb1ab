"""Kernels on CUDA at serving sizes: tree attention vs. the float64 reference, the
sampler bit-equal to its reference on GPU and on CPU, and its distribution.

Run in its own process (`pytest tests/gpu`, see bench/gpu_check.sh): the
interpreter switch of tests/kernels/conftest.py would otherwise apply here too.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def compiled_triton():
    """tests/kernels/conftest.py switches this process to the interpreter (checked at run time)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: run `pytest tests/gpu` on its own")

import kernels  # noqa: E402
from kernels import ref  # noqa: E402
from kernels.testing import make_paged_inputs, poison_allocations, random_parents, rel_err  # noqa: E402


@pytest.fixture
def poisoned(monkeypatch):
    """Output and scratch start as NaN, so a row the kernel fails to write shows up."""
    poison_allocations(monkeypatch)


def expected(inputs):
    """The reference on float64 copies of the inputs."""
    q, k, v, bt, pl, m = inputs
    return ref.tree_decode_attention(q.double(), k.double(), v.double(), bt, pl, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T,Hq,Hkv,D,page,prefix", [
    (4, 16, 32, 8, 128, 16, [32768, 1, 4097, 0]),   # Llama-3-8B heads, long prefix
    (2, 64, 32, 8, 128, 32, [9000, 777]),           # T * group = 256 rows: 4 row tiles
    (3, 1, 32, 8, 128, 16, [20000, 5, 0]),          # plain decoding
    (2, 7, 28, 4, 96, 16, [3001, 64]),              # D = 96, group 7
    (2, 5, 8, 8, 80, 32, [2500, 31]),               # D = 80, no GQA
    (1, 17, 8, 1, 64, 16, [1000]),                  # MQA
])
def test_tree_attention_large(poisoned, B, T, Hq, Hkv, D, page, prefix, dtype):
    inputs = make_paged_inputs(B, T, Hq, Hkv, D, page, prefix, dtype, seed=T + D, device="cuda")
    want = expected(inputs)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for splits in (None, 1, 2, 7):
        out = kernels.tree_decode_attention(*inputs, num_splits=splits)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"unwritten output, num_splits={splits}"
        assert rel_err(out, want) < tol, splits
        for b in range(B):
            assert rel_err(out[b], want[b]) < 2 * tol, (splits, b)


def _random_trees(B, T, V, greedy, seed):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(B, T + 1, V, generator=gen) * 3, -1)
    draft = torch.softmax(target.log() + torch.randn(B, T + 1, V, generator=gen), -1)
    parents = torch.tensor([random_parents(T, gen) for _ in range(B)])
    tokens = torch.empty(B, T, dtype=torch.int64)
    for b in range(B):
        for u in range(-1, T):
            kids = (parents[b] == u).nonzero().flatten().tolist()
            if kids:
                src = target if greedy else draft
                picks = torch.multinomial(src[b, u + 1], len(kids), generator=gen)
                if greedy:  # let the first child carry the target's choice
                    picks[0] = src[b, u + 1].argmax()
                tokens[b, kids] = picks
    num_nodes = torch.randint(0, T + 1, (B,), generator=gen)
    uniform = torch.rand(B, T, generator=gen)
    noise = torch.empty(B, V).exponential_(generator=gen)
    return (tokens, parents, num_nodes, target, None if greedy else draft, uniform, noise)


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("V", [32000, 128256])
def test_rejection_bit_equal_on_gpu(greedy, V):
    args = _random_trees(16, 24, V, greedy, seed=V + greedy)
    cuda_args = tuple(None if a is None else a.cuda() for a in args)
    got = kernels.rejection_sample(*cuda_args)
    want_gpu = ref.rejection_sample(*cuda_args)
    want_cpu = ref.rejection_sample(*args)
    for g, wg, wc in zip(got, want_gpu, want_cpu):
        assert torch.equal(g.cpu(), wg.cpu())
        assert torch.equal(g.cpu(), wc)


@pytest.mark.parametrize("width", [1, 4])
def test_rejection_distribution_on_gpu(width):
    """First emitted token ~ p for a far-off q, 400k draws through the kernel itself."""
    N, V = 400_000, 8
    gen = torch.Generator(device="cuda").manual_seed(width)
    p0 = torch.tensor([0.3, 0.05, 0.2, 0.1, 0.15, 0.05, 0.15, 0.0], device="cuda")
    q0 = torch.tensor([0.02, 0.4, 0.03, 0.25, 0.0, 0.2, 0.05, 0.05], device="cuda")
    T = 3 if width == 1 else width
    parents = list(range(-1, T - 1)) if width == 1 else [-1] * T
    target = p0.expand(N, T + 1, V).contiguous()
    draft = q0.expand(N, T + 1, V).contiguous()
    if width == 1:
        tokens = torch.multinomial(q0.expand(N * T, V), 1, generator=gen).view(N, T)
    else:
        tokens = torch.multinomial(q0.expand(N, V), T, replacement=False, generator=gen)
    args = (tokens, torch.tensor(parents, device="cuda").expand(N, T).contiguous(),
            torch.full((N,), T, device="cuda"), target, draft,
            torch.rand(N, T, generator=gen, device="cuda"),
            torch.empty(N, V, device="cuda").exponential_(generator=gen))
    accepted, num_accepted, next_ids = kernels.rejection_sample(*args)
    first = torch.where(num_accepted > 0,
                        tokens.gather(1, accepted[:, :1].clamp_min(0)).squeeze(1), next_ids)
    freq = torch.bincount(first, minlength=V).double() / N
    tv = 0.5 * float((freq - p0.double()).abs().sum())
    assert tv < 0.005, tv  # sampling noise at N = 400k is ~0.001
    assert int(first.eq(7).sum()) == 0  # p = 0 never comes out
