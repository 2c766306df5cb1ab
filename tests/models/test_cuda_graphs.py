"""The graphed small forwards (models/cuda_graphs.py), on the CPU with a stand-in for CUDA
capture: a 'graph' re-runs the captured function on its static buffers and writes into the
same output tensor, as a replay does. What this checks is the plumbing a real graph depends
on: every input reaches the static buffers (ids, positions, padded block table, prefix
lengths, tree mask), keys separate what must not share a graph, outputs are not aliased.
tests/gpu/test_cuda_graphs_gpu.py captures for real."""
from __future__ import annotations

import copy

import pytest
import torch

from models import ModelConfig, Transformer, cuda_graphs
from models.transformer import causal_mask
from models.tree import ancestor_mask


def fake_capture(fn, pool):
    out = fn()
    return (lambda: out.copy_(fn())), out


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
    from models.eagle import EagleDraft

    m = copy.deepcopy(eager)
    assert not cuda_graphs.enable(m) and m.graphs is None                     # a CPU model
    assert not cuda_graphs.enable(EagleDraft.__new__(EagleDraft), capture=fake_capture)   # input features
    monkeypatch.setenv("SPECFLASH_CUDA_GRAPHS", "0")
    assert not cuda_graphs.wanted()
    monkeypatch.setenv("SPECFLASH_CUDA_GRAPHS", "1")
    assert cuda_graphs.wanted()
