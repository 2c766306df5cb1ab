"""A sampled draft draw under min-p, top-k and top-p in C (kernels/cpu/sample_cut.c through
sf_sample_pick) against `models.sampling.logits_to_probs`, the rules the target's rows follow."""
from __future__ import annotations

import itertools

import pytest
import torch

from kernels import cpu as cpu_kernels
from models.sampling import SamplingParams, logits_to_probs

pytestmark = pytest.mark.skipif(not cpu_kernels.gumbel_available(),
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")

CUTS = [(0.0, 0, 0.9), (0.0, 0, 0.5), (0.0, 0, 1e-6), (0.0, 0, 0.999), (0.0, 7, 1.0), (0.0, 1, 1.0),
        (0.0, 300, 0.95), (0.05, 0, 1.0), (0.3, 0, 1.0), (0.02, 40, 0.8)]


@pytest.mark.parametrize("min_p,top_k,top_p", CUTS)
def test_a_cut_draw_draws_from_the_targets_rules(min_p, top_k, top_p):
    """Each row's q is logits_to_probs' (the same support, the same probabilities to float
    rounding), over peaked, flat and tied rows, and the draw is the first largest log q + noise."""
    gen = torch.Generator().manual_seed(top_k + int(1000 * top_p) + int(100 * min_p))
    for vocab, scale, temp, ties in itertools.product((513, 8192), (0.7, 3.0, 9.0), (0.6, 1.3), (False, True)):
        logits = torch.randn(3, vocab, generator=gen) * scale
        if ties:
            logits = (logits * 2).round() / 2
        noise = -torch.empty(3, vocab).exponential_(generator=gen).log()
        want = logits_to_probs(logits, SamplingParams(temperature=temp, min_p=min_p, top_k=top_k, top_p=top_p))
        index, log_q, q = cpu_kernels.sample_pick(logits, torch.full((3,), temp), noise,
                                                  tuple(torch.full((3,), v) for v in (min_p, top_k, top_p)))
        case = (vocab, scale, temp, ties)
        edge = q.gt(0) != want.gt(0)
        if edge.any():               # only where a token's mass before it is top_p to rounding
            before = _mass_before(logits, SamplingParams(temperature=temp, min_p=min_p, top_k=top_k))
            assert (before[edge] - top_p).abs().max() < 1e-5, case
            want = torch.where(edge, q, want)
            want = want / want.sum(-1, keepdim=True)
        torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-7)
        assert torch.equal(index, (want.log() + noise).argmax(-1)), case
        torch.testing.assert_close(log_q, want.gather(1, index[:, None]).squeeze(1).log(), rtol=1e-5, atol=1e-6)


def _mass_before(logits: torch.Tensor, uncut: SamplingParams) -> torch.Tensor:   # [N, V] float64
    """Each token's probability mass before it (descending, ties by token id) without top-p."""
    probs = logits_to_probs(logits, uncut).double()
    out = torch.empty_like(probs)
    for r in range(probs.shape[0]):
        order = torch.tensor(sorted(range(probs.shape[1]), key=lambda j, row=probs[r].tolist(): (-row[j], j)))
        out[r, order] = probs[r, order].cumsum(0) - probs[r, order]
    return out


def test_rows_without_a_cut_and_greedy_rows_beside_a_cut_keep_their_own_draws():
    """Per-row cuts: a row at (0, 0, 1) draws from its temperature's softmax as a pass without cuts
    does (bit for bit), a greedy row takes its largest logit, a cut row its cut."""
    gen = torch.Generator().manual_seed(3)
    logits, noise = torch.randn(3, 1000, generator=gen) * 4, -torch.empty(3, 1000).exponential_(generator=gen).log()
    temps = torch.tensor([0.8, 0.0, 1.1])
    cuts = (torch.tensor([0.0, 0.0, 0.0]), torch.tensor([0, 0, 5]), torch.tensor([1.0, 1.0, 0.7]))
    index, log_q, q = cpu_kernels.sample_pick(logits, temps, noise, cuts)
    plain_index, plain_log_q, plain_q = cpu_kernels.sample_pick(logits, temps, noise)
    assert index[0] == plain_index[0] and log_q[0] == plain_log_q[0] and torch.equal(q[0], plain_q[0])
    assert index[1] == logits[1].argmax() and not q[1].any()
    want = logits_to_probs(logits[2:], SamplingParams(temperature=1.1, top_k=5, top_p=0.7))
    assert torch.equal(q[2:] > 0, want > 0) and int((q[2] > 0).sum()) <= 5
    assert index[2] == (want.log() + noise[2:]).argmax()


def test_the_draw_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="each cut"):
        cpu_kernels.sample_pick(torch.zeros(2, 8), torch.ones(2), torch.zeros(2, 8),
                                (torch.zeros(2), torch.zeros(3), torch.ones(2)))
