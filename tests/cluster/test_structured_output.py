"""Structured output is exact under speculation (issue 24, item 4).

Over the 16-token pair (token i spells the hex digit i) a regex whose second token's allowed
set depends on the first, so a tree's siblings are in different grammar states: the first
three sampled tokens, with a far draft, chains and trees, follow the target's own distribution
masked by an allowed set written out here by hand (not by the grammar engine). Controls: the
verifier forgetting the mask on p (the draft's q masked) is caught; the draft proposing freely
(`GrammarSpec.draft` False, only p masked) stays exact and costs acceptance. Greedy output with
speculation on equals the target alone under the same mask.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from cluster.local import InProcessEngine, speculation_for
from models import SamplingParams, load_model
from models.grammar import GrammarSpec, register_vocabulary
from models.sampling import logits_to_probs
from speculation.requests import GenerationRequest
from tests.cluster.test_local_sampling import P_VALUE_FLOOR, PROMPT, fits, fix_entropy

HEX = "0123456789abcdef"
STOP = 15                                  # "f": never in the pattern, the grammar's end
PATTERN = r"(1[0-4]|[2-5][5-9a-c])[0-7]"
NUM_SAMPLES = 800


def allowed(prefix: tuple[int, ...]) -> set[int]:
    """The tokens PATTERN allows after `prefix`, by hand."""
    if len(prefix) == 0:
        return {1, 2, 3, 4, 5}
    if len(prefix) == 1:
        return set(range(0, 5)) if prefix[0] == 1 else set(range(5, 13))
    if len(prefix) == 2:
        return set(range(8))
    return {STOP}


@pytest.fixture(scope="module")
def engine(small_vocab_pair):
    register_vocabulary("hex16", tokens=list(HEX), stop_ids=[STOP])
    target, draft = small_vocab_pair
    return InProcessEngine(load_model(target), load_model(draft))


def grammar(draft: bool = True) -> GrammarSpec:
    return GrammarSpec("regex", PATTERN, vocabulary="hex16", draft=draft)


def exact_joint(model_dir, kw: dict) -> torch.Tensor:   # [V, V, V]
    """P(x1, x2, x3) of the target alone, each row masked to `allowed`, from transformers' logits."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir).eval()
    V = hf.config.vocab_size
    params = SamplingParams(**kw)

    def probs(prefixes):
        with torch.no_grad():
            rows = hf(torch.tensor([PROMPT + list(x) for x in prefixes])).logits[:, -1].double()
        for row, x in zip(rows, prefixes):
            row[[v for v in range(V) if v not in allowed(x)]] = float("-inf")
        return logits_to_probs(rows, params).double()

    p1 = probs([()])[0]
    p2 = probs([(a,) for a in range(V)])
    p3 = probs(list(itertools.product(range(V), range(V))))
    return p1[:, None, None] * p2[:, :, None] * p3.reshape(V, V, V)


def sample(engine, kw: dict, spec, draft: bool = True, seeds=range(NUM_SAMPLES)) -> tuple[torch.Tensor, float]:
    fix_entropy(engine, seeds)
    requests = [GenerationRequest(f"g{seed}", PROMPT, SamplingParams(
        max_tokens=3, stop_token_ids=[STOP], grammar=grammar(draft), **kw), spec)
        for seed in seeds]
    outs = engine.generate(requests)
    samples = torch.tensor([(o.token_ids + [STOP] * 3)[:3] for o in outs])
    return samples, sum(o.stats.num_accepted for o in outs) / max(1, sum(o.stats.num_drafted for o in outs))


CASES = {
    "chain": (dict(temperature=1.0), speculation_for("sync", 3, 1)),
    "tree": (dict(temperature=1.2, top_p=0.95), speculation_for("sync", 2, 3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_masked_tokens_follow_the_target(engine, small_vocab_pair, case):
    kw, spec = CASES[case]
    samples, acceptance = sample(engine, kw, spec)
    bad = [s for s in samples.tolist() if any(s[k] not in allowed(tuple(s[:k])) for k in range(3))]
    assert not bad, f"{case}: outputs outside the grammar: {bad[:5]}"
    p = fits(samples, exact_joint(small_vocab_pair[0], kw))
    assert p > P_VALUE_FLOOR, f"{case}: sampled tokens do not follow the masked target (p = {p:.2e})"
    assert 0.1 < acceptance


def test_the_test_catches_p_unmasked(engine, small_vocab_pair, monkeypatch):
    """The drafter masks q, the verifier forgets the mask on p: residual draws leave the grammar."""
    import verifier.verifier as verifier_module
    from models.sampling import process_logits

    def no_grammar(logits, params, history):
        from dataclasses import replace
        return process_logits(logits, replace(params, grammar=None), history)

    monkeypatch.setattr(verifier_module, "process_logits", no_grammar)
    kw, spec = CASES["tree"]
    samples, _ = sample(engine, kw, spec, seeds=range(400))
    assert fits(samples, exact_joint(small_vocab_pair[0], kw)) < P_VALUE_FLOOR


def test_a_free_draft_is_exact_and_costs_acceptance(engine, small_vocab_pair):
    """q unmasked (`GrammarSpec.draft` False), p masked: still the target's distribution (the
    rejection sampler is exact for any q), with fewer drafted tokens accepted."""
    kw, spec = CASES["chain"]
    free, free_acc = sample(engine, kw, spec, draft=False)
    assert fits(free, exact_joint(small_vocab_pair[0], kw)) > P_VALUE_FLOOR
    _, aware_acc = sample(engine, kw, spec, seeds=range(NUM_SAMPLES, 2 * NUM_SAMPLES))
    assert aware_acc > free_acc + 0.1, (aware_acc, free_acc)


def test_greedy_under_a_grammar_is_the_target_alone(engine, small_vocab_pair):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(small_vocab_pair[0]).eval()
    expected: list[int] = []
    with torch.no_grad():
        for _ in range(4):
            row = hf(torch.tensor([PROMPT + expected])).logits[0, -1]
            ok = sorted(allowed(tuple(expected)))
            expected.append(ok[int(row[ok].argmax())])
    assert expected[-1] == STOP
    for spec in (speculation_for("off", 4, 1), speculation_for("sync", 4, 1), speculation_for("sync", 3, 3)):
        out = engine.generate([GenerationRequest("greedy", PROMPT, SamplingParams(
            temperature=0.0, max_tokens=8, stop_token_ids=[STOP], grammar=grammar()), spec)])[0]
        assert out.token_ids == expected, spec
        assert out.finish_reason == "stop"
