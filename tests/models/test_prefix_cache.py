"""Automatic prefix caching in PagedKVCache: sharing, reference counts, LRU eviction, copy-on-write,
and a soak of random conversations whose every cached K/V is checked against what it must hold."""
from __future__ import annotations

import hashlib
import random

import pytest
import torch

from models import OutOfBlocks, PagedKVCache


def make(num_blocks=8, block_size=4, caching=True):
    return PagedKVCache(1, num_kv_heads=1, head_dim=1, num_blocks=num_blocks, block_size=block_size,
                        prefix_caching=caching)


def value(tokens) -> float:
    """What position len(tokens) - 1 holds after a prefix `tokens`: a function of all of them."""
    return float(int.from_bytes(hashlib.sha256(repr(list(tokens)).encode()).digest()[:3], "little"))


def write(cache, seq, tokens, start):
    """Fill positions start.. of `seq` as a forward over `tokens` would."""
    slots = cache.slots(seq, range(start, len(tokens)))
    vals = torch.tensor([value(tokens[:p + 1]) for p in range(start, len(tokens))])
    cache.k.view(-1)[slots] = vals
    cache.v.view(-1)[slots] = -vals


def held(cache, seq, n):
    return cache.k.view(-1)[cache.slots(seq, range(n))].tolist()


def prefill(cache, seq, tokens):
    hit = cache.add_sequence(seq, tokens)
    cache.reserve(seq, len(tokens) - hit)
    write(cache, seq, tokens, hit)
    cache.cache_prefix(seq, tokens)
    return hit


def test_a_second_sequence_starts_on_the_cached_full_blocks():
    cache = make()
    a = list(range(10))
    assert prefill(cache, "a", a) == 0
    assert cache.num_cached_blocks == 2                 # positions 0..7; 8, 9 are a partial block
    b = a[:9] + [99, 98]
    assert prefill(cache, "b", b) == 8
    assert cache.block_table(["a"])[0, :2].tolist() == cache.block_table(["b"])[0, :2].tolist()
    assert held(cache, "b", len(b)) == [value(b[:p + 1]) for p in range(len(b))]
    assert prefill(cache, "c", a[:4] + [7] * 6) == 4    # the chain breaks at the second block
    assert cache.block_states()["references"] == 3 + 3 + 3 - 0 and cache.prefix_hits == 12


def test_off_nothing_is_shared():
    cache = make(caching=False)
    prefill(cache, "a", list(range(10)))
    assert prefill(cache, "b", list(range(10))) == 0 and cache.num_cached_blocks == 0
    cache.free("a")
    cache.free("b")
    assert cache.num_free_blocks == 8 and cache.block_states()["cached_unreferenced"] == 0


def test_freed_blocks_stay_cached_until_evicted_least_recently_used_first():
    cache = make(num_blocks=6)
    prefill(cache, "a", list(range(8)))       # 2 blocks
    prefill(cache, "b", list(range(100, 108)))
    cache.free("a")
    cache.free("b")                           # b's blocks are the more recent
    assert cache.num_free_blocks == 6 and cache.block_states()["cached_unreferenced"] == 4
    prefill(cache, "c", list(range(200, 212)))   # 3 blocks: the 2 free ones and a's tail
    assert cache.evictions == 1
    assert cache.add_sequence("a2", list(range(8)) + [5]) == 4     # a's head survived
    assert cache.add_sequence("b2", list(range(100, 108)) + [5]) == 8


def test_eviction_never_takes_a_referenced_block_and_a_request_too_big_is_refused():
    cache = make(num_blocks=4)
    prefill(cache, "a", list(range(8)))
    with pytest.raises(OutOfBlocks, match="needs 3 more blocks"):
        cache.add_sequence("b")
        cache.reserve("b", 12)
    assert held(cache, "a", 8) == [value(list(range(p + 1))) for p in range(8)]
    cache.reserve("b", 8)                     # the two free blocks only
    assert cache.evictions == 0 and cache.num_free_blocks == 0


def test_truncate_into_a_shared_block_copies_it_and_leaves_the_others_intact():
    cache = make()
    tokens = list(range(12))
    prefill(cache, "a", tokens)
    prefill(cache, "b", tokens + [1])
    shared = cache.block_table(["b"])[0, 1].item()
    cache.truncate("b", 6)                    # into block 1, which a holds too
    assert cache.block_table(["b"])[0, 1].item() != shared and cache.is_shared(shared)
    cache.reserve("b", 2)
    write(cache, "b", tokens[:6] + [50, 51], 6)
    assert held(cache, "a", 12) == [value(tokens[:p + 1]) for p in range(12)]
    cache.free("a")
    cache.truncate("b", 2)                    # into block 0, now b's alone: taken out of the cache
    assert not cache.is_shared(cache.block_table(["b"])[0, 0].item())


def test_compact_refuses_to_write_a_shared_block():
    cache = make()
    prefill(cache, "a", list(range(8)))
    with pytest.raises(RuntimeError, match="shared block"):
        cache.compact("a", 2, [3, 4])


def test_soak_random_conversations_keep_every_block_accounted_and_shared_blocks_unwritten():
    rng = random.Random(0)
    cache = make(num_blocks=48, block_size=4)
    system = [rng.randrange(50) for _ in range(9)]
    live: dict[str, list[int]] = {}           # committed tokens whose K/V the cache holds
    histories: list[list[int]] = [system]
    sealed: dict[int, tuple] = {}             # registered block -> (its key, checksum when registered)
    n, hits = 0, 0

    def checksum(block):
        return float(cache.k[0, block].sum() + 3 * cache.v[0, block].sum())

    def check():
        states = cache.block_states()
        assert states["free"] + states["cached_unreferenced"] + states["referenced"] == cache.num_blocks
        counts = [0] * cache.num_blocks
        for s in live:
            for b in cache.block_table([s])[0, : -(-cache.seq_len(s) // cache.block_size)].tolist():
                counts[b] += 1
        assert counts == cache._refs
        for s, tokens in live.items():        # every position holds what its prefix made
            assert held(cache, s, len(tokens)) == [value(tokens[:p + 1]) for p in range(len(tokens))]
        for b, (key, before) in list(sealed.items()):
            if cache.is_shared(b) and cache._key_of[b] == key:
                assert checksum(b) == before, f"shared block {b} was written"
            else:                             # evicted (and maybe cached again under another key)
                del sealed[b]
        for b in range(cache.num_blocks):
            if cache.is_shared(b) and b not in sealed:
                sealed[b] = (cache._key_of[b], checksum(b))

    for _ in range(1500):
        op = rng.random()
        if op < 0.25 and len(live) < 8:       # a new turn: a history (maybe running) plus new tokens
            base = rng.choice(list(live.values()) if live and rng.random() < 0.6 else histories)
            tokens = base[: rng.randrange(len(base) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            sid = f"s{n}"
            n += 1
            try:
                hits += prefill(cache, sid, tokens)
                live[sid] = tokens
            except OutOfBlocks:
                cache.free(sid)
        elif op < 0.6 and live:               # a tree of two branches; one branch's head accepted
            sid = rng.choice(list(live))
            tokens, k1, k2 = live[sid], rng.randrange(1, 4), rng.randrange(1, 4)
            a_branch = [rng.randrange(50) for _ in range(k1)]
            b_branch = [rng.randrange(50) for _ in range(k2)]
            try:
                cache.reserve(sid, k1 + k2)
            except OutOfBlocks:
                continue
            base = len(tokens)
            for branch, at in ((a_branch, base), (b_branch, base + k1)):
                slots = cache.slots(sid, range(at, at + len(branch)))
                cache.k.view(-1)[slots] = torch.tensor([value(tokens + branch[:j + 1]) for j in range(len(branch))])
                cache.v.view(-1)[slots] = -cache.k.view(-1)[slots]
            accepted = rng.randrange(k2 + 1)
            cache.compact(sid, base, [k1 + j for j in range(accepted)])
            live[sid] = tokens + b_branch[:accepted]
            cache.cache_prefix(sid, live[sid])
        elif op < 0.75 and live:              # a rollback
            sid = rng.choice(list(live))
            keep = rng.randrange(len(live[sid]) + 1)
            cache.truncate(sid, keep)
            live[sid] = live[sid][:keep]
        elif live:                            # finished or aborted
            sid = rng.choice(list(live))
            histories.append(live.pop(sid))
            cache.free(sid)
        check()
    for sid in list(live):
        cache.free(sid)
    live.clear()
    check()
    states = cache.block_states()
    assert states["referenced"] == 0 and states["references"] == 0
    assert states["free"] + states["cached_unreferenced"] == cache.num_blocks
    assert hits > 0 and cache.evictions > 0, "the soak must exercise hits and evictions"
