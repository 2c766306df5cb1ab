"""SamplingParams validation and the temperature / top-k / top-p transform."""
from __future__ import annotations

import pytest
import torch

from models import SamplingParams
from models.sampling import logits_to_probs


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "7"}, "seed"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.ignore_eos, p.stop_token_ids) == (1.0, 0, 1.0, None, False, [])
    assert not p.greedy and SamplingParams(temperature=0).greedy


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.0, 4.5]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_temperature_only_is_softmax_of_scaled_logits():
    logits = torch.randn(2, 3, 50, dtype=torch.float64)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7))
    assert probs.dtype == torch.float32 and probs.shape == (2, 3, 50)
    torch.testing.assert_close(probs, torch.softmax(logits.float() / 0.7, -1))


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(top_k=2))
    want = torch.zeros(5)
    want[[1, 2]] = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    torch.testing.assert_close(probs, want)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs_in = torch.tensor([0.05, 0.5, 0.3, 0.15])
    logits = probs_in.log()
    got = logits_to_probs(logits, SamplingParams(top_p=0.8))          # 0.5 + 0.3 reaches 0.8
    torch.testing.assert_close(got, torch.tensor([0.0, 0.625, 0.375, 0.0]))
    got = logits_to_probs(logits, SamplingParams(top_p=0.81))         # needs the 0.15 too
    torch.testing.assert_close(got, torch.tensor([0.0, 0.5, 0.3, 0.15]) / 0.95)
    got = logits_to_probs(logits, SamplingParams(top_p=0.1))          # the top token always stays
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_top_k_then_top_p_compose_per_row():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    got = logits_to_probs(logits, SamplingParams(top_k=3, top_p=0.7, temperature=2.0))
    # per row: keep the 3 largest, softmax of logits / 2, then nucleus at 0.7
    p3 = torch.softmax(torch.tensor([3.0, 2.0, 1.0]) / 2.0, -1)        # [0.506, 0.307, 0.186]
    kept = p3[:2] / p3[:2].sum()
    torch.testing.assert_close(got[0], torch.tensor([0.0, 0.0, kept[1], kept[0]]))
    torch.testing.assert_close(got[1], torch.tensor([kept[0], kept[1], 0.0, 0.0]))
