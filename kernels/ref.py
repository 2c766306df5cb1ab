"""Pure-torch references for the kernels in this package.

Each function has the signature of its Triton twin in `kernels/` and is the CPU
execution path of the models. See DESIGN.md §5 for the tree attention contract.
"""
from __future__ import annotations

import math

import torch


def tree_depths(tree_mask: torch.Tensor) -> torch.Tensor:  # [B, T, T] bool -> [B, T] int32
    """Each node's depth in its tree (0 = a child of the prefix's last token): its ancestors."""
    return tree_mask.sum(-1, dtype=torch.int32) - 1


def window_tree_mask(tree_mask: torch.Tensor, sliding_window: int) -> torch.Tensor:  # [B, T, T] bool
    """`tree_mask` less the ancestors a sliding window hides: node i (at position P + depth i)
    sees ancestor j (at P + depth j) only while depth i - depth j < sliding_window."""
    d = tree_depths(tree_mask)
    return tree_mask & ((d[:, :, None] - d[:, None, :]) < sliding_window)


def tree_decode_attention(
    q: torch.Tensor,             # [B, T, Hq, D]
    k_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    prefix_lens: torch.Tensor,   # [B] int32
    tree_mask: torch.Tensor,     # [B, T, T] bool
    sm_scale: float | None = None,
    num_splits: int | None = None,  # accepted for signature parity; unused here
    sliding_window: int | None = None,  # a query at position i sees keys at j > i - window; None = all
) -> torch.Tensor:               # [B, T, Hq, D]
    """Attention of T tree queries over a paged prefix plus the tree itself.

    Gathers the pages of each sequence, then a masked softmax in fp32: every
    query sees the whole prefix (with a sliding window, the prefix positions j with
    P + depth(i) - j < window) and the tree nodes that `tree_mask` allows.
    """
    B, T, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    if sliding_window is not None:
        depths = tree_depths(tree_mask).long()                       # [B, T]
        tree_mask = window_tree_mask(tree_mask, sliding_window)
    for b in range(B):
        P = int(prefix_lens[b])
        n_blocks = (P + T + block_size - 1) // block_size
        blocks = block_tables[b, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[: P + T].float()  # [P+T, Hkv, D]
        v = v_cache[blocks].reshape(-1, Hkv, D)[: P + T].float()
        qb = q[b].float().reshape(T, Hkv, group, D)                 # [T, Hkv, G, D]
        scores = torch.einsum("thgd,shd->hgts", qb, k) * scale     # [Hkv, G, T, P+T]
        allowed = torch.ones(T, P + T, dtype=torch.bool, device=q.device)
        if sliding_window is not None:
            query_pos = P + depths[b]                               # [T]
            allowed[:, :P] = torch.arange(P, device=q.device)[None, :] > query_pos[:, None] - sliding_window
        allowed[:, P:] = tree_mask[b]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ob = torch.einsum("hgts,shd->thgd", probs, v)               # [T, Hkv, G, D]
        out[b] = ob.reshape(T, Hq, D).to(q.dtype)
    return out


# ---------------------------------------------------------------------------
# Rejection sampling (docs/internals.md, `kernels`): the torch twin of
# kernels/rejection.py. Every float op that decides an outcome is written so the
# Triton kernel performs the same IEEE-754 operations in the same order:
# elementwise sub / max / div / mul, and sums over the vocabulary in the fixed
# order of `fixed_order_sum`. That is what makes `torch.equal` hold between them.
# ---------------------------------------------------------------------------

SUM_BLOCK = 1024  # the kernel's vocabulary tile; fixes the summation order


def fixed_order_sum(x: torch.Tensor) -> torch.Tensor:  # [V] float32 -> [] float32
    """Sum in a fixed order: tile-wise elementwise accumulation, then a pairwise fold.

    x is cut into tiles of SUM_BLOCK (zero-padded); acc[j] = sum over tiles in
    order of tile[j]; then acc is folded in halves, acc[j] + acc[j + half],
    down to one value. The kernel does exactly these additions.
    """
    pad = (-x.shape[-1]) % SUM_BLOCK
    tiles = torch.nn.functional.pad(x, (0, pad)).view(-1, SUM_BLOCK)
    acc = tiles[0].clone()
    for i in range(1, tiles.shape[0]):
        acc = acc + tiles[i]
    while acc.numel() > 1:
        half = acc.numel() // 2
        acc = acc[:half] + acc[half:]
    return acc[0]


def _reject_child(p: torch.Tensor, q: torch.Tensor, token: int):  # [V], [V] float32
    """After child `token` is rejected: p' = norm(max(p' - q', 0)); q'(token) = 0, q' = norm(q').

    A zero sum leaves the vector as it is (p' = q' exactly, or an all-zero q').
    """
    residual = torch.clamp_min(p - q, 0.0)
    s = fixed_order_sum(residual)
    p_new = residual / s if s > 0 else p
    q_zeroed = q.clone()
    q_zeroed[token] = 0.0
    sq = fixed_order_sum(q_zeroed)
    q_new = q_zeroed / sq if sq > 0 else q_zeroed
    return p_new, q_new


def rejection_sample(
    draft_token_ids: torch.Tensor,   # [B, T] int64
    parent_ids: torch.Tensor,        # [B, T] int64, -1 = child of the root
    num_nodes: torch.Tensor,         # [B] int64
    target_probs: torch.Tensor,      # [B, T+1, V] float32
    draft_probs: torch.Tensor | None,  # [B, T+1, V] float32, None = greedy
    uniform: torch.Tensor,           # [B, T] float32 in [0, 1)
    exp_noise: torch.Tensor,         # [B, V] float32, Exponential(1)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [B, T], [B], [B] int64
    """One verification step for a batch of token trees (internals.md, `kernels`).

    Walks down from the root; at node u its children are tried in index order.
    Greedy: accept the first child whose token is argmax p_u. Stochastic
    (SpecInfer / Sequoia multi-step speculative sampling, children drawn without
    replacement from q_u): accept child x if uniform[x] * q'(x) < p'(x), else
    p' = norm(max(p' - q', 0)), q'(x) = 0, q' = norm(q'). When no child is
    accepted, the next token is argmax p_u (greedy) or argmax(p' / exp_noise),
    an exact sample of p' (stochastic). A chain is the width-1 case (Leviathan
    et al. 2023; Chen et al. 2023).
    """
    B, T = draft_token_ids.shape
    device = draft_token_ids.device
    accepted_nodes = torch.full((B, T), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=device)
    next_token_ids = torch.zeros(B, dtype=torch.int64, device=device)
    for b in range(B):
        n = int(num_nodes[b])
        parents = parent_ids[b, :n].tolist()
        tokens = draft_token_ids[b, :n].tolist()
        u, depth = -1, 0
        while True:
            p = target_probs[b, u + 1]
            children = [i for i in range(u + 1, n) if parents[i] == u]
            child = None
            if draft_probs is None:
                best = int(torch.argmax(p))
                child = next((i for i in children if tokens[i] == best), None)
            else:
                q = draft_probs[b, u + 1]
                for i in children:
                    x = tokens[i]
                    if uniform[b, i] * q[x] < p[x]:
                        child = i
                        break
                    p, q = _reject_child(p, q, x)
            if child is None:  # correction token, or bonus token below a leaf
                if draft_probs is None:
                    next_token_ids[b] = best
                else:
                    next_token_ids[b] = int(torch.argmax(p / exp_noise[b]))
                break
            accepted_nodes[b, depth] = child
            depth += 1
            u = child
        num_accepted[b] = depth
    return accepted_nodes, num_accepted, next_token_ids
