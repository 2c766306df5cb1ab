"""The verifier's own prompt-lookup chains (verifier/lookup.py; no Ray, no drafter tree): where the draft
model is off for a sequence, n-grams of its prompt and output are verified instead, greedy
output stays the target's, sampled output keeps the target's distribution, and the steps
still run on the cores a plain step would."""
from __future__ import annotations

import asyncio

import torch

from models.sampling import SamplingParams
from speculation.cost_model import CostModel
from tests.cluster.pipeline_helpers import hf_greedy
from tests.cluster.test_pipeline_sampling import chi2, chi2_critical

from .harness import Harness, run_restoring_threads

CYCLE = list(b"abcdefghijkl")            # the copying target walks this cycle (tests/conftest.py)
REPEATING = CYCLE * 2 + CYCLE[:5]


def _actor(target, **settings) -> Harness:
    """A verifier whose planners see fixed step costs, 50 ms + 1 ms a row (about the embedded
    target's shape on this CPU), not this tiny model's noisy timings."""
    va = Harness(target, **{"num_blocks": 64, "block_size": 16, **settings})
    costs = va.scheduler.costs
    costs.plain, costs.overlap = CostModel(a=0.05, b=0.001), CostModel(a=0.05, b=0.001)
    for model in (costs.plain, costs.overlap):
        model.observe_verify = lambda *a: None
    return va


async def _generate(va: Harness, rid: str, prompt: list[int], params: SamplingParams,
                    mode: str = "auto") -> tuple[list[int], list[int]]:
    """(tokens, tokens per chunk) of one request."""
    tokens, sizes = [], []
    async for chunk in va.generate(rid, prompt, params, {"mode": mode}):
        tokens += chunk.token_ids
        sizes.append(len(chunk.token_ids))
    return tokens, sizes


def test_lookup_chains_keep_greedy_output_exact(copying_target):
    from transformers import LlamaForCausalLM

    tiny_target = copying_target
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = hf_greedy(LlamaForCausalLM.from_pretrained(copying_target).eval(), REPEATING, 40)

    async def scenario():
        on = _actor(tiny_target)                                     # no drafter at all
        tokens, sizes = await _generate(on, "r", REPEATING, params)
        off = _actor(tiny_target, lookup=False)
        tokens_off, sizes_off = await _generate(off, "r", REPEATING, params)
        fixed = _actor(tiny_target)
        tokens_fixed, _ = await _generate(fixed, "r", REPEATING, params, mode="off")
        return on, tokens, sizes, off, tokens_off, sizes_off, fixed, tokens_fixed

    on, tokens, sizes, off, tokens_off, sizes_off, fixed, tokens_fixed = run_restoring_threads(scenario(), 240)
    assert tokens == tokens_off == tokens_fixed == expected
    st = on.scheduler.stats
    assert st.lookup_trees > 0 and st.lookup_accepted > 0, "the prompt repeats itself: lookup must find it"
    assert st.lookup_drafted == st.num_drafted and st.lookup_accepted == st.num_accepted
    assert max(sizes) > 1 and len(sizes) < len(sizes_off) == 40      # fewer steps than tokens
    assert off.scheduler.stats.lookup_trees == 0 and off.scheduler.stats.num_drafted == 0
    assert fixed.scheduler.stats.lookup_trees == 0                              # mode "off" means off
    assert not on.scheduler.lookup.planner.seqs and not on.scheduler.streams   # per-request state released
    assert on.side.cache.num_free_blocks == on.side.cache.num_blocks


def test_lookup_is_not_used_where_it_does_not_pay(tiny_target):
    """A sequence whose lookups keep failing goes back to decoding alone (probed now and then)."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    async def scenario():
        va = _actor(tiny_target)
        # every lookup proposes a token the target never picks here (no byte of the prompt is 255)
        from speculation import proposal as ngram
        real = ngram.lookup
        ngram.lookup = lambda tokens, k, *a: [255] * k
        try:
            tokens, sizes = await _generate(va, "r", REPEATING, params)
        finally:
            ngram.lookup = real
        return va, tokens

    va, tokens = run_restoring_threads(scenario(), 240)
    assert len(tokens) == 48
    st = va.scheduler.stats
    assert st.lookup_trees > 0 and st.lookup_accepted == 0
    assert st.lookup_trees <= 12, f"{st.lookup_trees} rejected chains in 48 steps: never switched off"


def test_lookup_steps_run_on_the_idle_drafters_core(copying_target):
    tiny_target = copying_target
    async def scenario():
        va = _actor(tiny_target)
        va.scheduler.registry.node_id = "n1"
        await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0)       # a drafter on our node
        va.scheduler.adaptive.plan = va.scheduler.adaptive.plan_joining = \
            lambda streams, *_, **__: {s: (0, 0) for s in streams}
        used = []
        verify = va.side.verify
        va.side.verify = lambda requests, threads=None, chunks=None: (used.append((threads, max(
            r.tree.num_nodes for r in requests))), verify(requests, threads, chunks))[1]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        async for _ in va.generate("r", REPEATING, params, {"mode": "auto"}):
            await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0)   # stays live, puts no tree
        return used, va

    used, va = run_restoring_threads(scenario(), 240)
    assert any(nodes for _, nodes in used), "no lookup chain was verified"
    assert all(threads == 2 for threads, _ in used)
    assert va.scheduler.stats.borrowed_steps == len(used)


def _joint(model_dir, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """p(x1, x2 | prompt) of a checkpoint through transformers, with the request's transform."""
    from transformers import LlamaForCausalLM

    from models.sampling import logits_to_probs

    hf = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        p1 = logits_to_probs(hf(torch.tensor([prompt])).logits[0, -1], params)              # [V]
        batch = torch.tensor([prompt + [x] for x in range(p1.shape[0])])
        p2 = logits_to_probs(hf(batch).logits[:, -1], params)                               # [V, V]
    return (p1[:, None] * p2).reshape(-1)


def test_sampled_pairs_through_lookup_chains_follow_the_target(small_vocab_pair):
    """Chains of point masses, forced at every step: accept token x with probability p(x),
    else sample p without x. The first two tokens' joint distribution must be the target's."""
    target, _ = small_vocab_pair
    N = 400
    prompt = [3, 1, 4, 1, 5, 9, 3, 1, 4]          # its last 3-gram occurred before: a chain of [1]
    params = SamplingParams(temperature=0.9, top_p=0.95)

    async def scenario():
        va = Harness(target, num_blocks=512, block_size=16)
        va.scheduler.lookup.planner.plan = lambda streams, **_: {s: (16, 1) for s in streams}   # always a chain

        async def one(i):
            p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=2, ignore_eos=True, seed=i)
            return (await _generate(va, f"s{i}", prompt, p))[0]
        return va, await asyncio.gather(*(one(i) for i in range(N)))

    va, results = run_restoring_threads(scenario(), 300)
    assert va.scheduler.stats.lookup_trees >= N                 # every request's first step verified [1]
    V = 16
    counts = torch.zeros(V * V)
    for tokens in results:
        assert len(tokens) == 2
        counts[tokens[0] * V + tokens[1]] += 1
    p = _joint(target, prompt, params)
    stat, df = chi2(counts, p)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} with {df} df"
    # the test has power: accepting the point mass whenever offered would be rejected
    biased = p.reshape(V, V).clone()
    biased[1] += 0.5 * biased.sum(0)                 # x1 = 1 drawn far more often than p says
    biased = (biased / biased.sum()).reshape(-1)
    stat_b, df_b = chi2((biased * N).round(), p)
    assert stat_b > chi2_critical(df_b)
