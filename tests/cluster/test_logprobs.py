"""Log-probabilities from the verification forward (issue 24, item 2): each token's and the top
k at its position are the target's own, as its sampler saw them (after penalties and
temperature), equal to Hugging Face's, whether speculation is off, a chain or a tree."""
from __future__ import annotations

import pytest
import torch

from cluster.local import InProcessEngine, speculation_for
from models import SamplingParams, load_model
from speculation.requests import GenerationRequest

PROMPT = list(b"Once upon a time")
SPECS = {"off": speculation_for("off", 4, 1), "chain": speculation_for("sync", 4, 1),
         "tree": speculation_for("sync", 3, 3)}


@pytest.fixture(scope="module")
def engine(tiny_target, close_draft):
    return InProcessEngine(load_model(tiny_target), load_model(close_draft))


def reference(model_dir, tokens: list[int], kw: dict) -> torch.Tensor:   # -> [len(tokens), V]
    """log_softmax((logits - penalties) / T) at each output position, from transformers."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1].double()   # [N, V]
    for j in range(len(tokens)):   # frequency penalty over the output before position j
        for t in tokens[:j]:
            logits[j, t] -= kw.get("frequency_penalty", 0.0)
    temperature = kw.get("temperature", 1.0) or 1.0
    return torch.log_softmax(logits / temperature, -1)


def generate(engine, kw: dict, spec, k: int, seed: int = 5):
    request = GenerationRequest("lp", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=k,
                                                             seed=seed, **kw), spec)
    out = engine.generate([request])[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 12
    return out


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.8, frequency_penalty=0.7)],
                         ids=["greedy", "sampled-penalised"])
def test_logprobs_are_the_targets_in_every_mode(engine, tiny_target, kw):
    k = 5
    outs = {mode: generate(engine, kw, spec, k) for mode, spec in SPECS.items()}
    for mode, out in outs.items():
        ref = reference(tiny_target, out.token_ids, kw)
        for j, lp in enumerate(out.logprobs):
            assert lp.token_id == out.token_ids[j]
            assert lp.logprob == pytest.approx(float(ref[j, lp.token_id]), abs=1e-4), (mode, j)
            top_v, top_i = ref[j].topk(k)
            assert [t for t, _ in lp.top] == top_i.tolist(), (mode, j)
            assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)
    assert sum(o.stats.num_accepted for o in outs.values()) > 0      # speculation did happen
    first = outs["off"]   # greedy, or seeded (coupled): the same tokens, so the same numbers
    for out in outs.values():
        assert out.token_ids == first.token_ids
        assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in first.logprobs], abs=1e-5)


def test_no_logprobs_unless_asked(engine):
    out = engine.generate([GenerationRequest("x", PROMPT, SamplingParams(max_tokens=4, temperature=0.0),
                                             SPECS["chain"])])[0]
    assert out.logprobs is None
    zero = generate(engine, dict(temperature=0.0), SPECS["tree"], 0)
    assert all(lp.top == [] for lp in zero.logprobs)


def test_prompt_logprobs_are_hugging_faces(engine, tiny_target):
    """An echo's prompt log-probabilities: None for the first token, then the target's after the
    tokens before each, and the top k there."""
    from transformers import LlamaForCausalLM

    params = SamplingParams(max_tokens=3, temperature=0.7, logprobs=1, prompt_logprobs=3, ignore_eos=True)
    out = engine.generate([GenerationRequest("echo", PROMPT, params, SPECS["tree"])])[0]
    hf = LlamaForCausalLM.from_pretrained(tiny_target).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0, :-1].double() / 0.7, -1)   # [P-1, V]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for j, lp in enumerate(out.prompt_logprobs[1:]):
        assert lp.token_id == PROMPT[j + 1]
        assert lp.logprob == pytest.approx(float(ref[j, PROMPT[j + 1]]), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[j].topk(3).indices.tolist()
