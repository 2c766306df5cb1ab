"""Sampling exactness (DESIGN.md §4): with a draft far from the target, the first two
sampled tokens follow the target's own distribution (temperature, top-k, top-p applied),
for chains and trees. Chi-square goodness of fit over many seeds, one batched run each,
with a control showing the same test rejects a classic sampler bug."""
from __future__ import annotations

import itertools

import pytest
import torch

from cluster.local import InProcessEngine, build_engine, speculation_for
from speculation.requests import GenerationRequest
from models import SamplingParams, load_model
from models.sampling import logits_to_probs

PROMPT = [1, 5, 2, 9]
NUM_SAMPLES = 2000
P_VALUE_FLOOR = 1e-4          # seeds are fixed: a pass or a failure is reproducible


@pytest.fixture(scope="module")
def engine(small_vocab_pair):
    target, draft = small_vocab_pair      # no tokenizer: the engine itself, not build_engine
    return InProcessEngine(load_model(target), load_model(draft))


def exact_joint(model_dir, params: SamplingParams) -> torch.Tensor:   # [V, V]
    """P(x1, x2) of the target alone, from transformers' logits."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        p1 = logits_to_probs(hf(torch.tensor([PROMPT])).logits[0, -1], params)        # [V]
        V = p1.shape[0]
        prompts = torch.tensor([PROMPT + [x] for x in range(V)])                       # [V, P+1]
        p2 = logits_to_probs(hf(prompts).logits[:, -1], params)                        # [V, V]
    return p1[:, None] * p2


def sample_pairs(engine, params: SamplingParams, spec, seeds, seeded: bool = False) -> tuple[torch.Tensor, float]:
    """[N, 2] first two tokens, one request per seed, and the run's acceptance rate. Unseeded
    requests (the rejection sampler) draw from the scheduler's entropy, fixed here to the seeds;
    `seeded` ones are coupled (the seed's Gumbel noise)."""
    fix_entropy(engine, seeds)
    requests = [GenerationRequest(f"s{seed}", PROMPT,
                                  SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                 top_p=params.top_p, seed=seed if seeded else None,
                                                 max_tokens=2, ignore_eos=True), spec) for seed in seeds]
    outs = engine.generate(requests)
    drafted = sum(o.stats.num_drafted for o in outs)
    return torch.tensor([o.token_ids for o in outs]), sum(o.stats.num_accepted for o in outs) / drafted


def fix_entropy(engine, seeds) -> None:
    """The randomness of unseeded requests, one seed each, in order (then fresh ones, for the
    requests of later tests on the same engine): reproducible tests."""
    it = itertools.chain(seeds, itertools.count(1 << 40))
    engine.scheduler.entropy = lambda: next(it)


def chi_square_p_value(samples: torch.Tensor, joint: torch.Tensor) -> float:
    """Goodness of fit of (x1, x2) samples to `joint`; cells expecting < 5 are pooled."""
    V = joint.shape[0]
    counts = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V).double()
    expected = joint.reshape(-1).double() * samples.shape[0]
    if counts[expected == 0].sum() > 0:     # a pair the distribution rules out: certainly not it
        return 0.0
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


CASES = {
    "chain-temperature": (SamplingParams(temperature=0.8), speculation_for("sync", 3, 1)),
    "chain-cuts": (SamplingParams(temperature=1.1, top_k=8, top_p=0.9, min_p=0.02), speculation_for("sync", 3, 1)),
    "tree-top-p": (SamplingParams(temperature=1.2, top_p=0.85), speculation_for("sync", 2, 3)),
    "tree-top-k-top-p": (SamplingParams(temperature=1.0, top_k=6, top_p=0.9), speculation_for("sync", 3, 2)),
}


def fits(samples: torch.Tensor, joint: torch.Tensor) -> float:
    """The smaller p-value of (x1, x2) and (x2, x3) against their exact marginals."""
    return min(chi_square_p_value(samples[:, :2], joint.sum(2)),
               chi_square_p_value(samples[:, 1:], joint.sum(0)))


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tokens_follow_the_target(engine, small_vocab_pair, case):
    params, spec = CASES[case]
    joint = exact_joint(small_vocab_pair[0], params)
    seeds = range(NUM_SAMPLES)
    samples, acceptance = sample_pairs(engine, params, spec, seeds)
    p = chi_square_p_value(samples, joint)
    assert p > P_VALUE_FLOOR, f"{case}: sampled pairs do not follow the target (p = {p:.2e})"
    # the draft is far: acceptance and rejection (the residual) both happen a lot
    assert 0.1 < acceptance < 0.8
    # power: the draft's own distribution is rejected by the same test at this sample size
    draft_joint = exact_joint(small_vocab_pair[1], params)
    assert chi_square_p_value(samples, draft_joint) < 1e-6


@pytest.mark.parametrize("spec", [speculation_for("sync", 3, 1), speculation_for("sync", 3, 2)])
def test_a_reduced_draft_head_keeps_sampling_exact(small_vocab_pair, spec):
    """A draft whose head reads 10 of the 16 tokens (`specflash_draft.json`'s `logit_rows`) draws
    over those rows alone; the tokens it never proposes come from the residual, so the pairs
    still follow the target."""
    target, draft = small_vocab_pair
    engine = InProcessEngine(load_model(target), load_model(draft), draft_logit_rows=[0, 2, 3, 5, 6, 8, 9, 11, 12, 14])
    params = SamplingParams(temperature=1.0, top_p=0.95)
    samples, acceptance = sample_pairs(engine, params, spec, range(NUM_SAMPLES))
    p = chi_square_p_value(samples, exact_joint(target, params))
    assert p > P_VALUE_FLOOR, f"sampled pairs do not follow the target (p = {p:.2e})"
    assert 0.1 < acceptance < 0.8
    assert samples.unique().numel() > 10             # tokens outside the rows come out too


def test_chi_square_catches_a_residual_bug(engine, small_vocab_pair, monkeypatch):
    """Control: sampling the correction from p instead of norm(max(p - q, 0)) is caught."""
    import verifier.verifier as verifier_module

    real = verifier_module.rejection_sample

    def buggy(draft_token_ids, parent_ids, num_nodes, target_probs, draft_probs, uniform, exp_noise):
        accepted, num_accepted, next_ids = real(draft_token_ids, parent_ids, num_nodes, target_probs,
                                                draft_probs, uniform, exp_noise)
        if draft_probs is not None:   # redraw every correction from p itself
            for b in range(len(num_nodes)):
                n = int(num_accepted[b])
                row = 0 if n == 0 else int(accepted[b, n - 1]) + 1
                if n < int(num_nodes[b]):
                    next_ids[b] = int((target_probs[b, row] / exp_noise[b]).argmax())
        return accepted, num_accepted, next_ids

    monkeypatch.setattr(verifier_module, "rejection_sample", buggy)
    params, spec = CASES["chain-temperature"]
    samples, _ = sample_pairs(engine, params, spec, range(NUM_SAMPLES))
    assert chi_square_p_value(samples, exact_joint(small_vocab_pair[0], params)) < P_VALUE_FLOOR


def test_seeds_reproduce_outputs(tiny_target, close_draft):
    engine = build_engine(tiny_target, close_draft).engine
    prompt = list(b"Once upon a time")

    def sample(seed, spec):
        request = GenerationRequest("x", prompt, SamplingParams(temperature=1.0, top_p=0.95, seed=seed,
                                                                 max_tokens=16, ignore_eos=True), spec)
        return engine.generate([request])[0].token_ids

    for spec in (speculation_for("sync", 4, 1), speculation_for("sync", 3, 2), speculation_for("off", 4, 1)):
        first = sample(11, spec)
        assert sample(11, spec) == first
        assert any(sample(seed, spec) != first for seed in (12, 13, 14))


def test_sampled_tokens_follow_the_target_with_the_prefix_cache(small_vocab_pair):
    """Every request but the first starts on the prompt's cached block (blocks of 2 tokens) in the
    target's cache and the draft's: the sampled pairs still follow the target alone."""
    from speculation.settings import EngineSettings

    target, draft = small_vocab_pair
    settings = EngineSettings(block_size=2, prefix_caching=True, num_cpus=1)
    cached = InProcessEngine(load_model(target), load_model(draft), settings=settings)
    params, spec = CASES["chain-temperature"]
    requests = [GenerationRequest(f"s{seed}", PROMPT, SamplingParams(temperature=params.temperature, seed=seed,
                                                                     max_tokens=2, ignore_eos=True), spec)
                for seed in range(NUM_SAMPLES)]
    outs = cached.generate(requests)
    assert sum(o.stats.prefix_hits for o in outs) == (NUM_SAMPLES - 1) * 2
    assert cached.proposer.cache.prefix_stats()["hits"] > 0
    samples = torch.tensor([o.token_ids for o in outs])
    p = chi_square_p_value(samples, exact_joint(target, params))
    assert p > P_VALUE_FLOOR, f"sampled pairs with the prefix cache do not follow the target (p = {p:.2e})"
