"""Paged KV cache (PagedAttention, Kwon et al. 2023) shared by the draft and target models.

Keys and values live in fixed-size blocks; a sequence owns a list of blocks (its
block table) and a length. Speculative decoding needs three moves beyond
growing: `truncate` (rollback of a rejected tree or a stale draft), `compact`
(an accepted tree path is scattered over the tree's slots; move it so the
committed prefix is contiguous again) and `free`.

All bookkeeping is host-side Python; tensors move only in `compact` and in the
model's K/V writes. Contract: docs/internals.md, `models` section.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


class OutOfBlocks(RuntimeError):
    """Not enough free blocks for a reservation; the cache was left unchanged."""


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
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # k[layer], v[layer]: [num_blocks, block_size, Hkv, D] views of one tensor each,
        # so `compact` moves every layer in one indexing op.
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # a stack; pop() gives block 0 first
        self._blocks: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    # -- sequences -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self._lens

    def add_sequence(self, seq_id: Hashable) -> None:
        if seq_id in self._lens:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        self._blocks[seq_id] = []
        self._lens[seq_id] = 0

    def free(self, seq_id: Hashable) -> None:
        """Return every block of the sequence and forget it. Freeing an unknown id is a no-op."""
        blocks = self._blocks.pop(seq_id, None)
        self._lens.pop(seq_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[self._known(seq_id)]

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._lens:
            raise KeyError(f"sequence {seq_id!r} is not in the cache")
        return seq_id

    def _blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    # -- growth and rollback ---------------------------------------------------------
    def reserve(self, seq_id: Hashable, n: int) -> None:
        """Grow the sequence by n slots; raises OutOfBlocks and changes nothing if it cannot."""
        if n < 0:
            raise ValueError(f"reserve needs n >= 0, got {n}")
        blocks = self._blocks[self._known(seq_id)]
        new_len = self._lens[seq_id] + n
        need = self._blocks_for(new_len) - len(blocks)
        if need > len(self._free):
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {need} more blocks for {new_len} tokens; "
                f"{len(self._free)} of {self.num_blocks} free"
            )
        for _ in range(need):
            blocks.append(self._free.pop())
        self._lens[seq_id] = new_len

    def truncate(self, seq_id: Hashable, new_len: int) -> None:
        """Roll the sequence back to new_len tokens, freeing blocks past the new end."""
        cur = self.seq_len(seq_id)
        if not 0 <= new_len <= cur:
            raise ValueError(f"truncate of {seq_id!r} to {new_len}: must be in [0, {cur}]")
        blocks = self._blocks[seq_id]
        keep = self._blocks_for(new_len)
        while len(blocks) > keep:
            self._free.append(blocks.pop())
        self._lens[seq_id] = new_len

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
        return torch.tensor([blocks[p // bs] * bs + p % bs for p in positions], device=self.device)

    def block_table(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """`[B, max_blocks] int32`, rows padded with 0 past each sequence's last block."""
        rows = [self._blocks[self._known(s)] for s in seq_ids]
        width = max((len(r) for r in rows), default=0)
        table = [r + [0] * (width - len(r)) for r in rows]
        return torch.tensor(table, dtype=torch.int32).reshape(len(rows), width).to(self.device)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
            f"free={self.num_free_blocks}, sequences={len(self._lens)})"
        )
