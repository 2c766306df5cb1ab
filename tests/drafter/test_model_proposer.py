"""The draft cache follows the tree: after any accept / rollback, the next proposal is the
one a fresh proposer makes from the committed tokens alone."""
from __future__ import annotations

import pytest
import torch

from drafter import ModelProposer, NgramProposer
from speculation.proposal import DraftRequest
from models import SamplingParams, load_model
from models.grammar import GrammarSpec

SAMPLING = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def draft_model(close_draft):
    return load_model(close_draft)


def proposer(model, width=1, logit_rows=None):
    return ModelProposer(model, model.new_cache(64, 16), spec_len=4, tree_width=width, logit_rows=logit_rows)


def request(tokens, params=SAMPLING, seed=0, depth=4, width=None):
    return DraftRequest("s", list(tokens), params, torch.Generator().manual_seed(seed), depth, tree_width=width)


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("accept", ["none", "first", "deepest"])
def test_cache_after_verification_matches_a_fresh_proposer(draft_model, width, accept):
    prompt = list(b"hello world, ")
    p = proposer(draft_model, width)
    tree, = p.propose([request(prompt)])
    assert tree.num_nodes > 0 and tree.prefix_len == len(prompt)
    if accept == "none":
        path = []
    else:
        leaf = 0 if accept == "first" else int(tree.depths.argmax())
        path = tree.path_to(leaf)
    committed = prompt + tree.token_ids[path].tolist() + [42]         # + the verifier's next token
    p.on_verified("s", tree, path)
    again, = p.propose([request(committed, seed=1)])
    fresh, = proposer(draft_model, width).propose([request(committed, seed=1)])
    assert torch.equal(again.token_ids, fresh.token_ids)
    assert torch.equal(again.parent_ids, fresh.parent_ids)
    assert torch.allclose(again.draft_probs, fresh.draft_probs, atol=1e-5)


def test_greedy_chain_is_the_draft_argmax_path(draft_model, close_draft):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(close_draft).eval()
    prompt = list(b"abc")
    tree, = proposer(draft_model).propose([request(prompt, GREEDY, depth=4)])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4, pad_token_id=0)
    assert tree.token_ids.tolist() == ref[0, len(prompt):].tolist()
    assert tree.draft_probs is None


def test_depth_is_capped_per_request(draft_model):
    p = proposer(draft_model, width=2)
    shallow, none = p.propose([request(b"abc", depth=1), DraftRequest("t", list(b"xyz"), SAMPLING,
                                                                      torch.Generator(), 0)])
    assert shallow.depths.max() == 1 and none.num_nodes == 0


def test_logit_rows_restrict_the_draft_vocabulary(draft_model):
    rows = list(range(32, 127))                                        # printable ASCII only
    p = proposer(draft_model, width=2, logit_rows=rows)
    tree, = p.propose([request(b"Hi there", SAMPLING)])
    outside = torch.ones(draft_model.config.vocab_size, dtype=torch.bool)
    outside[rows] = False
    assert tree.draft_columns.tolist() == rows, "an unseeded tree ships q over the head's rows alone"
    assert tree.draft_probs.shape == (tree.num_nodes + 1, len(rows))
    assert tree.dense_draft_probs(draft_model.config.vocab_size)[:, outside].sum() == 0
    assert all(32 <= t < 127 for t in tree.token_ids.tolist())
    greedy, = p.propose([DraftRequest("g", list(b"Hi there"), GREEDY, torch.Generator(), 3)])
    assert all(32 <= t < 127 for t in greedy.token_ids.tolist())


def test_ngram_proposer_point_masses():
    ngram = NgramProposer(vocab_size=16, spec_len=3)
    tree, = ngram.propose([DraftRequest("n", [1, 2, 3, 4, 1, 2], SAMPLING, torch.Generator(), 5)])
    assert tree.token_ids.tolist() == [3, 4, 1]
    assert tree.draft_columns.tolist() == [1, 3, 4], "q over the chain's distinct tokens alone"
    q = tree.dense_draft_probs(16)
    assert q[torch.arange(3), tree.token_ids].tolist() == [1.0, 1.0, 1.0]
    assert q.sum() == 3 and q[3].sum() == 0
    empty, = ngram.propose([DraftRequest("n", [1, 2, 3], SAMPLING, torch.Generator(), 5)])
    assert empty.num_nodes == 0


MIXED = {"a": GREEDY, "b": SamplingParams(temperature=0.9)}
MIXED_CUTS = {"a": SamplingParams(temperature=0.8, top_p=0.9, seed=2), "b": SamplingParams(temperature=0.9)}
PENALISED = SamplingParams(temperature=1.1, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4,
                           prompt_len=4)
MIXED_HISTORY = {"a": SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0, prompt_len=5),
                 "b": SamplingParams(temperature=0.9, logit_bias={104: 4.0, 111: -3.0}, min_tokens=30,
                                     eos_token_ids=[32, 101], prompt_len=6, seed=3)}


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=1.3),
                                    MIXED, SamplingParams(temperature=0.8, top_p=0.8, seed=5),
                                    SamplingParams(temperature=1.2, top_k=6),
                                    SamplingParams(temperature=1.0, min_p=0.05), MIXED_CUTS, PENALISED,
                                    MIXED_HISTORY],
                         ids=["greedy", "seeded", "sampled", "mixed", "top-p", "top-k", "min-p", "mixed-cuts",
                              "penalties", "mixed-history"])
@pytest.mark.parametrize("logit_rows", [None, list(range(32, 127))])
def test_chains_in_one_call_draft_what_the_level_by_level_path_drafts(draft_model, logit_rows, params):
    """models.draft_chain: a batch of chains drafted in one C call gives the trees, the q of
    each sampled draw and the draft K/V the level-by-level forwards give, through accepts and
    rollbacks: greedy, seeded (the seed's noise), unseeded (each request's generator, drawn
    level by level as the builder draws it), under a top-p, top-k or min-p cut, reading the
    history (penalties over the output and the chain so far, logit_bias, min_tokens' stops), and
    a greedy (or a cut, or a penalised) chain beside a sampled one in one pass. The draws compare
    logit / T + noise where the level-by-level path compares log q + noise: equal but for a
    rounding-level near tie."""
    from kernels import cpu as cpu_kernels
    from models import draft_chain

    if not cpu_kernels.decoder_layer_available():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    one_call, by_level = proposer(draft_model, logit_rows=logit_rows), proposer(draft_model, logit_rows=logit_rows)
    by_level.chains_in_c = False
    calls = []
    real = draft_chain.run_chains
    draft_chain.run_chains = lambda *a, **k: calls.append(a[4]) or real(*a, **k)
    try:
        prompts = {"a": list(b"hello world, "), "b": list(b"The quick brown fox")}
        for round_, accept in enumerate([4, 0, 2, 1, 4, 3]):
            per_seq = params if isinstance(params, dict) else {s: params for s in prompts}
            got, want = ([p.propose([DraftRequest(s, list(t), per_seq[s], torch.Generator().manual_seed(round_), 4)
                                     for s, t in prompts.items()])
                          for p in (one_call, by_level)])
            for s, g, w in zip(prompts, got, want):
                assert g.token_ids.tolist() == w.token_ids.tolist(), (round_, s)
                assert g.parent_ids.tolist() == w.parent_ids.tolist() and g.depths.tolist() == w.depths.tolist()
                if not per_seq[s].reads_q:                      # a walk reads no q: none shipped
                    assert g.draft_probs is None and w.draft_probs is None
                else:
                    torch.testing.assert_close(g.draft_probs, w.draft_probs, rtol=1e-5, atol=1e-7)
                for p in (one_call, by_level):
                    p.on_verified(s, g, list(range(accept)))
                prompts[s] = prompts[s] + g.token_ids[:accept].tolist() + [40 + round_]
            if round_ == 3:                                  # an epoch change: both roll back
                for p in (one_call, by_level):
                    p.rollback("a", len(prompts["a"]) - 3)
                prompts["a"] = prompts["a"][:-2]
    finally:
        draft_chain.run_chains = real
    assert calls and all(c == 3 for c in calls)           # the one-call path ran, three levels a pass
    assert_same_cached_kv(one_call.cache, by_level.cache, prompts)


def assert_same_cached_kv(cache, other, seq_ids) -> None:
    """Each sequence holds as many tokens in both caches, with bitwise the same K/V in every layer."""
    for s in seq_ids:
        n = cache.seq_len(s)
        assert n == other.seq_len(s) and n > 0
        slots_a, slots_b = cache.slots(s, range(n)), other.slots(s, range(n))
        for layer in range(len(cache.k)):
            for mine, theirs in ((cache.k[layer], other.k[layer]), (cache.v[layer], other.v[layer])):
                assert torch.equal(mine.flatten(0, 1)[slots_a], theirs.flatten(0, 1)[slots_b])


def test_only_chains_of_one_depth_without_a_grammar_take_the_one_call_path(draft_model):
    from models import draft_chain

    calls = []
    real = draft_chain.run_chains
    draft_chain.run_chains = lambda *a, **k: calls.append(a[4]) or real(*a, **k)

    def twice(p, reqs):          # the second pass: sequences the draft has seen, a short catch-up
        trees = p.propose(reqs)
        for r, t in zip(reqs, trees):
            p.on_verified(r.seq_id, t, [])
        return p.propose([DraftRequest(r.seq_id, list(r.token_ids) + [7], r.params, r.generator, r.max_depth,
                                       tree_width=r.tree_width) for r in reqs])
    try:
        p = proposer(draft_model)
        deep, shallow = twice(p, [DraftRequest("a", list(b"abc"), GREEDY, torch.Generator(), 4),
                                  DraftRequest("b", list(b"xyz"), GREEDY, torch.Generator(), 2)])
        wide, = twice(proposer(draft_model, width=2), [request(b"hello", GREEDY, depth=4)])
        assert calls == [] and deep.num_nodes == 4 and shallow.num_nodes == 2 and wide.num_nodes > 4
        assert not draft_chain.draws(SamplingParams(grammar=GrammarSpec("regex", "[a-z]+")))   # masks per path
        chains = [twice(proposer(draft_model), [request(b"hello", params, depth=4)])[0]
                  for params in (GREEDY, SAMPLING, SamplingParams(temperature=1.0, top_p=0.9),
                                 SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, min_p=0.1),
                                 SamplingParams(presence_penalty=0.5))]
        assert calls == [3] * 6 and all(c.num_nodes == 4 for c in chains)     # these do
    finally:
        draft_chain.run_chains = real


def test_a_one_call_pass_without_room_leaves_every_cache_as_it_was(draft_model):
    """models.draft_chain.run_chains reserves every row first: out of blocks, it raises and
    no sequence keeps a slot of the pass (the packed path's contract)."""
    from kernels import cpu as cpu_kernels
    from models import OutOfBlocks, draft_chain

    if not cpu_kernels.decoder_layer_available():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    cache = draft_model.new_cache(3, 16)
    for seq, n in (("a", 10), ("b", 20)):          # their (zero) K/V stand for a prompt's
        cache.add_sequence(seq)
        cache.reserve(seq, n)
    ids = [torch.tensor([5, 6]), torch.tensor([7])]
    with pytest.raises(OutOfBlocks):
        draft_chain.run_chains(draft_model, cache, ["a", "b"], ids, 14)   # "b" would need a fourth block
    assert (cache.seq_len("a"), cache.seq_len("b")) == (10, 20)
    chains = draft_chain.run_chains(draft_model, cache, ["a", "b"], ids, 3)   # room for this one
    assert chains.tokens.shape == chains.log_q.shape == (2, 4) and (chains.log_q <= 0).all()
    assert chains.features is None
    assert (cache.seq_len("a"), cache.seq_len("b")) == (15, 24)
