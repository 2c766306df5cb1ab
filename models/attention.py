"""The one switch between the tree attention kernels (DESIGN.md §5).

CUDA tensors go to the Triton split-K kernel (`kernels.tree_decode_attention`),
imported lazily so CPU-only installs never touch Triton; everything else goes
to the pure-torch reference `kernels.ref.tree_decode_attention`.
"""
from __future__ import annotations

import torch

from kernels import ref


def tree_attention(
    q: torch.Tensor,             # [B, T, Hq, D]
    k_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]  tree keys already written
    v_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    prefix_lens: torch.Tensor,   # [B] int32
    tree_mask: torch.Tensor,     # [B, T, T] bool
    sm_scale: float | None = None,
) -> torch.Tensor:               # [B, T, Hq, D]
    if q.is_cuda:
        from kernels import tree_decode_attention   # Triton; lazy on purpose

        return tree_decode_attention(
            q.contiguous(), k_cache, v_cache, block_tables, prefix_lens, tree_mask, sm_scale=sm_scale
        )
    return ref.tree_decode_attention(
        q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, sm_scale=sm_scale
    )
