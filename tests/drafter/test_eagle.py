"""The feature-conditioned (EAGLE) draft proposer (drafter/eagle_proposer.py): feature plumbing,
exactness (the head itself is in tests/models/test_eagle.py)."""
from __future__ import annotations

import pytest
import torch

from cluster.local import InProcessEngine, build_engine, speculation_for
from speculation.requests import GenerationRequest, SpeculationOptions
from drafter import EagleProposer
from drafter.eagle_proposer import MissingFeaturesError
from models import SamplingParams, load_model
from models.eagle import EagleDraft
from models.transformer import causal_mask

PROMPTS = [list(b"def add(a, b):\n    return"), list(b"The quick brown fox"), [7]]
MAX_TOKENS = 20


def greedy(engine, prompts, spec, max_tokens=MAX_TOKENS):
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=True), spec)
                for i, p in enumerate(prompts)]
    return engine.generate(requests)


@pytest.fixture(scope="module")
def eagle_engine(tiny_target, eagle_draft):
    return build_engine(tiny_target, eagle_draft).engine


@pytest.fixture(scope="module")
def references(hf_target):
    from tests.cluster.test_local_greedy import hf_greedy

    return [hf_greedy(hf_target, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("K,W", [(1, 1), (3, 1), (4, 2), (3, 3)])
def test_greedy_output_is_the_targets(eagle_engine, references, K, W):
    outs = greedy(eagle_engine, PROMPTS, speculation_for("sync", K, W))
    assert [o.token_ids for o in outs] == references
    assert all(o.stats.num_drafted > 0 for o in outs)
    assert isinstance(eagle_engine.proposer, EagleProposer)


@pytest.mark.parametrize("K,W", [(3, 1), (4, 2)])
def test_a_fused_head_drafts_exactly_too(tiny_target, fused_eagle_draft, references, K, W):
    outs = greedy(build_engine(tiny_target, fused_eagle_draft).engine, PROMPTS, speculation_for("sync", K, W))
    assert [o.token_ids for o in outs] == references
    assert all(o.stats.num_drafted > 0 for o in outs)


def test_auto_mode_and_mixed_batches_stay_exact(eagle_engine, references):
    """"auto" sequences decode alone at times: their features must keep flowing anyway."""
    specs = [SpeculationOptions(mode="auto", spec_len=3), speculation_for("off", 3, 1),
             speculation_for("sync", 2, 2, "ngram")]
    requests = [GenerationRequest(f"m{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                              ignore_eos=True), s)
                for i, (p, s) in enumerate(zip(PROMPTS, specs))]
    assert [o.token_ids for o in eagle_engine.generate(requests)] == references


@pytest.mark.parametrize("head", ["eagle_draft", "fused_eagle_draft"])
def test_committed_tokens_read_the_targets_previous_feature(tiny_target, head, request, monkeypatch):
    """Every catch-up row j reads f_{j-1}, the target's final hidden state at position j-1 (a
    fused head: its fusion of the target's layer outputs and final state there)."""
    target, draft = load_model(tiny_target), load_model(request.getfixturevalue(head))
    engine = InProcessEngine(target, draft)
    assert target.feature_layers == draft.aux_layers       # the engine asked the target for them
    seen = []            # (positions, ids, features) of every group of every draft forward
    real = EagleDraft.forward_packed

    def spy(self, groups, cache):
        seen.extend((g.positions.clone(), g.input_ids.clone(), g.features.clone()) for g in groups)
        return real(self, groups, cache)

    monkeypatch.setattr(EagleDraft, "forward_packed", spy)
    prompt = PROMPTS[0]
    out = greedy(engine, [prompt], speculation_for("sync", 3, 1))[0]
    full = prompt + out.token_ids
    cache = target.new_cache(8)
    cache.add_sequence("ref")
    with torch.inference_mode():
        _, hidden = target(torch.tensor([full]), torch.arange(len(full))[None], cache, ["ref"],
                           causal_mask(1, len(full)), return_hidden=True)
    hidden = draft.fuse_features(hidden[0])
    fed = set()          # positions fed as (committed token, the target's feature before it)
    for positions, ids, feats in seen:
        for pos, tok, f in zip(positions.reshape(-1).tolist(), ids.reshape(-1).tolist(),
                               feats.reshape(-1, feats.shape[-1])):
            if 0 < pos < len(full) and full[pos] == tok and torch.allclose(f, hidden[pos - 1], atol=1e-4):
                fed.add(pos)
    # every committed token but those of the last step (at most K + 1 = 4) was fed that way
    assert set(range(1, len(full) - 4)) <= fed
    first = seen[0]
    assert torch.equal(first[2][0, 0], torch.zeros(target.config.hidden_size))   # position 0: no feature


def test_missing_features_are_a_clear_error(tiny_target, eagle_draft):
    from speculation.proposal import DraftRequest

    draft = load_model(eagle_draft)
    proposer = EagleProposer(draft, draft.new_cache(8), 4)
    request = DraftRequest("s", [1, 2, 3], SamplingParams(temperature=0.0), torch.Generator(), 2)
    with pytest.raises(MissingFeaturesError, match="features of only 0"):
        proposer.propose([request])
    proposer.observe_features("s", 0, torch.zeros(2, draft.config.hidden_size))
    tree = proposer.propose([request])[0]
    assert tree.num_nodes == 2
    with pytest.raises(MissingFeaturesError):
        proposer.observe_features("s", 5, torch.zeros(1, draft.config.hidden_size))


def test_sampled_tokens_follow_the_target(tmp_path, small_vocab_pair):
    """Chi-square of the first two sampled tokens against the target's own joint distribution
    (the same test as the engine's, `tests/cluster/test_local_sampling.py`)."""
    from tests.cluster.test_local_sampling import (NUM_SAMPLES, P_VALUE_FLOOR, chi_square_p_value,
                                                    exact_joint, sample_pairs)
    from tests.conftest import save_eagle

    target = small_vocab_pair[0]
    save_eagle(tmp_path / "eagle", target, seed=7, fc_scale=1.0)
    engine = InProcessEngine(load_model(target), load_model(tmp_path / "eagle"))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    samples, acceptance = sample_pairs(engine, params, speculation_for("sync", 2, 2), range(NUM_SAMPLES))
    p = chi_square_p_value(samples, exact_joint(target, params))
    assert p > P_VALUE_FLOOR, f"sampled pairs do not follow the target (p = {p:.2e})"
    assert 0.05 < acceptance < 0.95        # both acceptance and the residual are exercised


def test_engines_sharing_a_target_each_get_the_features_their_head_reads(tiny_target, eagle_draft, fused_eagle_draft,
                                                                         references):
    """One target, a fused head's engine and a plain head's built on it in turn (bench/e2e.py's
    way): each verifier sets the target's feature layers before its forwards, so neither engine
    reads the other's width, and the plain one pays for no extra outputs."""
    target = load_model(tiny_target)
    fused = InProcessEngine(target, load_model(fused_eagle_draft))
    plain = InProcessEngine(target, load_model(eagle_draft))
    for engine, layers in ((fused, (0, 1)), (plain, ()), (fused, (0, 1))):
        assert [o.token_ids for o in greedy(engine, PROMPTS, speculation_for("sync", 3, 1))] == references
        assert target.feature_layers == layers
