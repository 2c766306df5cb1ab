"""Greedy exactness (DESIGN.md §4): speculative decoding emits, token for token, what
transformers' `generate(do_sample=False)` emits with the target alone."""
from __future__ import annotations

import pytest
import torch

from cluster.local import build_engine, speculation_for
from speculation.requests import GenerationRequest
from models import SamplingParams

PROMPTS = [list(b"def add(a, b):\n    return"), list(b"The quick brown fox"), [7]]
MAX_TOKENS = 24


def hf_greedy(hf_model, prompt, max_tokens, eos_token_id=None) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_tokens, eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(engine, prompts, *, mode="sync", K=4, W=1, proposer="model", max_tokens=MAX_TOKENS,
        ignore_eos=True):
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=ignore_eos),
                                  speculation_for(mode, K, W, proposer)) for i, p in enumerate(prompts)]
    return engine.generate(requests)


@pytest.fixture(scope="module")
def references(hf_target):
    return [hf_greedy(hf_target, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def close_engine(tiny_target, close_draft):
    return build_engine(tiny_target, close_draft).engine


@pytest.fixture(scope="module")
def far_engine(tiny_target, far_draft):
    return build_engine(tiny_target, far_draft).engine


def test_off_mode_is_the_target_alone(close_engine, references):
    outs = run(close_engine, PROMPTS, mode="off")
    assert [o.token_ids for o in outs] == references
    assert all(o.stats.num_drafted == 0 and o.stats.mean_accepted_len == 1.0 for o in outs)


@pytest.mark.parametrize("K,W", [(1, 1), (3, 1), (6, 1), (2, 2), (4, 3)])
def test_sync_close_draft_matches_hf(close_engine, references, K, W):
    outs = run(close_engine, PROMPTS, K=K, W=W)
    assert [o.token_ids for o in outs] == references
    drafted = sum(o.stats.num_drafted for o in outs)
    accepted = sum(o.stats.num_accepted for o in outs)
    # the close draft must actually be accepted, or the test would not exercise compaction
    assert 0 < accepted < drafted
    if K > 1:
        assert max(o.stats.mean_accepted_len for o in outs) > 1.5


@pytest.mark.parametrize("K,W", [(1, 1), (4, 1), (3, 2)])
def test_sync_far_draft_matches_hf(far_engine, references, K, W):
    outs = run(far_engine, PROMPTS, K=K, W=W)
    assert [o.token_ids for o in outs] == references
    assert sum(o.stats.num_drafted for o in outs) > 0


def test_ngram_proposer_matches_hf(close_engine, hf_target):
    prompt = list(b"abcabcabcabcabc xyz abcabc")   # the lookup has matches to propose
    ref = hf_greedy(hf_target, prompt, MAX_TOKENS)
    out, = run(close_engine, [prompt], K=3, proposer="ngram")
    assert out.token_ids == ref
    assert out.stats.num_drafted > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
@pytest.mark.parametrize("K,W", [(4, 1), (3, 2)])
def test_max_tokens_edges(close_engine, references, max_tokens, K, W):
    outs = run(close_engine, PROMPTS, K=K, W=W, max_tokens=max_tokens)
    for o, ref in zip(outs, references):
        assert o.token_ids == ref[:max_tokens]
        assert o.finish_reason == "length"


@pytest.mark.parametrize("K,W", [(4, 1), (3, 2)])
def test_eos_stops_like_hf(close_engine, hf_target, references, K, W):
    prompt, ref = PROMPTS[0], references[0]
    eos = ref[5]                                     # a token greedy decoding does reach
    expected = hf_greedy(hf_target, prompt, MAX_TOKENS, eos_token_id=eos)
    assert expected[-1] == eos and len(expected) <= 6
    close_engine.eos_token_ids = {eos}
    try:
        out, = run(close_engine, [prompt], K=K, W=W, ignore_eos=False)
        ignored, = run(close_engine, [prompt], K=K, W=W, ignore_eos=True)
    finally:
        close_engine.eos_token_ids = set()
    assert out.token_ids == expected and out.finish_reason == "stop"
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_stop_token_ids(close_engine, references):
    prompt, ref = PROMPTS[1], references[1]
    stop = ref[3]
    request = GenerationRequest("s", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                             stop_token_ids=[stop]),
                                speculation_for("sync", 4, 1))
    out, = close_engine.generate([request])
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"


def test_mixed_batch_in_lockstep(close_engine, references):
    """Different modes, proposers and widths in one generate call: each still exact."""
    specs = [speculation_for("off", 4, 1), speculation_for("sync", 5, 1),
             speculation_for("sync", 3, 3), speculation_for("sync", 4, 1, "ngram")]
    requests = [GenerationRequest(f"m{i}", PROMPTS[i % len(PROMPTS)],
                                  SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - i, ignore_eos=True),
                                  spec) for i, spec in enumerate(specs)]
    outs = close_engine.generate(requests)
    for i, o in enumerate(outs):
        assert o.token_ids == references[i % len(PROMPTS)][: MAX_TOKENS - i]
