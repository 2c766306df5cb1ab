"""Fused rejection sampler for token trees and chains (Triton).

One program verifies one sequence's tree: it walks down from the root, trying
the children of each node in index order. Greedy: accept the child carrying
argmax p_u. Stochastic: multi-step speculative sampling over children drawn
without replacement from q_u (SpecInfer, Miao et al. 2023; Sequoia, Chen et
al. 2024); a chain reduces to Leviathan et al. 2023 / Chen et al. 2023. The
contract and the exact rule are in docs/internals.md (`kernels`), the torch
twin is `kernels.ref.rejection_sample`.

Bit-equality with the reference. The randomness comes in as tensors
(`uniform`, `exp_noise`), and every float op that decides an outcome is one
IEEE-754 op both sides perform identically: elementwise sub, max, mul
(`uniform * q'`), correctly rounded division (`div_rn`, not Triton's fast
`/`), and sums over the vocabulary in the fixed order of
`kernels.ref.fixed_order_sum` (tile-wise accumulation, then a pairwise fold),
never `tl.sum`'s unspecified order. Argmax ties go to the lowest index on both
sides. Caveats: NaN inputs, or `exp_noise` entries of exactly 0, are outside
the contract (argmax over NaN/inf may differ); the reference must run in
float32 on a device whose torch division is correctly rounded (CPU, and CUDA
without fast-math, which is how torch is built).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ref import SUM_BLOCK


@triton.jit
def _fold(x):
    """x[j] + x[j + half]: one pairwise step; a two-element sum is exact in any order."""
    return tl.sum(tl.reshape(x, [2, x.shape[0] // 2]), 0)


@triton.jit
def _fixed_order_sum(acc, BLOCK_V: tl.constexpr):
    """Fold a [1024] accumulator to a scalar, as kernels.ref.fixed_order_sum."""
    tl.static_assert(BLOCK_V == 1024)
    acc = _fold(acc)  # 512
    acc = _fold(acc)  # 256
    acc = _fold(acc)  # 128
    acc = _fold(acc)  # 64
    acc = _fold(acc)  # 32
    acc = _fold(acc)  # 16
    acc = _fold(acc)  # 8
    acc = _fold(acc)  # 4
    acc = _fold(acc)  # 2
    acc = _fold(acc)  # 1
    return tl.sum(acc, 0)


@triton.jit
def _row_argmax(p_row_ptr, e_row_ptr, V, DIVIDE: tl.constexpr, BLOCK_V: tl.constexpr):
    """argmax_v p[v] (or p[v] / e[v]); ties go to the lowest index."""
    best_val = float("-inf")
    best_idx = 0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        ok = offs < V
        x = tl.load(p_row_ptr + offs, mask=ok, other=0.0)
        if DIVIDE:
            e = tl.load(e_row_ptr + offs, mask=ok, other=1.0)
            x = tl.math.div_rn(x, e)
        x = tl.where(ok, x, float("-inf"))
        blk_val = tl.max(x, 0)
        blk_idx = tl.argmax(x, 0, tie_break_left=True)
        if blk_val > best_val:  # strict: an earlier tile wins a tie
            best_val = blk_val
            best_idx = v0 + blk_idx
    return best_idx


@triton.jit
def _reject_child(src_p, src_q, wp_ptr, wq_ptr, token, V, BLOCK_V: tl.constexpr):
    """p' = norm(max(p' - q', 0)); q'(token) = 0, q' = norm(q'); written to wp / wq.

    Pass 1 only sums, pass 2 recomputes and writes, so src may alias wp / wq
    (each element is read and written by the same thread in one iteration).
    """
    acc_r = tl.zeros([BLOCK_V], tl.float32)
    acc_q = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        ok = offs < V
        p = tl.load(src_p + offs, mask=ok, other=0.0)
        q = tl.load(src_q + offs, mask=ok, other=0.0)
        acc_r += tl.maximum(p - q, 0.0)
        acc_q += tl.where(offs == token, 0.0, q)
    s = _fixed_order_sum(acc_r, BLOCK_V)
    sq = _fixed_order_sum(acc_q, BLOCK_V)
    s_div = tl.where(s > 0.0, s, 1.0)
    sq_div = tl.where(sq > 0.0, sq, 1.0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        ok = offs < V
        p = tl.load(src_p + offs, mask=ok, other=0.0)
        q = tl.load(src_q + offs, mask=ok, other=0.0)
        r = tl.maximum(p - q, 0.0)
        qz = tl.where(offs == token, 0.0, q)
        tl.store(wp_ptr + offs, tl.where(s > 0.0, tl.math.div_rn(r, s_div), p), mask=ok)
        tl.store(wq_ptr + offs, tl.where(sq > 0.0, tl.math.div_rn(qz, sq_div), qz), mask=ok)
    tl.debug_barrier()  # the next scalar loads of p'(x), q'(x) read other threads' stores


@triton.jit
def _rejection_kernel(
    draft_ptr,    # [B, T] int64: draft token of node i
    parent_ptr,   # [B, T] int64: parent node, -1 = root
    nnodes_ptr,   # [B] int64
    p_ptr,        # [B, T+1, V] float32: target probs after root / node i
    q_ptr,        # [B, T+1, V] float32: draft probs (unused when GREEDY)
    u_ptr,        # [B, T] float32: acceptance draws
    e_ptr,        # [B, V] float32: Exponential(1) draws for the final token
    wp_ptr,       # [B, V] float32 scratch: p' after a rejection
    wq_ptr,       # [B, V] float32 scratch: q' after a rejection
    path_ptr,     # [B, T] int64 out: accepted nodes, -1 padded
    nacc_ptr,     # [B] int64 out
    next_ptr,     # [B] int64 out
    T, V,
    GREEDY: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(nnodes_ptr + b)
    wp_row = wp_ptr + b * V
    wq_row = wq_ptr + b * V
    e_row = e_ptr + b * V
    path = tl.full([BLOCK_T], -1, tl.int64)
    depth = tl.zeros([], tl.int64)
    u = tl.zeros([], tl.int64) - 1
    done = tl.zeros([], tl.int32)
    next_token = tl.zeros([], tl.int64)
    for _step in range(0, T + 1):  # a path has at most T nodes, then the final token
        if done == 0:
            src_p = p_ptr + (b * (T + 1) + u + 1) * V
            src_q = q_ptr + (b * (T + 1) + u + 1) * V
            best = tl.zeros([], tl.int64)
            if GREEDY:
                best = _row_argmax(src_p, e_row, V, False, BLOCK_V).to(tl.int64)
            child = tl.zeros([], tl.int64) - 1
            for i in range(u + 1, n):  # siblings in index order (topological order)
                parent = tl.load(parent_ptr + b * T + i)
                if (child < 0) & (parent == u):
                    x = tl.load(draft_ptr + b * T + i)
                    if GREEDY:
                        if x == best:
                            child = i
                    else:
                        draw = tl.load(u_ptr + b * T + i)
                        if draw * tl.load(src_q + x) < tl.load(src_p + x):
                            child = i
                        else:
                            _reject_child(src_p, src_q, wp_row, wq_row, x, V, BLOCK_V)
                            src_p = wp_row
                            src_q = wq_row
            if child < 0:
                done = 1
                if GREEDY:
                    next_token = best
                else:
                    next_token = _row_argmax(src_p, e_row, V, True, BLOCK_V).to(tl.int64)
            else:
                path = tl.where(tl.arange(0, BLOCK_T) == depth, child, path)
                depth += 1
                u = child
    offs_t = tl.arange(0, BLOCK_T)
    tl.store(path_ptr + b * T + offs_t, path, mask=offs_t < T)
    tl.store(nacc_ptr + b, depth)
    tl.store(next_ptr + b, next_token)


def rejection_sample(
    draft_token_ids: torch.Tensor,     # [B, T] int64
    parent_ids: torch.Tensor,          # [B, T] int64
    num_nodes: torch.Tensor,           # [B] int64
    target_probs: torch.Tensor,        # [B, T+1, V] float32
    draft_probs: torch.Tensor | None,  # [B, T+1, V] float32, None = greedy
    uniform: torch.Tensor,             # [B, T] float32
    exp_noise: torch.Tensor,           # [B, V] float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [B, T], [B], [B] int64
    """Verify a batch of trees in one launch; equals kernels.ref.rejection_sample bit for bit."""
    B, T = draft_token_ids.shape
    V = target_probs.shape[-1]
    greedy = draft_probs is None
    assert draft_token_ids.dtype == parent_ids.dtype == num_nodes.dtype == torch.int64
    assert parent_ids.shape == (B, T) and num_nodes.shape == (B,)
    assert target_probs.dtype == torch.float32 and target_probs.shape == (B, T + 1, V)
    assert greedy or (draft_probs.dtype == torch.float32 and draft_probs.shape == (B, T + 1, V))
    assert uniform.dtype == torch.float32 and uniform.shape == (B, T)
    assert exp_noise.dtype == torch.float32 and exp_noise.shape == (B, V)
    tensors = [draft_token_ids, parent_ids, num_nodes, target_probs, uniform, exp_noise]
    for x in tensors + ([] if greedy else [draft_probs]):
        assert x.is_contiguous() and x.device == target_probs.device

    device = target_probs.device
    accepted_nodes = torch.empty(B, T, dtype=torch.int64, device=device)
    num_accepted = torch.empty(B, dtype=torch.int64, device=device)
    next_token_ids = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return accepted_nodes, num_accepted, next_token_ids
    # p' / q' working rows, only touched after a rejection
    work = torch.empty(2, B, V, dtype=torch.float32, device=device)
    if T == 0:  # keep every pointer valid; these rows are never read
        draft_token_ids = parent_ids = torch.zeros(B, 1, dtype=torch.int64, device=device)
        uniform = torch.zeros(B, 1, dtype=torch.float32, device=device)
        accepted_nodes_k = torch.empty(B, 1, dtype=torch.int64, device=device)
    else:
        accepted_nodes_k = accepted_nodes
    _rejection_kernel[(B,)](
        draft_token_ids, parent_ids, num_nodes, target_probs,
        target_probs if greedy else draft_probs, uniform, exp_noise,
        work[0], work[1], accepted_nodes_k, num_accepted, next_token_ids, T, V,
        GREEDY=greedy, BLOCK_V=SUM_BLOCK, BLOCK_T=max(16, triton.next_power_of_2(T)),
        num_warps=4, enable_fp_fusion=False,  # no FMA contraction: keep the reference's rounding
    )
    return accepted_nodes, num_accepted, next_token_ids
