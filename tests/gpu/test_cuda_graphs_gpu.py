"""Graphed small forwards captured for real on CUDA (models/cuda_graphs.py): the same logits
as eager forwards through decode steps, chains and trees of two sequences, rollbacks and
block-table widths that change; greedy decoding through graphs equals eager decoding.
The CPU twin (tests/models/test_cuda_graphs.py) checks the plumbing with a stand-in capture."""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from models import ModelConfig, Transformer, cuda_graphs  # noqa: E402
from models.config import rope_inv_freq  # noqa: E402
from models.transformer import causal_mask
from models.tree import ancestor_mask  # noqa: E402


def make_model(dtype):
    cfg = ModelConfig(arch="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4,
                      num_heads=8, num_kv_heads=2, head_dim=32, rope_theta=10000.0)
    torch.manual_seed(11)
    m = Transformer(cfg).eval()
    for p in m.parameters():
        p.normal_(0, 0.1)
    m = m.to(device="cuda", dtype=dtype)
    m.inv_freq = rope_inv_freq(cfg)[0].cuda()    # RoPE frequencies stay float32
    return m



def script(model):
    g = torch.Generator().manual_seed(1)
    cache = model.new_cache(128, 16)
    outs = []

    def step(seqs, ids, masks):
        pos = torch.stack([cache.seq_len(s) + m.sum(-1) - 1 for s, m in zip(seqs, masks)])
        with torch.inference_mode():
            outs.append(model(ids.cuda(), pos.cuda(), cache, seqs, torch.stack(masks).cuda()).cpu())

    for s, n in (("a", 40), ("b", 7)):
        cache.add_sequence(s)
        step([s], torch.randint(0, 1000, (1, n), generator=g), [causal_mask(1, n)[0]])
    tree = ancestor_mask(torch.tensor([-1, -1, 0, 1, 2, 2]))
    for i in range(60):
        if i % 4 == 3:
            step(["a", "b"], torch.randint(0, 1000, (2, 6), generator=g), [tree, tree])
            cache.truncate("a", cache.seq_len("a") - 3)
        elif i % 4 == 1:
            step(["b"], torch.randint(0, 1000, (1, 4), generator=g), [causal_mask(1, 4)[0]])
        else:
            step(["a", "b"], torch.randint(0, 1000, (2, 1), generator=g), [causal_mask(1, 1)[0]] * 2)
    return outs


def assert_near(got, want, tol):
    """Every forward's logits finite and within `tol` (relative norm) of the eager ones."""
    assert len(got) == len(want)
    for i, (x, y) in enumerate(zip(got, want)):
        assert torch.isfinite(x).all(), i
        err = float((x - y).norm() / y.norm())
        assert err < tol, (i, err)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_captured_forwards_equal_eager(dtype, tol):
    eager = make_model(dtype)
    graphed = copy.deepcopy(eager)
    assert cuda_graphs.enable(graphed)
    assert_near(script(graphed), script(eager), tol)
    st = graphed.graphs.stats()
    assert st["captures"] >= 3 and st["replays"] >= 30, st


def test_greedy_decoding_through_graphs_equals_eager():
    def decode(model, n=48):
        cache = model.new_cache(16, 16)
        cache.add_sequence(0)
        ids = torch.arange(5)[None].cuda()
        out = []
        with torch.inference_mode():
            logits = model(ids, torch.arange(5)[None].cuda(), cache, [0], causal_mask(1, 5, "cuda"))
            for _ in range(n):
                tok = int(logits[0, -1].argmax())
                out.append(tok)
                L = cache.seq_len(0)
                logits = model(torch.tensor([[tok]], device="cuda"), torch.tensor([[L]], device="cuda"),
                               cache, [0], causal_mask(1, 1, "cuda"))
        return out

    eager = make_model(torch.float32)
    graphed = copy.deepcopy(eager)
    assert cuda_graphs.enable(graphed)
    assert decode(graphed) == decode(eager)
    assert graphed.graphs.stats()["replays"] >= 40


def make_eagle(dtype):
    from dataclasses import replace

    from models.eagle import EagleDraft

    base = make_model(dtype)
    torch.manual_seed(12)
    head = EagleDraft(replace(base.config, num_layers=1)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    head = head.to(device="cuda", dtype=dtype)
    head.inv_freq = base.inv_freq
    return head


def eagle_script(model):
    """A prompt's catch-up, then forwards of 1, 2 and 3 rows, each row with a feature."""
    g = torch.Generator().manual_seed(2)
    cache = model.new_cache(32, 16)
    cache.add_sequence(0)
    outs = []
    with torch.inference_mode():
        for T in [9] + [1, 2, 3] * 8:
            ids = torch.randint(0, 1000, (1, T), generator=g).cuda()
            feats = torch.randn(1, T, 256, generator=g).cuda()
            pos = (torch.arange(T) + cache.seq_len(0))[None].cuda()
            outs.append(model(ids, pos, cache, [0], causal_mask(1, T, "cuda"), features=feats).cpu())
    return outs


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_eagle_head_captured_forwards_equal_eager(dtype, tol):
    """An EAGLE head's forwards, its features a static buffer of the graph, equal eager ones."""
    eager = make_eagle(dtype)
    graphed = copy.deepcopy(eager)
    assert cuda_graphs.enable(graphed)
    assert_near(eagle_script(graphed), eagle_script(eager), tol)
    assert graphed.graphs.stats()["replays"] >= 15


def test_warm_up_captures_the_planner_shapes_before_serving():
    """After `GraphedLayers.warm_up` with `verify_rows(4)`, chains of 1..4 at growing contexts
    are replays only: no capture (and no eager forward) while serving."""
    from speculation.planner import verify_rows

    model = make_model(torch.bfloat16)
    assert cuda_graphs.enable(model)
    cache = model.new_cache(16, 16)                    # 256 tokens: widths 1..16 blocks
    assert model.graphs.warm_up(cache, verify_rows(4)) == 5 * 5
    assert cache.num_free_blocks == cache.num_blocks
    before = model.graphs.stats()
    cache.add_sequence(0)
    with torch.inference_mode():
        for step in range(60):
            T = 1 + step % 5
            if cache.seq_len(0) + T > 256:
                break
            pos = (torch.arange(T) + cache.seq_len(0))[None].cuda()
            out = model(torch.randint(0, 1000, (1, T)).cuda(), pos, cache, [0], causal_mask(1, T, "cuda"))
            assert torch.isfinite(out).all()
    after = model.graphs.stats()
    assert after["captures"] == before["captures"] and after["eager"] == before["eager"], (before, after)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_a_fused_heads_target_features_through_captured_graphs_equal_eager(dtype, tol):
    """The target of a fused EAGLE head returns layers' outputs beside its final state
    (`Transformer.set_feature_layers`): through real graphs, keyed on those layers, the
    features and logits are eager's, also when the layers change between forwards."""
    def run(model):
        cache = model.new_cache(16, 16)
        cache.add_sequence(0)
        out = []
        with torch.inference_mode():
            for n, layers in enumerate([(1, 2), (1, 2), (1, 2), ()] * 5):
                model.set_feature_layers(layers)
                logits, hidden = model(torch.tensor([[n + 1]], device="cuda"), torch.tensor([[n]], device="cuda"),
                                       cache, [0], causal_mask(1, 1, "cuda"), return_hidden=True)
                out.append(torch.cat([logits.float().flatten(), hidden.float().flatten()]).cpu())
        model.set_feature_layers(())
        return out

    eager = make_model(dtype)
    graphed = copy.deepcopy(eager)
    assert cuda_graphs.enable(graphed)
    assert_near(run(graphed), run(eager), tol)
    assert graphed.graphs.stats()["replays"] >= 10
