"""Split-K tree attention over a paged KV cache (Triton).

The verifier's hot path: T tree queries attend to a long paged prefix plus the
tree itself, whose keys sit at positions `prefix_len + j` and are visible
through `tree_mask` (SpecInfer, Miao et al. 2023; Sequoia, Chen et al. 2024).
The prefix part is flash-decoding (Dao et al. 2023, "Flash-Decoding for
long-context inference"): stage 1 splits the prefix into `num_splits` chunks,
each program writing a partial output and its log-sum-exp; stage 2 computes the
tree part and merges it with the partials.

One program handles one KV head and a tile of `BLOCK_M` query rows, a row being
one (tree node, query head of the group) pair, so a KV tile is loaded once for
every query head that shares it (grouped-query attention without repeating
K/V) and for all T nodes. When T * Hq/Hkv exceeds `BLOCK_M` the rows are tiled
and each tile re-reads the KV (mostly from L2).

Contract: DESIGN.md §5 and docs/internals.md; `kernels.ref.tree_decode_attention`
is the pure-torch reference with the same signature.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels import ref

_LOG2E = 1.4426950408889634
_MAX_BLOCK_M = 64       # query rows per program
_MIN_SPLIT_TOKENS = 512  # no chunk shorter than this: short prefixes are not split
_MAX_SPLITS = 64


@triton.jit
def _load_kv_tile(
    k_ptr, v_ptr, bt_row_ptr, pos, pos_ok, offs_d, d_ok, kvh,
    stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    PAGE_SIZE: tl.constexpr,
):
    """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] for logical positions `pos`."""
    page = tl.load(bt_row_ptr + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
    slot = (pos % PAGE_SIZE).to(tl.int64)
    k_off = page * stride_kn + slot * stride_ks + kvh * stride_kh
    v_off = page * stride_vn + slot * stride_vs + kvh * stride_vh
    kt = tl.load(k_ptr + k_off[None, :] + offs_d[:, None],
                 mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :],
                mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
    return kt, v


@triton.jit
def _online_softmax_step(q, kt, v, allowed, m_i, l_i, acc, qk_scale,
                         DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One flash-attention update in the log2 domain; masked scores are -inf."""
    if DOT_UPCAST:  # Triton's CPU interpreter computes bf16 dots wrongly (3.9): use fp32
        q = q.to(tl.float32)
        kt = kt.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_q_tile(q_ptr, b, kvh, m_block, T, stride_qb, stride_qt, stride_qh,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # row = t * GROUP + g
    row_ok = rows < T * GROUP
    t = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_off = b.to(tl.int64) * stride_qb + t * stride_qt + h * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return q, rows, row_ok, t, h, offs_d, d_ok


@triton.jit
def _tree_attn_prefix_kernel(
    q_ptr,      # [B, T, Hq, D]
    k_ptr,      # [N_blocks, PAGE_SIZE, Hkv, D]
    v_ptr,      # [N_blocks, PAGE_SIZE, Hkv, D]
    bt_ptr,     # [B, max_blocks] int32
    plen_ptr,   # [B] int32
    depth_ptr,  # [B, T] int32: each node's depth (read only with HAS_WINDOW)
    po_ptr,     # [B, Hkv, S, T*GROUP, D] float32: partial output, normalised
    plse_ptr,   # [B, Hkv, S, T*GROUP] float32: partial log2-sum-exp2 (-inf if empty)
    qk_scale, T, Hkv, num_splits, window,
    stride_qb, stride_qt, stride_qh,
    stride_kn, stride_ks, stride_kh,
    stride_vn, stride_vs, stride_vh,
    stride_btb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Stage 1: one (sequence, KV head, prefix chunk, row tile) per program. With a sliding
    window, row t (at position P + depth t) sees prefix positions > P + depth t - window, and
    tiles before P - window + 1 (outside every row's window) are not read at all."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    m_block = tl.program_id(2)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    q, rows, row_ok, t, h, offs_d, d_ok = _load_q_tile(
        q_ptr, b, kvh, m_block, T, stride_qb, stride_qt, stride_qh,
        GROUP, HEAD_DIM, BLOCK_M, BLOCK_D)

    P = tl.load(plen_ptr + b)
    chunk = tl.cdiv(tl.cdiv(P, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, P)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    begin = start
    if HAS_WINDOW:
        depth = tl.load(depth_ptr + b.to(tl.int64) * T + t, mask=row_ok, other=0)   # [BLOCK_M]
        oldest = P + depth - window                                                  # last hidden position
        begin = tl.maximum(start, P - window + 1)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(begin, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        kt, v = _load_kv_tile(k_ptr, v_ptr, bt_row, pos, pos_ok, offs_d, d_ok, kvh,
                              stride_kn, stride_ks, stride_kh,
                              stride_vn, stride_vs, stride_vh, PAGE_SIZE)
        allowed = pos_ok[None, :]
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > oldest[:, None])
        m_i, l_i, acc = _online_softmax_step(q, kt, v, allowed, m_i, l_i, acc,
                                             qk_scale, DOT_PRECISION, DOT_UPCAST)

    has = l_i > 0.0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    M = T * GROUP
    base = (pid_bh.to(tl.int64) * num_splits + split) * M
    tl.store(plse_ptr + base + rows, lse, mask=row_ok)
    tl.store(po_ptr + (base + rows)[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _tree_attn_merge_kernel(
    q_ptr,      # [B, T, Hq, D]
    k_ptr,      # [N_blocks, PAGE_SIZE, Hkv, D]
    v_ptr,      # [N_blocks, PAGE_SIZE, Hkv, D]
    bt_ptr,     # [B, max_blocks] int32
    plen_ptr,   # [B] int32
    mask_ptr,   # [B, T, T] uint8 (tree_mask viewed as bytes)
    po_ptr,     # [B, Hkv, S, T*GROUP, D] float32
    plse_ptr,   # [B, Hkv, S, T*GROUP] float32
    out_ptr,    # [B, T, Hq, D] dtype of q
    qk_scale, T, Hkv, num_splits,
    stride_qb, stride_qt, stride_qh,
    stride_kn, stride_ks, stride_kh,
    stride_vn, stride_vs, stride_vh,
    stride_btb,
    stride_ob, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr,  # stage 1 only
):
    """Stage 2: the tree keys under `tree_mask`, then merge the prefix partials."""
    pid_bh = tl.program_id(0)
    m_block = tl.program_id(1)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    q, rows, row_ok, t, h, offs_d, d_ok = _load_q_tile(
        q_ptr, b, kvh, m_block, T, stride_qb, stride_qt, stride_qh,
        GROUP, HEAD_DIM, BLOCK_M, BLOCK_D)
    P = tl.load(plen_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    mask_row = mask_ptr + b.to(tl.int64) * T * T + t * T  # [BLOCK_M] pointers

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j0 in range(0, T, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < T
        kt, v = _load_kv_tile(k_ptr, v_ptr, bt_row, P + j, j_ok, offs_d, d_ok, kvh,
                              stride_kn, stride_ks, stride_kh,
                              stride_vn, stride_vs, stride_vh, PAGE_SIZE)
        allowed = tl.load(mask_row[:, None] + j[None, :],
                          mask=row_ok[:, None] & j_ok[None, :], other=0) != 0
        m_i, l_i, acc = _online_softmax_step(q, kt, v, allowed, m_i, l_i, acc,
                                             qk_scale, DOT_PRECISION, DOT_UPCAST)

    M = T * GROUP
    for s in range(0, num_splits):
        base = (pid_bh.to(tl.int64) * num_splits + s) * M
        lse_s = tl.load(plse_ptr + base + rows, mask=row_ok, other=float("-inf"))
        o_s = tl.load(po_ptr + (base + rows)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m_i, lse_s)
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(lse_s - m_new)
        l_i = l_i * alpha + beta
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # l_i == 0 only on padding rows
    o_off = b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _new_output(q: torch.Tensor) -> torch.Tensor:
    """The output buffer; tests swap this for a NaN-filled one to catch unwritten rows."""
    return torch.empty_like(q)


def _new_scratch(*shape: int, device: torch.device) -> torch.Tensor:
    """Split-partial scratch (float32); tests swap this for a NaN-filled one."""
    return torch.empty(*shape, device=device, dtype=torch.float32)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: pretend to be an H100/H200 so CPU runs pick the same splits


def choose_num_splits(batch: int, num_kv_heads: int, num_m_blocks: int,
                      max_prefix_len: int, num_sms: int) -> int:
    """Split the prefix until the launch has ~2 programs per SM, chunks >= 512 tokens."""
    programs = batch * num_kv_heads * num_m_blocks
    want = triton.cdiv(2 * num_sms, programs)
    cap = max(1, max_prefix_len // _MIN_SPLIT_TOKENS)
    return int(max(1, min(want, cap, _MAX_SPLITS)))


def _block_sizes(T: int, group: int, D: int, dtype: torch.dtype) -> tuple[int, int, int]:
    block_m = min(_MAX_BLOCK_M, max(16, triton.next_power_of_2(T * group)))
    block_d = max(16, triton.next_power_of_2(D))
    block_n = 32 if dtype == torch.float32 else 64  # 16 KB of K+V per tile at D = 128
    return block_m, block_n, block_d


def _check_inputs(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask) -> None:
    """The launcher's contract (shapes as in `tree_decode_attention`), asserted before launch."""
    B, T, Hq, D = q.shape
    n_blocks, page_size, Hkv, Dk = k_cache.shape
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q, k, v dtypes differ"
    assert v_cache.shape == k_cache.shape and Dk == D, "k/v cache shape mismatch"
    assert Hq % Hkv == 0, f"Hq={Hq} not a multiple of Hkv={Hkv}"
    assert 16 <= D <= 256, f"head dim {D} unsupported"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2
    assert block_tables.shape[0] == B
    assert prefix_lens.dtype == torch.int32 and prefix_lens.shape == (B,)
    assert tree_mask.dtype == torch.bool and tree_mask.shape == (B, T, T)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables), ("prefix_lens", prefix_lens),
                    ("tree_mask", tree_mask)):
        assert x.is_contiguous(), f"{name} must be contiguous"
        assert x.device == q.device, f"{name} on {x.device}, q on {q.device}"


def tree_decode_attention(
    q: torch.Tensor,             # [B, T, Hq, D]
    k_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    prefix_lens: torch.Tensor,   # [B] int32
    tree_mask: torch.Tensor,     # [B, T, T] bool
    sm_scale: float | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,  # a query at position i sees keys at j > i - window; None = all
) -> torch.Tensor:               # [B, T, Hq, D], dtype of q
    """Attention of T tree nodes over their paged prefix and the tree (DESIGN.md §5).

    `num_splits=None` picks the split count from the shapes without a host sync:
    the prefix length is bounded by the block table's capacity. A node's position is
    P + its depth (the ancestors `tree_mask` gives it); `sliding_window` hides the keys
    more than window - 1 positions behind it, prefix and tree alike (Mistral's mask).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask)
    B, T, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = _new_output(q)
    if B == 0 or T == 0:
        return out
    group = Hq // Hkv
    block_m, block_n, block_d = _block_sizes(T, group, D, q.dtype)
    m_blocks = triton.cdiv(T * group, block_m)
    if num_splits is None:
        capacity = block_tables.shape[1] * page_size
        num_splits = choose_num_splits(B, Hkv, m_blocks, capacity, _num_sms(q.device))
    assert num_splits >= 1
    assert sliding_window is None or sliding_window >= 1, sliding_window
    if sliding_window is not None:   # the tree part: hide the ancestors too far up; the prefix: stage 1
        depths = ref.tree_depths(tree_mask).contiguous()
        tree_mask = ref.window_tree_mask(tree_mask, sliding_window).contiguous()
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    qk_scale = scale * _LOG2E
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"

    # Scratch for the split partials, allocated once per call.
    partial_out = _new_scratch(B, Hkv, num_splits, T * group, D, device=q.device)
    partial_lse = _new_scratch(B, Hkv, num_splits, T * group, device=q.device)
    strides = (*q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
               block_tables.stride(0))
    meta = dict(GROUP=group, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_M=block_m,
                BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=precision, DOT_UPCAST=upcast,
                HAS_WINDOW=sliding_window is not None, num_warps=4 if block_m * block_d <= 64 * 64 else 8, num_stages=2)
    _tree_attn_prefix_kernel[(B * Hkv, num_splits, m_blocks)](
        q, k_cache, v_cache, block_tables, prefix_lens,
        depths if sliding_window is not None else prefix_lens, partial_out, partial_lse,
        qk_scale, T, Hkv, num_splits, sliding_window or 0, *strides, **meta)
    _tree_attn_merge_kernel[(B * Hkv, m_blocks)](
        q, k_cache, v_cache, block_tables, prefix_lens, tree_mask.view(torch.uint8),
        partial_out, partial_lse, out, qk_scale, T, Hkv, num_splits, *strides,
        *out.stride()[:3], **meta)
    return out
