"""The seeded Gumbel noise in C (kernels/cpu/layer_ops.c: sf_gumbel_noise, sf_coupled_top)
against its definition from torch operators (models/sampling.py)."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu as cpu_kernels
from models import sampling

pytestmark = pytest.mark.skipif(not cpu_kernels.gumbel_available(),
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def torch_noise(seed: int, positions, tokens: torch.Tensor) -> torch.Tensor:   # [N, V]: the definition
    keys = sampling._position_keys(seed, positions)
    bits = sampling._splitmix64(keys[:, None] ^ tokens[None, :])
    u = (sampling._shr(bits, 11).double() + 0.5) * 2.0 ** -53
    return (-torch.log(-torch.log(u))).float()


@pytest.mark.parametrize("tokens", [None, torch.tensor([5, 0, 4095, 77, 1000])])
def test_the_c_noise_is_the_definitions(tokens):
    positions = [0, 3, 1 << 20]
    want = torch_noise(9, positions, torch.arange(4096) if tokens is None else tokens)
    got = sampling.gumbel_noise(9, positions, 4096, tokens)                 # the C path
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], cpu_kernels.gumbel_noise(sampling._position_keys(9, [3]), 4096, tokens)[0])


@pytest.mark.parametrize("k", [1, 2, 4])
def test_coupled_top_keeps_the_largest_scores_of_the_full_perturbation(k):
    g = torch.Generator().manual_seed(0)
    V = 3000
    peaked = torch.softmax(torch.randn(3, V, generator=g) * 6, -1)           # most tokens far below the top
    flat = torch.softmax(torch.randn(2, V, generator=g) * 0.1, -1)
    sparse = torch.zeros(1, V)
    sparse[0, [7, 11, 2999]] = torch.tensor([0.5, 0.3, 0.2])                 # fewer tokens than k at times
    probs = torch.cat([peaked, flat, sparse])
    positions = list(range(10, 10 + probs.shape[0]))
    params = sampling.SamplingParams(temperature=1.0, seed=4)
    full = probs.log() + sampling.gumbel_noise(4, positions, V)
    top = sampling.coupled_scores(probs, params, positions, top=k)
    kept = torch.isfinite(top)
    for r in range(probs.shape[0]):
        n = min(k, int((probs[r] > 0).sum()))
        assert top[r].topk(n).indices.tolist() == full[r].topk(n).indices.tolist()
        torch.testing.assert_close(top[r][kept[r]], full[r][kept[r]], rtol=1e-6, atol=1e-5)
    assert kept[:3].sum(-1).max() < V // 10                                   # the peaked rows: a few made


def test_coupled_top_over_a_reduced_heads_rows_is_the_full_vocabularys():
    rows = torch.tensor([3, 900, 41, 7, 2048, 5])
    probs = torch.softmax(torch.randn(2, len(rows), generator=torch.Generator().manual_seed(1)), -1)
    params = sampling.SamplingParams(temperature=1.0, seed=2)
    scattered = torch.zeros(2, 4096)
    scattered[:, rows] = probs
    reduced = sampling.coupled_scores(probs, params, [4, 5], rows, top=2)
    whole = sampling.coupled_scores(scattered, params, [4, 5], top=2)
    assert rows[reduced.topk(2).indices].tolist() == whole.topk(2).indices.tolist()
