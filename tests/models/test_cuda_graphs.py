"""The graphed small forwards (models/cuda_graphs.py), on the CPU with a stand-in for CUDA
capture: a 'graph' re-runs the captured function on its static buffers and writes into the
same output tensor, as a replay does. What this checks is the plumbing a real graph depends
on: every input reaches the static buffers (ids, positions, padded block table, prefix
lengths, tree mask), keys separate what must not share a graph, outputs are not aliased.
tests/gpu/test_cuda_graphs_gpu.py captures for real."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from models import ModelConfig, Transformer, cuda_graphs
from models.transformer import causal_mask
from models.tree import ancestor_mask


fake_capture = cuda_graphs.stand_in_capture


@pytest.fixture(scope="module")
def eager():
    cfg = ModelConfig(arch="llama", vocab_size=90, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1000.0)
    torch.manual_seed(7)
    m = Transformer(cfg).eval()
    for p in m.parameters():
        p.normal_(0, 0.3)
    return m


@pytest.fixture
def graphed(eager):
    m = copy.deepcopy(eager)
    assert cuda_graphs.enable(m, max_tokens=8, capture=fake_capture)
    return m



def step(model, cache, seqs, ids, masks):
    """One forward of len(seqs) sequences; ids [B, T]; positions follow each tree's depth."""
    B, T = ids.shape
    pos = torch.stack([cache.seq_len(s) + masks[b].sum(-1) - 1 for b, s in enumerate(seqs)])
    with torch.inference_mode():
        return model(ids, pos, cache, seqs, torch.stack(masks))


def run_script(model):
    """Prefill two sequences (eager: too many rows), then decode and verify trees of both,
    crossing block boundaries so the table's width bucket changes; returns every logits."""
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(64, 4)
    outs = []
    for s, n in (("a", 9), ("b", 3)):
        cache.add_sequence(s)
        outs.append(step(model, cache, [s], torch.randint(0, 90, (1, n), generator=g), [causal_mask(1, n)[0]]))
    chain3 = causal_mask(1, 3)[0]
    tree4 = ancestor_mask(torch.tensor([-1, -1, 0, 1]))
    for i in range(14):
        if i % 3 == 2:    # a tree of 4 for both (8 rows), then roll back one node of b's
            ids = torch.randint(0, 90, (2, 4), generator=g)
            outs.append(step(model, cache, ["a", "b"], ids, [tree4, tree4]))
            cache.truncate("b", cache.seq_len("b") - 1)
        elif i % 3 == 1:  # a chain of 3 for a alone
            outs.append(step(model, cache, ["a"], torch.randint(0, 90, (1, 3), generator=g), [chain3]))
        else:             # one token each
            ids = torch.randint(0, 90, (2, 1), generator=g)
            outs.append(step(model, cache, ["a", "b"], ids, [causal_mask(1, 1)[0]] * 2))
    return outs, cache


def test_graphed_forwards_equal_eager(eager, graphed):
    want, _ = run_script(eager)
    got, _ = run_script(graphed)
    assert len(got) == len(want)
    for i, (x, y) in enumerate(zip(got, want)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=f"forward {i}")
    st = graphed.graphs.stats()
    assert st["captures"] >= 3 and st["replays"] >= st["captures"], st
    assert st["eager"] >= 2 + st["captures"], st   # the prefills, and each key's first use


def test_keys_separate_shapes_and_widths_and_a_new_cache_drops_the_old_graphs(graphed):
    g = graphed.graphs
    mask = causal_mask(1, 1)
    widths = {}
    for cache_blocks in (32, 48):          # a second cache (as when one is re-allocated larger)
        cache = graphed.new_cache(cache_blocks, 4)
        cache.add_sequence(0)
        with torch.inference_mode():
            for n in range(1, 20):         # widths 1..5 blocks: buckets 1, 2, 4, 8
                graphed(torch.tensor([[n % 90]]), torch.tensor([[n - 1]]), cache, [0], mask)
        widths[cache_blocks] = sorted({k[2] for k in g._entries})
        assert {k[3] for k in g._entries} == {cache.k.data_ptr()}   # only this cache's graphs
    assert widths == {32: [1, 2, 4, 8], 48: [1, 2, 4, 8]}, widths


def test_outputs_are_not_the_next_replays_buffer(graphed):
    cache = graphed.new_cache(4, 16)     # one block: every forward below has the same key
    cache.add_sequence(0)
    mask = causal_mask(1, 1)
    with torch.inference_mode():
        for n in range(3):
            graphed(torch.tensor([[n]]), torch.tensor([[n]]), cache, [0], mask)
        _, kept = graphed(torch.tensor([[5]]), torch.tensor([[3]]), cache, [0], mask, return_hidden=True)
        before = kept.clone()
        graphed(torch.tensor([[6]]), torch.tensor([[4]]), cache, [0], mask, return_hidden=True)
    assert graphed.graphs.stats() == dict(graphs=1, captures=1, replays=4, eager=1)
    assert torch.equal(kept, before)


def test_limits_fall_back_to_eager(eager):
    m = copy.deepcopy(eager)
    cuda_graphs.enable(m, max_tokens=8, max_graphs=1, capture=fake_capture)
    cache = m.new_cache(32, 4)
    cache.add_sequence(0)
    with torch.inference_mode():
        for T in (1, 1, 1, 2, 2, 2):   # T=1 takes the only graph; T=2 stays eager
            m(torch.zeros(1, T, dtype=torch.long), torch.arange(T)[None] + cache.seq_len(0), cache, [0],
              causal_mask(1, T))
    assert m.graphs.stats() == dict(graphs=1, captures=1, replays=2, eager=4)


def test_enable_only_where_graphs_can_run(eager, monkeypatch):
    class OtherInputs(Transformer):
        def _inputs(self, input_ids, features):
            return self.embed_tokens(input_ids) * 2

    m = copy.deepcopy(eager)
    assert not cuda_graphs.enable(m) and m.graphs is None                     # a CPU model
    assert not cuda_graphs.enable(OtherInputs.__new__(OtherInputs), capture=fake_capture)   # unknown inputs
    monkeypatch.setenv("SPECFLASH_CUDA_GRAPHS", "0")
    assert not cuda_graphs.wanted()
    monkeypatch.setenv("SPECFLASH_CUDA_GRAPHS", "1")
    assert cuda_graphs.wanted()


def eagle_head(eager):
    from models.eagle import EagleDraft

    torch.manual_seed(3)
    head = EagleDraft(replace(eager.config, num_layers=1)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head


def test_graphed_eagle_forwards_equal_eager(eager):
    """An EAGLE head's forwards read their input features from the graph's static buffer."""
    want_model = eagle_head(eager)
    got_model = copy.deepcopy(want_model)
    assert cuda_graphs.enable(got_model, max_tokens=8, capture=fake_capture)
    g = torch.Generator().manual_seed(5)
    outs = {}
    for name, model in (("eager", want_model), ("graphed", got_model)):
        cache = model.new_cache(2, 16)          # one block: the key is (1, T) alone
        cache.add_sequence(0)
        outs[name] = []
        with torch.inference_mode():
            for T in (3, 1, 1, 1, 2, 2, 2, 1):
                ids = torch.randint(0, 90, (1, T), generator=g)
                feats = torch.randn(1, T, 32, generator=g)
                pos = torch.arange(T)[None] + cache.seq_len(0)
                outs[name].append(model(ids, pos, cache, [0], causal_mask(1, T), features=feats))
        g.manual_seed(5)
    for i, (x, y) in enumerate(zip(outs["graphed"], outs["eager"])):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=f"forward {i}")
    st = got_model.graphs.stats()
    assert st == dict(graphs=2, captures=2, replays=5, eager=3), st   # T=1, T=2: eager, captured, replayed
    with pytest.raises(ValueError, match="needs the target's features"):   # the eager refusal stays
        with torch.inference_mode():
            cache = got_model.new_cache(4, 4)
            cache.add_sequence(0)
            got_model(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), cache, [0],
                      causal_mask(1, 1))


@pytest.mark.parametrize("features", [False, True])
def test_warm_up_captures_every_planner_shape_at_every_width(eager, features):
    """After `warm_up` with the planner's shape set, every forward of those rows at any context
    the cache holds replays a graph: nothing is compiled or captured while serving. Without the
    warm-up the same forwards run eagerly first (the control)."""
    from speculation.planner import verify_rows

    rows = verify_rows(3)                                       # chains of 1..3: 1..4 rows
    for warm in (True, False):
        m = eagle_head(eager) if features else copy.deepcopy(eager)
        cuda_graphs.enable(m, max_tokens=8, capture=fake_capture)
        cache = m.new_cache(10, 4)                     # 40 tokens: widths in buckets of 1, 2, 4, 8, 16 blocks
        if warm:
            assert m.graphs.warm_up(cache, rows) == len(rows) * 5
            assert cache.num_free_blocks == cache.num_blocks and not cache._lens
        before = m.graphs.stats()
        cache.add_sequence("s")
        with torch.inference_mode():
            for length in range(0, 36, 1):
                T = rows[length % len(rows)]
                if cache.seq_len("s") + T > 40:
                    break
                feats = torch.zeros(1, T, 32) if features else None
                m(torch.zeros(1, T, dtype=torch.long), torch.arange(T)[None] + cache.seq_len("s"), cache, ["s"],
                  causal_mask(1, T), features=feats)
        after = m.graphs.stats()
        if warm:
            assert after["eager"] == before["eager"] and after["captures"] == before["captures"], (before, after)
            cache.free("s")
            cache.add_sequence("p")
            with torch.inference_mode():     # longer than the shape set (a prefill): eager, never captured
                for _ in range(3):
                    m(torch.zeros(1, 6, dtype=torch.long), torch.arange(6)[None], cache, ["p"], causal_mask(1, 6),
                      features=torch.zeros(1, 6, 32) if features else None)
                    cache.truncate("p", 0)
            assert m.graphs.stats()["captures"] == after["captures"] and m.graphs.stats()["eager"] == after["eager"] + 3
        else:
            assert after["eager"] > 0


def test_a_fused_heads_target_features_come_through_graphs_keyed_on_its_layers(eager, graphed):
    """A fused EAGLE head reads layers' outputs beside the final state (`set_feature_layers`):
    graphed forwards give eager's [.., 3H] features, and a target whose layers change between
    forwards (engines sharing it, `verifier.Verifier`) replays each set's own graphs."""
    def run(model, layers_by_step):
        cache = model.new_cache(16, 4)
        cache.add_sequence(0)
        mask, out = causal_mask(1, 1), []
        with torch.inference_mode():
            for n, layers in enumerate(layers_by_step):
                model.set_feature_layers(layers)
                out.append(model(torch.tensor([[n + 1]]), torch.tensor([[n]]), cache, [0], mask,
                                 return_hidden=True))
        model.set_feature_layers(())
        return out

    steps = [(0, 1), (0, 1), ()] * 4
    want, got = run(copy.deepcopy(eager), steps), run(graphed, steps)
    for i, ((lx, hx), (ly, hy)) in enumerate(zip(got, want)):
        assert hx.shape[-1] == 32 * (len(steps[i]) + 1), i
        torch.testing.assert_close(hx, hy, atol=1e-5, rtol=1e-5, msg=f"features {i}")
        torch.testing.assert_close(lx, ly, atol=1e-5, rtol=1e-5, msg=f"logits {i}")
    assert {k[4] for k in graphed.graphs._entries} == {(0, 1), ()}
    assert graphed.graphs.stats()["replays"] >= 6
