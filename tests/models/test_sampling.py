"""SamplingParams validation and the temperature / top-k / top-p transform."""
from __future__ import annotations

import pytest
import torch

from models import SamplingParams
from models.sampling import TokenHistory, logits_to_probs, process_logits


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


def _full_sort_top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort each row descending, ties by token id, drop where the mass before ≥ top_p."""
    drop = torch.zeros_like(probs, dtype=torch.bool)
    for r, row in enumerate(probs.tolist()):
        before = 0.0
        for tok in sorted(range(len(row)), key=lambda t: (-row[t], t)):
            drop[r, tok] = before >= top_p
            before += row[tok]
    return drop


def test_top_p_over_candidates_cuts_where_a_full_sort_does(monkeypatch):
    """`_top_p_drop` sorts only candidates (a row's 64 largest, else the top buckets of a log2
    histogram, else the whole row): every path, over peaked, flat, tied and zero-filled rows and
    cuts from 1e-6 to 0.999, drops exactly the tokens the definition drops."""
    from models import sampling
    paths = {"top64": 0, "buckets": 0, "sort": 0}
    real_buckets = sampling._top_p_buckets

    def buckets(probs, top_p):
        cand = real_buckets(probs, top_p)
        paths["buckets" if cand is not None else "sort"] += 1
        return cand
    monkeypatch.setattr(sampling, "_top_p_buckets", buckets)
    gen = torch.Generator().manual_seed(0)
    for case in range(60):
        vocab, rows = (300, 700, 2048)[case % 3], 1 + case % 4
        logits = torch.randn(rows, vocab, generator=gen) * (0.3, 1.0, 4.0, 12.0)[case % 4]
        if case % 5 == 0:
            logits = (logits * 2).round() / 2                          # ties, at the cut too
        probs = torch.softmax(logits, -1)
        if case % 7 == 0:
            probs[0, : vocab // 2] = 0.0                               # exact zeros
            probs = probs / probs.sum(-1, keepdim=True)
        top_p = (1e-6, 0.3, 0.9, 0.95, 0.999)[case % 5]
        before = dict(paths)
        got = sampling._top_p_drop(probs, top_p)
        if paths == before:
            paths["top64"] += 1
        assert torch.equal(got, _full_sort_top_p_drop(probs, top_p)), (case, top_p)
    assert all(paths.values()), paths                                 # each path ran


def test_top_k_then_top_p_compose_per_row():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    got = logits_to_probs(logits, SamplingParams(top_k=3, top_p=0.7, temperature=2.0))
    # per row: keep the 3 largest, softmax of logits / 2, then nucleus at 0.7
    p3 = torch.softmax(torch.tensor([3.0, 2.0, 1.0]) / 2.0, -1)        # [0.506, 0.307, 0.186]
    kept = p3[:2] / p3[:2].sum()
    torch.testing.assert_close(got[0], torch.tensor([0.0, 0.0, kept[1], kept[0]]))
    torch.testing.assert_close(got[1], torch.tensor([kept[0], kept[1], 0.0, 0.0]))


@pytest.mark.parametrize("kwargs,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": 1.1}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ({"logit_bias": [(-1, 1.0)]}, "logit_bias"), ({"min_p": True}, "min_p"),
])
def test_invalid_transform_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_penalties_change_the_historys_tokens_as_the_dense_definition_does():
    """The penalties worked on the history's tokens alone give, bit for bit, the dense
    definition over the whole vocabulary: counts of output + path per row, seen = counted or in
    the prompt, x / r or x * r where seen, then x - f * count - p * (count > 0)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=gen) * 3
    committed = torch.randint(0, 300, (40,), generator=gen).tolist() + [7, 7, 299]
    paths = [[], [7], [7, 12], [7, 12, 7]]
    params = SamplingParams(presence_penalty=0.6, frequency_penalty=0.35, repetition_penalty=1.25, prompt_len=15)
    counts = torch.stack([torch.bincount(torch.tensor(committed[15:] + p), minlength=300) for p in paths]).float()
    seen = counts > 0
    seen[:, torch.tensor(committed[:15])] = True
    want = torch.where(seen, torch.where(logits > 0, logits / 1.25, logits * 1.25), logits)
    want = want - 0.35 * counts - 0.6 * (counts > 0).float()
    assert torch.equal(process_logits(logits, params, TokenHistory(committed, paths)), want)


@pytest.mark.parametrize("params", [
    SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, prompt_len=3),
    SamplingParams(logit_bias={5: 3.0, 40: -2.0, 63: 1.5}, min_tokens=9, eos_token_ids=[2, 60], prompt_len=3)],
    ids=["penalties", "bias-min-tokens"])
def test_history_transforms_on_columns_are_the_whole_vocabularys_at_those_tokens(params):
    """A reduced head's rows (`columns`): each transform is its token's own, so the columns get
    what the whole vocabulary's logits get at their tokens, whatever order the columns are in."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 64, generator=gen) * 3
    columns = torch.tensor([40, 2, 5, 7, 11, 9, 60, 33])             # not the bias's 63, not sorted
    history = TokenHistory([1, 2, 9, 7, 7, 11, 40], [[], [5], [5, 2]])
    want = process_logits(full, params, history)[:, columns]
    got = process_logits(full[:, columns], params, history, columns)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, full[:, columns])                     # the transforms did something


def test_history_transforms_need_a_history_and_read_each_rows_path():
    logits = torch.zeros(3, 6)
    params = SamplingParams(frequency_penalty=1.0, prompt_len=2)
    assert process_logits(logits, SamplingParams(), None) is logits     # nothing to read: unchanged
    with pytest.raises(ValueError, match="TokenHistory"):
        process_logits(logits, params, None)
    # committed = prompt [4, 4] + output [1]; rows: the root's, then paths [2] and [2, 1]
    out = process_logits(logits, params, TokenHistory([4, 4, 1], [[], [2], [2, 1]]))
    assert out[0].tolist() == [0, -1, 0, 0, 0, 0]          # prompt tokens are not output
    assert out[1].tolist() == [0, -1, -1, 0, 0, 0]
    assert out[2].tolist() == [0, -2, -1, 0, 0, 0]
    assert logits.abs().sum() == 0                         # the input is not modified


def test_logit_bias_pairs_survive_the_wire_form():
    from dataclasses import asdict

    p = SamplingParams(logit_bias={7: -100, 3: 2.5}, min_tokens=2)
    assert p.logit_bias == [(3, 2.5), (7, -100.0)]
    again = SamplingParams(**{**asdict(p), "logit_bias": [list(x) for x in asdict(p)["logit_bias"]]})
    assert again == p


def test_exponential_draws_follow_exponential_one_and_the_generator_alone():
    """An unseeded sampler's Exponential(1) draws: their distribution (Kolmogorov-Smirnov against
    1 - e^-x over 200K draws), a function of the generator's state, and the rows of one call
    those of one call a row (the one-call draft pass draws its levels at once, the level-by-level
    path one level after the other)."""
    from models.sampling import exponential

    draws = exponential((200_000,), torch.Generator().manual_seed(1)).double().sort().values
    cdf = 1 - torch.exp(-draws)
    ks = torch.maximum(torch.arange(1, 200_001) / 200_000 - cdf, cdf - torch.arange(200_000) / 200_000).max()
    assert ks < 1.63 / 200_000 ** 0.5                               # p > 0.01
    assert draws.mean().item() == pytest.approx(1.0, abs=0.01)
    at_once = exponential((3, 500), torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(4)
    assert torch.equal(at_once, torch.stack([exponential((500,), gen) for _ in range(3)]))
    assert not torch.equal(at_once, exponential((3, 500), torch.Generator().manual_seed(5)))
