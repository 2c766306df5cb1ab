"""Paged KV cache (PagedAttention, Kwon et al. 2023) shared by the draft and target models.

Keys and values live in fixed-size blocks; a sequence owns a list of blocks (its
block table) and a length. Speculative decoding needs three moves beyond
growing: `truncate` (rollback of a rejected tree or a stale draft), `compact`
(an accepted tree path is scattered over the tree's slots; move it so the
committed prefix is contiguous again) and `free`.

Automatic prefix caching (vLLM's, Kwon et al. 2023), with `prefix_caching=True`: a full
block of committed tokens is registered under a chain hash of its tokens and every token
before it (`cache_prefix`); a new sequence starts on the longest registered chain of its
tokens (`add_sequence(seq_id, token_ids)`), those blocks shared read-only and
reference-counted. A block nobody references stays cached, evictable least-recently-used
when a reservation needs room. Only full blocks are shared, and no sequence ever writes one:
writes go past a sequence's length (its own partial last block or fresh blocks), `compact`
refuses to write a registered block, and a `truncate` into a registered block copies it
first when others share it (copy-on-write) or takes it private when nobody does.

All bookkeeping is host-side Python; tensors move only in `compact` and in the
model's K/V writes. Contract: docs/internals.md, `models` section.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for a reservation; the cache was left unchanged."""


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: sha256 over the previous block's key and this block's tokens
    (a block's K/V depend on every token up to its end)."""
    h = hashlib.sha256(parent or b"")
    h.update(b",".join(str(int(t)).encode() for t in token_ids))
    return h.digest()


def prefix_report(stats: Sequence[dict], name: str = "") -> dict:
    """Engine stats of one or more caches' `prefix_stats()` added up: `<name>prefix_hit_rate`,
    `<name>prefix_cached_blocks`, `<name>prefix_evictions` (serving/prom.py exports them)."""
    queries, hits = sum(s["queries"] for s in stats), sum(s["hits"] for s in stats)
    return {f"{name}prefix_hit_rate": hits / queries if queries else 0.0,
            f"{name}prefix_cached_blocks": sum(s["cached_blocks"] for s in stats),
            f"{name}prefix_evictions": sum(s["evictions"] for s in stats)}


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        prefix_caching: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.prefix_caching = prefix_caching
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # k[layer], v[layer]: [num_blocks, block_size, Hkv, D] views of one tensor each,
        # so `compact` moves every layer in one indexing op.
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # a stack; pop() gives block 0 first
        self._blocks: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        # prefix caching: references per block, the key of each registered block and back,
        # registered blocks nobody references (least recently used first), each sequence's
        # chain of keys over its leading full blocks, and the counters
        self._refs: list[int] = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._by_key: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._keys: dict[Hashable, list[bytes]] = {}
        self.prefix_queries = 0         # tokens looked up by add_sequence
        self.prefix_hits = 0            # of which found cached
        self.evictions = 0              # cached blocks reused for something else

    # -- sequences -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a reservation may take: free ones and cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks (referenced or not)."""
        return len(self._by_key)

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self._lens

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int] | None = None) -> int:
        """A new sequence; with prefix caching and `token_ids` (the tokens it will hold first),
        it starts on the longest cached chain of full blocks of them. Returns its length (the
        cached tokens: 0 without a hit)."""
        if seq_id in self._lens:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        blocks, keys = [], []
        if self.prefix_caching and token_ids is not None:
            bs = self.block_size
            for i in range(len(token_ids) // bs):
                key = chain_hash(keys[-1] if keys else None, token_ids[i * bs:(i + 1) * bs])
                block = self._by_key.get(key)
                if block is None:
                    break
                keys.append(key)
                blocks.append(block)
            for block in blocks:
                self._refs[block] += 1
                self._evictable.pop(block, None)
            self.prefix_queries += len(token_ids)
            self.prefix_hits += len(blocks) * bs
        self._blocks[seq_id] = blocks
        self._lens[seq_id] = len(blocks) * self.block_size
        self._keys[seq_id] = keys
        return self._lens[seq_id]

    def cache_prefix(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Register the sequence's full blocks whose tokens are `token_ids` (its first
        positions, K/V already written) for other sequences to start on. Returns the blocks
        registered now; a no-op without prefix caching."""
        if not self.prefix_caching:
            return 0
        blocks, keys, bs = self._blocks[self._known(seq_id)], self._keys[seq_id], self.block_size
        added = 0
        for i in range(len(keys), min(len(token_ids), self._lens[seq_id]) // bs):
            key = chain_hash(keys[-1] if keys else None, token_ids[i * bs:(i + 1) * bs])
            keys.append(key)
            if key not in self._by_key and blocks[i] not in self._key_of:   # else: a copy stays private
                self._by_key[key], self._key_of[blocks[i]] = blocks[i], key
                added += 1
        return added

    def free(self, seq_id: Hashable) -> None:
        """Release every block of the sequence and forget it (cached blocks stay cached, now
        evictable). Freeing an unknown id is a no-op."""
        blocks = self._blocks.pop(seq_id, None)
        self._lens.pop(seq_id, None)
        self._keys.pop(seq_id, None)
        for block in reversed(blocks or []):        # a chain's tail is evicted before its head
            self._release(block)

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[self._known(seq_id)]

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._lens:
            raise KeyError(f"sequence {seq_id!r} is not in the cache")
        return seq_id

    def _blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    # -- blocks ------------------------------------------------------------------------
    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:                                       # the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            del self._by_key[self._key_of.pop(block)]
            self.evictions += 1
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def block_states(self) -> dict:
        """Counts of blocks free, cached and unreferenced, and referenced (they sum to
        `num_blocks`), and the references held (a block shared by two sequences counts 2)."""
        return {"free": len(self._free), "cached_unreferenced": len(self._evictable),
                "referenced": sum(1 for r in self._refs if r > 0), "references": sum(self._refs)}

    @contextlib.contextmanager
    def uncounted(self):
        """Lookups made inside (an engine's warm-up on a dummy sequence) leave the hit-rate
        counters as they were."""
        queries, hits = self.prefix_queries, self.prefix_hits
        try:
            yield self
        finally:
            self.prefix_queries, self.prefix_hits = queries, hits

    def prefix_stats(self) -> dict:
        return {"queries": self.prefix_queries, "hits": self.prefix_hits, "evictions": self.evictions,
                "cached_blocks": self.num_cached_blocks}

    def block_keys(self, seq_id: Hashable) -> list[bytes]:
        """The chain keys of the sequence's leading full blocks, as far as `add_sequence` and
        `cache_prefix` computed them (registered, or private copies of registered content)."""
        return list(self._keys[self._known(seq_id)])

    def is_cached(self, key: bytes) -> bool:
        return key in self._by_key

    def is_shared(self, block: int) -> bool:
        """Registered (read-only): no sequence may write it."""
        return block in self._key_of

    # -- growth and rollback ---------------------------------------------------------
    def reserve(self, seq_id: Hashable, n: int) -> None:
        """Grow the sequence by n slots; raises OutOfBlocks and changes nothing if it cannot."""
        if n < 0:
            raise ValueError(f"reserve needs n >= 0, got {n}")
        blocks = self._blocks[self._known(seq_id)]
        new_len = self._lens[seq_id] + n
        need = self._blocks_for(new_len) - len(blocks)
        if need > self.num_free_blocks:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {need} more blocks for {new_len} tokens; "
                f"{self.num_free_blocks} of {self.num_blocks} free"
            )
        for _ in range(need):
            blocks.append(self._allocate())
        self._lens[seq_id] = new_len

    def truncate(self, seq_id: Hashable, new_len: int) -> None:
        """Roll the sequence back to new_len tokens, releasing blocks past the new end. A
        registered block that becomes the partial last one (to be written again) is copied
        when others reference it, else taken out of the cache."""
        cur = self.seq_len(seq_id)
        if not 0 <= new_len <= cur:
            raise ValueError(f"truncate of {seq_id!r} to {new_len}: must be in [0, {cur}]")
        blocks = self._blocks[seq_id]
        keep = self._blocks_for(new_len)
        last = blocks[keep - 1] if new_len % self.block_size and keep else None
        shared = last is not None and last in self._key_of and self._refs[last] > 1
        if shared and self.num_free_blocks + sum(self._refs[b] == 1 for b in blocks[keep:]) < 1:
            raise OutOfBlocks(f"truncate of {seq_id!r} into a shared block needs a free block to copy it")
        while len(blocks) > keep:
            self._release(blocks.pop())
        if shared:
            self._copy_on_write(blocks, keep - 1)
        elif last is not None and last in self._key_of:      # nobody else reads it: take it private
            del self._by_key[self._key_of.pop(last)]
        del self._keys[seq_id][new_len // self.block_size:]
        self._lens[seq_id] = new_len

    def _copy_on_write(self, blocks: list[int], i: int) -> None:
        old, new = blocks[i], self._allocate()
        for cache in (self.k, self.v):
            cache[:, new] = cache[:, old]
        blocks[i] = new
        self._release(old)

    def compact(self, seq_id: Hashable, base: int, src_offsets: Sequence[int]) -> None:
        """Move K/V at `base + src_offsets[i]` to `base + i` (all layers), then truncate to
        `base + len(src_offsets)`. Commits an accepted tree path (offsets in any order)."""
        cur = self.seq_len(seq_id)
        n = len(src_offsets)
        if base < 0 or base + n > cur or any(not 0 <= base + o < cur for o in src_offsets):
            raise ValueError(
                f"compact of {seq_id!r}: base {base} with offsets {list(src_offsets)} "
                f"reaches outside its {cur} tokens"
            )
        moved = [i for i, o in enumerate(src_offsets) if o != i]
        if moved:
            blocks, bs = self._blocks[seq_id], self.block_size
            if any(blocks[(base + i) // bs] in self._key_of for i in moved):
                raise RuntimeError(f"compact of {seq_id!r} at {base} would write a shared block")
            src = self.slots(seq_id, [base + src_offsets[i] for i in moved])   # [M]
            dst = self.slots(seq_id, [base + i for i in moved])                # [M]
            for cache in (self.k, self.v):
                flat = cache.view(self.num_layers, -1, *cache.shape[3:])   # [L, N*bs, Hkv, D]
                flat[:, dst] = flat[:, src]                                 # gather copies first
        self.truncate(seq_id, base + n)

    # -- addressing ------------------------------------------------------------------
    def slots(self, seq_id: Hashable, positions: Sequence[int]) -> torch.Tensor:
        """Flat slot (block * block_size + offset) of each position: `[len(positions)] int64`."""
        blocks = self._blocks[self._known(seq_id)]
        bs = self.block_size
        return torch.tensor([blocks[p // bs] * bs + p % bs for p in positions], dtype=torch.long, device=self.device)

    def block_table(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """`[B, max_blocks] int32`, rows padded with 0 past each sequence's last block."""
        rows = [self._blocks[self._known(s)] for s in seq_ids]
        width = max((len(r) for r in rows), default=0)
        table = [r + [0] * (width - len(r)) for r in rows]
        return torch.tensor(table, dtype=torch.int32).reshape(len(rows), width).to(self.device)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
            f"free={self.num_free_blocks}, cached={self.num_cached_blocks}, sequences={len(self._lens)})"
        )
