"""PagedKVCache bookkeeping: reserve / truncate / compact / free, and OutOfBlocks atomicity."""
from __future__ import annotations

import pytest
import torch

from models import OutOfBlocks, PagedKVCache


def make(num_blocks=6, block_size=4, layers=2):
    return PagedKVCache(layers, num_kv_heads=2, head_dim=3, num_blocks=num_blocks, block_size=block_size)


def snapshot(cache, seq_ids):
    return cache.num_free_blocks, [cache.seq_len(s) for s in seq_ids], cache.block_table(seq_ids).tolist()


def test_shapes_and_layer_views():
    cache = make()
    assert cache.k[1].shape == (6, 4, 2, 3) and cache.v[0].shape == (6, 4, 2, 3)
    assert cache.num_blocks == 6 and cache.num_free_blocks == 6


def test_reserve_allocates_blocks_on_demand():
    cache = make()
    cache.add_sequence("a")
    cache.reserve("a", 0)
    assert cache.num_free_blocks == 6 and cache.block_table(["a"]).shape == (1, 0)
    cache.reserve("a", 4)
    assert cache.seq_len("a") == 4 and cache.num_free_blocks == 5
    cache.reserve("a", 1)
    assert cache.seq_len("a") == 5 and cache.num_free_blocks == 4
    cache.add_sequence("b")
    cache.reserve("b", 9)
    assert cache.num_free_blocks == 1
    table = cache.block_table(["a", "b"])
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    used = table[0, :2].tolist() + table[1].tolist()
    assert len(set(used)) == 5, "two sequences share a block"
    with pytest.raises(ValueError, match="already"):
        cache.add_sequence("a")


def test_out_of_blocks_changes_nothing():
    cache = make(num_blocks=3)
    cache.add_sequence("a")
    cache.reserve("a", 6)                     # 2 blocks
    before = snapshot(cache, ["a"])
    with pytest.raises(OutOfBlocks, match="needs 2 more blocks"):
        cache.reserve("a", 7)                 # would need 4 blocks in all
    assert snapshot(cache, ["a"]) == before
    cache.reserve("a", 6)                     # exactly the last block still fits
    assert cache.num_free_blocks == 0 and cache.seq_len("a") == 12


def test_truncate_frees_blocks_past_the_end():
    cache = make()
    cache.add_sequence("a")
    cache.reserve("a", 10)                    # 3 blocks
    cache.truncate("a", 5)
    assert cache.seq_len("a") == 5 and cache.num_free_blocks == 4
    cache.truncate("a", 4)
    assert cache.num_free_blocks == 5
    cache.truncate("a", 0)
    assert cache.num_free_blocks == 6
    with pytest.raises(ValueError, match=r"\[0, 0\]"):
        cache.truncate("a", 1)


def test_free_returns_every_block_and_is_idempotent():
    cache = make()
    for s, n in (("a", 7), ("b", 13)):
        cache.add_sequence(s)
        cache.reserve(s, n)
    assert cache.num_free_blocks == 0
    cache.free("a")
    assert cache.num_free_blocks == 2 and not cache.has_sequence("a")
    cache.free("b")
    cache.free("b")
    assert cache.num_free_blocks == 6
    with pytest.raises(KeyError):
        cache.seq_len("b")
    cache.add_sequence("c")
    cache.reserve("c", 24)                    # all six blocks are usable again
    assert cache.num_free_blocks == 0


def test_compact_moves_every_layer_and_truncates():
    cache = make(block_size=4)
    cache.add_sequence("a")
    cache.reserve("a", 11)                    # prefix 3, tree of 8 nodes spanning 3 blocks
    table = cache.block_table(["a"])[0].long()
    pos = torch.arange(11)
    slot = table[pos // 4] * 4 + pos % 4
    for store in (cache.k, cache.v):
        flat = store.view(2, -1, 2, 3)
        flat[:, slot] = (pos.float() + 100 * torch.arange(2.0)[:, None])[..., None, None].expand(2, 11, 2, 3)
    sign = {id(cache.k): 1, id(cache.v): -1}
    cache.v.neg_()
    cache.compact("a", 3, [0, 5, 7])          # accepted path: tree nodes 0, 5, 7
    assert cache.seq_len("a") == 6 and cache.num_free_blocks == 6 - 2
    for store in (cache.k, cache.v):
        flat = store.view(2, -1, 2, 3)
        got = flat[:, slot[:6], 0, 0]         # [layers, 6]
        want = torch.tensor([0, 1, 2, 3, 8, 10.0]) + 100 * torch.arange(2.0)[:, None]
        torch.testing.assert_close(got, sign[id(store)] * want)


def test_compact_rejects_offsets_outside_the_sequence():
    cache = make()
    cache.add_sequence("a")
    cache.reserve("a", 5)
    before = snapshot(cache, ["a"])
    with pytest.raises(ValueError, match="outside"):
        cache.compact("a", 3, [0, 2])
    assert snapshot(cache, ["a"]) == before
