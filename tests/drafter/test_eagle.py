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


@pytest.mark.parametrize("one_call", [False, True])
@pytest.mark.parametrize("head", ["eagle_draft", "fused_eagle_draft"])
def test_committed_tokens_read_the_targets_previous_feature(tiny_target, head, one_call, request, monkeypatch):
    """Every catch-up row j reads f_{j-1}, the target's final hidden state at position j-1 (a
    fused head: its fusion of the target's layer outputs and final state there), on the
    level-by-level path and in the one-call pass (`models.draft_chain`) alike."""
    from models import draft_chain

    target, draft = load_model(tiny_target), load_model(request.getfixturevalue(head))
    engine = InProcessEngine(target, draft)
    engine.proposer.chains_in_c = one_call
    assert target.feature_layers == draft.aux_layers       # the engine asked the target for them
    seen = []            # (positions, ids, features) of every group of every draft forward
    real, real_chains = EagleDraft.forward_packed, draft_chain.run_chains

    def spy(self, groups, cache):
        seen.extend((g.positions.clone(), g.input_ids.clone(), g.features.clone()) for g in groups)
        return real(self, groups, cache)

    def spy_chains(model, cache, seq_ids, catch_up, *args, features=None, **kwargs):
        for s, ids, f in zip(seq_ids, catch_up, features):
            start = cache.seq_len(s)
            seen.append((torch.arange(start, start + len(ids)), ids.clone(), f.clone()))
        return real_chains(model, cache, seq_ids, catch_up, *args, features=features, **kwargs)

    monkeypatch.setattr(EagleDraft, "forward_packed", spy)
    monkeypatch.setattr(draft_chain, "run_chains", spy_chains)
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


@pytest.mark.parametrize("head", ["eagle_draft", "fused_eagle_draft"])
def test_chains_in_one_call_draft_what_the_level_by_level_path_drafts(tiny_target, head, request):
    """An EAGLE head's greedy chains in one C call (`models.draft_chain`): the same trees, the
    same predicted features kept for each node and the same draft K/V as the level-by-level
    forwards, through accepts, features arriving after them, and a rollback."""
    from kernels import cpu as cpu_kernels
    from models import draft_chain
    from speculation.proposal import DraftRequest
    from tests.drafter.test_model_proposer import assert_same_cached_kv

    if not cpu_kernels.decoder_layer_available():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    draft = load_model(request.getfixturevalue(head))
    one_call, by_level = (EagleProposer(draft, draft.new_cache(64, 16), 4, logit_rows=range(32, 127))
                          for _ in range(2))
    by_level.chains_in_c = False
    calls, real = [], draft_chain.run_chains
    draft_chain.run_chains = lambda *a, **k: calls.append(a[4]) or real(*a, **k)
    g, width = torch.Generator().manual_seed(0), draft.target_feature_width
    prompts = {"a": list(b"hello world, "), "b": list(b"The quick brown fox")}
    try:
        for s, t in prompts.items():
            feats = torch.randn(len(t) - 1, width, generator=g)
            for p in (one_call, by_level):
                p.observe_features(s, 0, feats)
        for round_, accept in enumerate([4, 0, 2, 1, 4, 3]):
            reqs = [DraftRequest(s, list(t), SamplingParams(temperature=0.0), torch.Generator(), 4)
                    for s, t in prompts.items()]
            got, want = one_call.propose(reqs), by_level.propose(reqs)
            for s, mine, theirs in zip(prompts, got, want):
                assert mine.token_ids.tolist() == theirs.token_ids.tolist(), (round_, s)
                assert mine.parent_ids.tolist() == theirs.parent_ids.tolist()
                pred_a, pred_b = one_call._pred[s], by_level._pred[s]
                assert pred_a.keys() == pred_b.keys() and all(torch.equal(pred_a[k], pred_b[k]) for k in pred_a)
                for p in (one_call, by_level):
                    p.on_verified(s, mine, list(range(accept)))
                assert torch.equal(one_call._features[s], by_level._features[s])
                n = len(prompts[s])
                prompts[s] = prompts[s] + mine.token_ids[:accept].tolist() + [40 + round_]
                feats = torch.randn(len(prompts[s]) - n, width, generator=g)   # the target's, arriving
                for p in (one_call, by_level):
                    p.observe_features(s, n - 1, feats)
            if round_ == 3:                # an epoch change: both roll back, a new root's feature arrives
                keep, feats = len(prompts["a"]) - 3, torch.randn(1, width, generator=g)
                for p in (one_call, by_level):
                    p.rollback("a", keep)
                    p.observe_features("a", keep - 1, feats)
                prompts["a"] = prompts["a"][:keep + 1]
    finally:
        draft_chain.run_chains = real
    assert len(calls) == 5 and all(c == 3 for c in calls)   # every pass but the first, three levels each
    assert_same_cached_kv(one_call.cache, by_level.cache, prompts)


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
