"""Seeds that mean something (issue 24, item 5): a seeded sampled request is coupled (its token at
output position t is argmax(log p + G_t), G_t keyed by (seed, t)), so its text is a function of
the seed alone: byte-identical with speculation off, chain, tree and auto, with any draft, on
a fresh engine; and over seeds it still follows the target's distribution (chi-square), with a
control that the same test catches noise not keyed by the position."""
from __future__ import annotations

import pytest
import torch

from cluster.local import InProcessEngine, build_engine, speculation_for
from models import SamplingParams, load_model
from speculation.requests import GenerationRequest, SpeculationOptions
from tests.cluster.test_local_sampling import NUM_SAMPLES, P_VALUE_FLOOR, chi_square_p_value, exact_joint, sample_pairs

PROMPT = list(b"Once upon a time")
SPECS = [speculation_for("off", 4, 1), speculation_for("sync", 4, 1), speculation_for("sync", 3, 3),
         SpeculationOptions(mode="auto", spec_len=4, tree_width=2)]


def text(engine, seed: int, temperature: float, spec, **kw) -> list[int]:
    params = SamplingParams(temperature=temperature, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True, **kw)
    return engine.generate([GenerationRequest(f"r{seed}", PROMPT, params, spec)])[0].token_ids


def test_a_seed_gives_the_same_text_whatever_the_speculation(tiny_target, close_draft, far_draft):
    engines = [build_engine(tiny_target, close_draft).engine, build_engine(tiny_target, far_draft).engine]
    for seed, temperature in ((1, 0.7), (2, 1.0), (3, 1.3)):
        first = text(engines[0], seed, temperature, SPECS[0])
        for engine in engines:
            for spec in SPECS:
                assert text(engine, seed, temperature, spec) == first, (seed, temperature, spec)
        assert text(engines[1], seed, temperature, SPECS[2], frequency_penalty=0.5) == \
            text(engines[0], seed, temperature, SPECS[0], frequency_penalty=0.5)
    assert len({tuple(text(engines[0], seed, 1.0, SPECS[1])) for seed in range(4, 9)}) == 5
    drafted = sum(o.stats.num_accepted for o in engines[0].generate(
        [GenerationRequest("a", PROMPT, SamplingParams(temperature=0.7, seed=1, max_tokens=24), SPECS[1])]))
    assert drafted > 0                                          # the draft's tokens were accepted
    fresh = build_engine(tiny_target, close_draft).engine       # a restarted server
    assert text(fresh, 2, 1.0, SPECS[2]) == text(engines[0], 2, 1.0, SPECS[0])


def test_a_batch_does_not_change_a_seeded_text(tiny_target, close_draft):
    engine = build_engine(tiny_target, close_draft).engine
    alone = text(engine, 7, 1.0, SPECS[2])
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True) for s in (5, 7, 9)]
    outs = engine.generate([GenerationRequest(f"b{i}", PROMPT[: 10 + i], p, SPECS[2]) for i, p in enumerate(params)])
    again = engine.generate([GenerationRequest("b", PROMPT, params[1], SPECS[2])])[0].token_ids
    assert again == alone and len(outs) == 3


@pytest.fixture(scope="module")
def small_engine(small_vocab_pair):
    target, draft = small_vocab_pair
    return InProcessEngine(load_model(target), load_model(draft))


@pytest.mark.parametrize("spec", [speculation_for("sync", 3, 1), speculation_for("sync", 2, 3)], ids=["chain", "tree"])
def test_coupled_tokens_follow_the_target_over_seeds(small_engine, small_vocab_pair, spec):
    params = SamplingParams(temperature=1.0, top_p=0.9)
    samples, acceptance = sample_pairs(small_engine, params, spec, range(NUM_SAMPLES), seeded=True)
    p = chi_square_p_value(samples, exact_joint(small_vocab_pair[0], params))
    assert p > P_VALUE_FLOOR, f"coupled samples do not follow the target (p = {p:.2e})"
    assert 0.05 < acceptance < 0.9


def test_the_test_catches_noise_not_keyed_by_position(small_engine, small_vocab_pair, monkeypatch):
    import models.sampling as sampling

    real = sampling._position_keys
    monkeypatch.setattr(sampling, "_position_keys", lambda seed, positions: real(seed, [0] * len(positions)))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    samples, _ = sample_pairs(small_engine, params, speculation_for("sync", 3, 1), range(NUM_SAMPLES), seeded=True)
    assert chi_square_p_value(samples, exact_joint(small_vocab_pair[0], params)) < P_VALUE_FLOOR


def test_gumbel_noise_is_counter_based():
    from models.sampling import gumbel_noise

    both = gumbel_noise(11, [0, 5], 300)
    assert torch.equal(gumbel_noise(11, [5], 300)[0], both[1])            # no hidden state
    assert not torch.equal(gumbel_noise(12, [5], 300), gumbel_noise(11, [5], 300))
    assert not torch.equal(both[0], both[1])
    big = gumbel_noise(3, range(64), 4096)
    assert abs(big.mean().item() - 0.5772) < 0.01 and abs(big.std().item() - 1.2825) < 0.01
