"""Triton tree attention vs. the torch reference vs. a float64 computation written here.

Runs under TRITON_INTERPRET=1 (tests/kernels/conftest.py). The cases cover
T in {1, 3, 17}, prefix in {0, 1, 127, 1000}, B in {1, 3}, Hq/Hkv group sizes
{1, 4, 8}, D in {64, 80, 96, 128}, block sizes 16 and 32 without the full cross
product, to keep the interpreter under budget.
"""
from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import ref
from kernels import tree_attention as ta
from kernels.testing import make_paged_inputs, poison_allocations, rel_err


def make_inputs(B, T, Hq, Hkv, D, page, prefix, dtype, seed=0):
    """Scattered pages, an over-wide block table with a junk tail, random valid trees."""
    return make_paged_inputs(B, T, Hq, Hkv, D, page, prefix, dtype, seed=seed)


def attention_f64(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, scale, window=None):
    """Independent float64 computation: token-by-token page lookup, repeated KV heads. With a
    sliding `window`, node t (at position P + its depth) sees the keys at positions within
    window - 1 behind it: prefix positions by index, tree nodes by their own depth."""
    B, T, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        P = int(prefix_lens[b])
        pos = torch.arange(P + T)
        pages = block_tables[b].long()[pos // page]
        k = k_cache[pages, pos % page].double().repeat_interleave(Hq // Hkv, dim=1)
        v = v_cache[pages, pos % page].double().repeat_interleave(Hq // Hkv, dim=1)
        depth = [int(tree_mask[b, t].sum()) - 1 for t in range(T)]     # ancestors of each node
        key_pos = list(range(P)) + [P + d for d in depth]
        for t in range(T):
            visible = torch.cat([torch.ones(P, dtype=torch.bool), tree_mask[b, t]])
            if window is not None:
                visible &= torch.tensor([P + depth[t] - j < window for j in key_pos])
            kk, vv = k[visible], v[visible]                          # [n, Hq, D]
            s = (q[b, t].double()[None] * kk).sum(-1) * scale         # [n, Hq]
            w = torch.exp(s - s.max(0).values)
            out[b, t] = (w[..., None] * vv).sum(0) / w.sum(0)[:, None]
    return out


@pytest.fixture
def poisoned(monkeypatch):
    """Output and scratch start as NaN, so a row the kernel fails to write shows up."""
    poison_allocations(monkeypatch)


CASES = [  # B, T, Hq, Hkv, D, page, prefix per row, dtype
    (1, 1, 1, 1, 64, 16, [0], torch.float32),              # plain decoding, nothing before
    (1, 1, 8, 1, 128, 16, [1000], torch.float32),          # one query, long prefix, group 8
    (3, 3, 8, 2, 80, 32, [1, 127, 0], torch.float32),      # odd D, group 4
    (3, 17, 4, 4, 64, 16, [127, 1000, 1], torch.float32),  # no GQA, T over a tile
    (1, 17, 8, 1, 80, 32, [127], torch.float32),           # T*group = 136: several row tiles
    (3, 3, 4, 1, 96, 16, [1000, 0, 1], torch.bfloat16),
    (1, 17, 8, 2, 128, 32, [1], torch.bfloat16),
    (3, 1, 4, 4, 64, 32, [127, 1, 0], torch.float16),
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,page,prefix,dtype", CASES)
def test_matches_reference_and_float64(poisoned, B, T, Hq, Hkv, D, page, prefix, dtype):
    inputs = make_inputs(B, T, Hq, Hkv, D, page, prefix, dtype, seed=B * 1000 + T * 10 + D)
    scale = 1.0 / math.sqrt(D)
    out = kernels.tree_decode_attention(*inputs)
    assert out.dtype == dtype and out.shape == (B, T, Hq, D)
    assert not out.isnan().any(), "kernel left output elements unwritten"
    expect = attention_f64(*inputs, scale)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(out, expect) < tol
    reference = ref.tree_decode_attention(*inputs)
    assert rel_err(reference, expect) < tol
    # per row, so a single wrong query (a wrong mask row) cannot hide in the norm
    for b in range(B):
        for t in range(T):
            assert rel_err(out[b, t], expect[b, t]) < 3 * tol, (b, t)


def test_num_splits_agree(poisoned):
    inputs = make_inputs(3, 3, 8, 2, 64, 16, [1000, 127, 0], torch.float32, seed=7)
    expect = attention_f64(*inputs, 1.0 / math.sqrt(64))
    outs = {s: kernels.tree_decode_attention(*inputs, num_splits=s) for s in (1, 2, 7, None)}
    for s, out in outs.items():
        assert not out.isnan().any(), s
        assert rel_err(out, expect) < 1e-4, s
        assert rel_err(out, outs[1]) < 1e-5, s


def test_sm_scale_is_honoured():
    inputs = make_inputs(1, 3, 4, 2, 64, 16, [40], torch.float32, seed=3)
    out = kernels.tree_decode_attention(*inputs, sm_scale=0.5)
    assert rel_err(out, attention_f64(*inputs, 0.5)) < 1e-4
    assert rel_err(out, attention_f64(*inputs, 1.0 / 8)) > 1e-2


def test_tree_mask_changes_output():
    """A node must not see its siblings: compare a chain mask with a star mask."""
    q, k, v, bt, pl, _ = make_inputs(1, 3, 4, 4, 64, 16, [5], torch.float32, seed=5)
    chain = torch.tril(torch.ones(1, 3, 3, dtype=torch.bool))
    star = torch.eye(3, dtype=torch.bool)[None].clone()
    out_chain = kernels.tree_decode_attention(q, k, v, bt, pl, chain)
    out_star = kernels.tree_decode_attention(q, k, v, bt, pl, star)
    assert rel_err(out_chain, attention_f64(q, k, v, bt, pl, chain, 1 / 8)) < 1e-4
    assert rel_err(out_star, attention_f64(q, k, v, bt, pl, star, 1 / 8)) < 1e-4
    assert torch.allclose(out_chain[:, 0], out_star[:, 0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out_chain[:, 2], out_star[:, 2], rtol=1e-3, atol=1e-3)


def test_num_splits_heuristic():
    assert ta.choose_num_splits(1, 8, 1, 200, 132) == 1         # short prefix: no split
    assert ta.choose_num_splits(1, 8, 1, 32768, 132) == 33      # ~2 programs per SM
    assert ta.choose_num_splits(32, 8, 1, 32768, 132) == 2      # batch already fills it
    assert ta.choose_num_splits(64, 8, 1, 131072, 132) == 1
    assert ta.choose_num_splits(1, 1, 1, 10 ** 7, 132) == 64    # capped


@pytest.mark.parametrize("bad", ["dtype", "int64_lens", "noncontig", "group"])
def test_launcher_rejects_bad_inputs(bad):
    q, k, v, bt, pl, m = make_inputs(1, 3, 4, 2, 64, 16, [10], torch.float32)
    if bad == "dtype":
        k = k.half()
    elif bad == "int64_lens":
        pl = pl.long()
    elif bad == "noncontig":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif bad == "group":
        q = torch.randn(1, 3, 3, 64)
    with pytest.raises(AssertionError):
        kernels.tree_decode_attention(q, k, v, bt, pl, m)


@pytest.mark.parametrize("B,T,Hq,Hkv,D,page,prefix,dtype", CASES)
def test_cpu_context_matches_reference_and_float64(poisoned, B, T, Hq, Hkv, D, page, prefix, dtype):
    """models.attention.CpuAttentionContext: the models' CPU path, slots and masks built once per forward."""
    from models.attention import CpuAttentionContext

    q, kc, vc, bt, pl, tm = make_inputs(B, T, Hq, Hkv, D, page, prefix, dtype, seed=3)
    ctx = CpuAttentionContext(bt, pl, tm, page, Hq, Hkv)
    for layer in range(2):                           # one context serves every layer's cache
        k, v = (kc, vc) if layer == 0 else (vc, kc)
        got = ctx.attend(q, k, v)
        assert got.dtype == q.dtype and got.shape == q.shape and not got.isnan().any()
        want = attention_f64(q, k, v, bt, pl, tm, 1.0 / math.sqrt(D))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert rel_err(got, want) < tol
        torch.testing.assert_close(got, ref.tree_decode_attention(q, k, v, bt, pl, tm), rtol=tol, atol=tol)


def test_cpu_context_reads_only_each_sequences_own_pages():
    """Rows are padded to the longest sequence; the padding repeats the row's own last slot."""
    from models.attention import CpuAttentionContext

    B, T, page, prefix = 3, 3, 16, [0, 40, 5]
    q, kc, vc, bt, pl, tm = make_inputs(B, T, 4, 2, 64, page, prefix, torch.float32, seed=4)
    ctx = CpuAttentionContext(bt, pl, tm, page, 4, 2)
    slots = ctx.slots.view(B, -1)
    for b in range(B):
        own = bt[b, : (prefix[b] + T + page - 1) // page].long()
        assert set((slots[b] // page).tolist()) <= set(own.tolist())
    nan_k, nan_v = kc.clone(), vc.clone()            # poison every page no sequence owns a token in
    used = {int(s) // page for s in ctx.slots}
    for p_ in range(kc.shape[0]):
        if p_ not in used:
            nan_k[p_], nan_v[p_] = float("nan"), float("nan")
    assert not ctx.attend(q, nan_k, nan_v).isnan().any()
    scale = 1.0 / math.sqrt(64)
    assert rel_err(ctx.attend(q, nan_k, nan_v), attention_f64(q, kc, vc, bt, pl, tm, scale)) < 1e-5


# ---- sliding window (issue 26): Mistral's mask, tree queries near the window's edge ------------
WINDOW_CASES = [  # B, T, Hq, Hkv, D, page, prefix, window, num_splits
    (1, 1, 4, 2, 64, 16, [1000], 300, 4),        # decoding; whole splits outside the window
    (3, 17, 8, 2, 64, 16, [127, 1000, 1], 5, 2),  # window shorter than the tree: ancestors hidden
    (2, 3, 4, 4, 80, 32, [40, 0], 41, None),     # the edge: the prefix's first key just in or out
    (1, 17, 8, 1, 64, 32, [127], 1, None),        # window 1: each node sees only itself
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,page,prefix,window,splits", WINDOW_CASES)
def test_sliding_window_matches_reference_and_float64(poisoned, B, T, Hq, Hkv, D, page, prefix, window,
                                                      splits):
    from models.attention import CpuAttentionContext

    inputs = make_inputs(B, T, Hq, Hkv, D, page, prefix, torch.float32, seed=window + T)
    expect = attention_f64(*inputs, 1.0 / math.sqrt(D), window=window)
    out = kernels.tree_decode_attention(*inputs, num_splits=splits, sliding_window=window)
    assert not out.isnan().any()
    for b in range(B):
        for t in range(T):
            assert rel_err(out[b, t], expect[b, t]) < 3e-4, (b, t)
    assert rel_err(ref.tree_decode_attention(*inputs, sliding_window=window), expect) < 1e-5
    q, k, v, bt, pl, tm = inputs
    ctx = CpuAttentionContext(bt, pl, tm, page, Hq, Hkv, sliding_window=window)
    assert rel_err(ctx.attend(q, k, v, windowed=True), expect) < 1e-5
    # mutation control: the window is not a no-op on these inputs
    assert rel_err(ctx.attend(q, k, v), expect) > 1e-3


@pytest.mark.parametrize("case", [c[:7] + (None,) for c in CASES] + [c[:8] for c in WINDOW_CASES])
def test_the_c_layout_of_what_each_row_sees_is_the_torch_one(case):
    """kernels.cpu.visible_slots (one C call a forward) lays out each row's visible slots as
    the torch operators do (`ordered_in_torch`), and each row's own slot as `_slots` did."""
    from kernels import cpu as cpu_kernels
    from models.attention import CpuAttentionContext

    if not cpu_kernels.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    B, T, Hq, Hkv, D, page, prefix, window = case
    _, _, _, bt, pl, tm = make_inputs(B, T, Hq, Hkv, D, page, prefix, torch.float32, seed=5)
    ctx = CpuAttentionContext(bt, pl, tm, page, Hq, Hkv, sliding_window=window)
    for windowed in ctx.windows:
        vis, counts, rows = cpu_kernels.visible_slots(bt, pl, tm, page, window if windowed else None, ctx.S)
        want, want_counts = ctx.ordered_in_torch(windowed)
        assert counts.tolist() == want_counts.tolist()
        for r, n in enumerate(counts.tolist()):
            assert vis[r, :n].tolist() == want[r, :n].tolist(), (windowed, r)
            assert set(vis[r, n:].tolist()) <= {int(vis[r, n - 1])} if n else True
        pos = pl[:, None].long() + torch.arange(T)
        assert rows.tolist() == (bt.long().gather(1, pos // page) * page + pos % page).reshape(-1).tolist()
        if windowed:   # mutation control: the window hides something here
            assert counts.sum() < ctx.ordered_in_torch(False)[1].sum()
