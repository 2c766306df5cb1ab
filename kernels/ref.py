"""Pure-torch references for the kernels in this package.

Each function has the signature of its Triton twin in `kernels/` and is the CPU
execution path of the models. See DESIGN.md §5 for the tree attention contract.
"""
from __future__ import annotations

import math

import torch


def tree_decode_attention(
    q: torch.Tensor,             # [B, T, Hq, D]
    k_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    prefix_lens: torch.Tensor,   # [B] int32
    tree_mask: torch.Tensor,     # [B, T, T] bool
    sm_scale: float | None = None,
    num_splits: int | None = None,  # accepted for signature parity; unused here
) -> torch.Tensor:               # [B, T, Hq, D]
    """Attention of T tree queries over a paged prefix plus the tree itself.

    Gathers the pages of each sequence, then a masked softmax in fp32: every
    query sees the whole prefix and the tree nodes that `tree_mask` allows.
    """
    B, T, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    for b in range(B):
        P = int(prefix_lens[b])
        n_blocks = (P + T + block_size - 1) // block_size
        blocks = block_tables[b, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[: P + T].float()  # [P+T, Hkv, D]
        v = v_cache[blocks].reshape(-1, Hkv, D)[: P + T].float()
        qb = q[b].float().reshape(T, Hkv, group, D)                 # [T, Hkv, G, D]
        scores = torch.einsum("thgd,shd->hgts", qb, k) * scale     # [Hkv, G, T, P+T]
        allowed = torch.ones(T, P + T, dtype=torch.bool, device=q.device)
        allowed[:, P:] = tree_mask[b]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ob = torch.einsum("hgts,shd->thgd", probs, v)               # [T, Hkv, G, D]
        out[b] = ob.reshape(T, Hq, D).to(q.dtype)
    return out
